"""The setup and evaluation around the language-model training loop (``moeflow.train.lm``): the
checks of a run's settings against its number of ranks (before any work), the learning-rate
schedule, the optimizer, autocast, the tokenizer of the built-in corpus, the validation loss and
the experts' moves between ranks.

Legend: moeflow.types, plus ``L`` MoE layers of the model.
"""

from __future__ import annotations

import contextlib
import json
import math

import torch

import moeflow
from moeflow.models import MoEGPT
from moeflow.parallel import apply_placement, placement_of, plan_placement
from moeflow.parallel.comm import ProcessGroup, all_reduce_sum, gather_objects, process_position
from moeflow.parallel.placement.tuner import ParallelTuner
from moeflow.train.data import BPETokenizer, ByteTokenizer, Tokenizer, tokenizer_from_dict
from moeflow.train.lm_config import LMTrainConfig
from moeflow.train.tokens import TokenSampler

__all__ = ["autocast", "build_optimizer", "check_world_settings", "corpus_tokenizer", "evaluate", "exchange_for",
           "lr_at", "rebalance_experts"]


def lr_at(step: int, cfg: LMTrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr`` at ``cfg.steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def autocast(cfg: LMTrainConfig, device: torch.device):  # type: ignore[no-untyped-def]
    amp = cfg.amp
    if amp == "auto":
        amp = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "off"
    if amp == "off":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def build_optimizer(model: MoEGPT, cfg: LMTrainConfig) -> torch.optim.Optimizer:
    # no weight decay on norms and biases (1-D), decay on matrices and 3-D expert weights
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def corpus_tokenizer(cfg: LMTrainConfig, train_text: str, group: ProcessGroup | None) -> Tokenizer:
    if cfg.init_from is not None:  # the model's own; bytes for one without (moeflow.train.init_from)
        saved = cfg.init_extra().get("tokenizer")  # type: ignore[union-attr]
        return ByteTokenizer() if saved is None else tokenizer_from_dict(saved)
    if cfg.tokenizer == "byte":
        return ByteTokenizer()
    rank, _ = process_position(group)
    # trained once, on rank 0, and shared, so every rank encodes with the very same merges
    desc = BPETokenizer.train(train_text, cfg.bpe_vocab).to_dict() if rank == 0 else None
    return tokenizer_from_dict(gather_objects(desc, group)[0])  # type: ignore[arg-type]


def evaluate(model: MoEGPT, stream: TokenSampler, cfg: LMTrainConfig, group: ProcessGroup | None,
             device: torch.device) -> float:
    """Mean validation cross-entropy over ``eval_batches`` fixed global batches."""
    with torch.no_grad():
        rank, world = process_position(group)
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        with autocast(cfg, device):
            for i in range(cfg.eval_batches):
                x, y = stream.batch(i, cfg.batch_size, rank=rank, world=world)
                total += model.loss(x.to(device), y.to(device)).double()
        model.train()
        return float(all_reduce_sum(total, group)) / (cfg.eval_batches * world)


def rebalance_experts(model: MoEGPT, opt: torch.optim.Optimizer, window_LE: torch.Tensor, group: ProcessGroup | None,
               slots: int) -> dict:
    """Move every MoE layer's experts to a placement planned from the group's load since the last
    move; returns, per layer, the busiest rank's share of that load before and after, and the
    slots."""
    load_LE = all_reduce_sum(window_LE.clone(), group)
    layers = moeflow.moe_layers(model)
    plans = [plan_placement(load_E, world=placement_of(layer).world, slots_per_rank=slots)
             for layer, load_E in zip(layers, load_LE)]
    total = load_LE.sum(-1).clamp(min=1).tolist()
    before = [max(placement_of(layer).rank_load(load_E.tolist())) / t for layer, load_E, t in zip(layers, load_LE, total)]
    after = [max(plan.rank_load(load_E.tolist())) / t for plan, load_E, t in zip(plans, load_LE, total)]
    apply_placement(model, plans, opt)
    return {"before": before, "after": after, "slots": [[list(r) for r in plan.slots] for plan in plans]}


def exchange_for(cfg: LMTrainConfig, world: int, node_size: int | None) -> str | None:
    """The exchange the expert-parallel layers use: None on one rank; ``cfg.exchange`` when it
    is not ``"auto"``; else ``"two-level"`` when the ranks span more than one node."""
    if world == 1:
        return None
    if cfg.exchange == "auto":
        return "two-level" if node_size is not None and node_size < world else "flat"
    return cfg.exchange


def check_world_settings(cfg: LMTrainConfig, world: int, node_size: int | None = None) -> list | None:
    """Refuse settings this number of ranks (``node_size`` of them per node, None: unknown)
    cannot run (before any work); return the tuner's recorded choices that ``cfg.tuned`` names
    (None without it)."""
    if cfg.batch_size % (cfg.grad_accum * world):
        raise ValueError(
            f"batch_size={cfg.batch_size} must be divisible by grad_accum x ranks = {cfg.grad_accum} x {world}"
        )
    if world == 1 and (cfg.vocab_parallel or cfg.rebalance_every or cfg.tuned is not None):
        raise ValueError("vocab_parallel, rebalance_every and tuned need more than one rank (--nproc >= 2)")
    E = cfg.model_config(vocab_size=256).num_experts
    if E % world:
        raise ValueError(f"num_experts={E} (the experts of each MoE layer) must divide evenly over the ranks: {E} is "
                         f"not divisible by {world}")
    if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1
                                  or world % node_size):
        raise ValueError(f"node_size={node_size!r} must be a positive divisor of the number of ranks {world}")
    if cfg.exchange == "two-level" and world == 1:
        raise ValueError("exchange='two-level' needs more than one rank")
    if cfg.expert_slots and not cfg.rebalance_every:
        raise ValueError(f"expert_slots={cfg.expert_slots} applies with rebalance_every > 0")
    if cfg.expert_slots and not E // world <= cfg.expert_slots <= E:
        raise ValueError(f"expert_slots={cfg.expert_slots} must lie in [E / ranks, E] = [{E // world}, {E}]")
    if cfg.tuned is None:
        return None
    try:
        recorded = json.loads(cfg.tuned.read_text())
    except (OSError, ValueError) as err:  # missing, unreadable, not UTF-8, not JSON
        raise ValueError(f"tuned={str(cfg.tuned)!r}: cannot read the tuner's choices: {err}") from None
    if not (isinstance(recorded, list) and all(isinstance(layer, list) and all(
            isinstance(r, dict) and isinstance(r.get("parallel"), str) and isinstance(r.get("overlap_degree"), (int, str))
            for r in layer) for layer in recorded)):
        raise ValueError(f"tuned={str(cfg.tuned)!r} is not a tuned.json of moeflow train (a list per MoE layer of "
                         "records with 'parallel' and 'overlap_degree')")
    model_cfg = cfg.model_config(vocab_size=256)
    moe_layers = sum(model_cfg.is_moe_layer(i) for i in range(model_cfg.n_layers))
    if len(recorded) != moe_layers:
        raise ValueError(f"tuned={str(cfg.tuned)!r} holds the choices of {len(recorded)} MoE layer(s); this model has "
                         f"{moe_layers}")
    for records in recorded:
        ParallelTuner(None).fix(records)  # validates every record, as the ranks will
    args = {(r["parallel"], r["overlap_degree"]) for layer in recorded for r in layer}
    if args - {(cfg.parallel, cfg.overlap_degree)}:
        raise ValueError(f"tuned={str(cfg.tuned)!r} was recorded with (parallel, overlap_degree) "
                         f"{sorted(args, key=str)}; this run has ({cfg.parallel!r}, {cfg.overlap_degree!r})")
    return recorded
