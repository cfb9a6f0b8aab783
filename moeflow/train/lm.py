"""Train the MoE GPT on the Shakespeare corpus, on one process or on expert-parallel ranks.

One code path for both: with ``group`` of W ranks (torchrun), the experts are spread over the
ranks, each rank takes ``1/W`` of every global batch, and the step is the one a single process
would take on the whole batch:

- each rank back-propagates ``(loss_r + aux_r) / (W * accum)``; the all-to-all backward already
  sums the expert gradients over the ranks' tokens, and the dense gradients are summed over the
  group (``all_reduce_gradients(..., average=False)``), so both equal the gradient of the
  global mean loss;
- gradient clipping uses the global norm (``moeflow.parallel.clip_grad_norm_``);
- batches are drawn by step number, so the global batch does not depend on W.

The expert-parallel layers exchange rows with the flat all-to-all, or with the two-level one
(inside each node, then across nodes) when the ranks span several nodes (``node_size``, the
ranks per node, below the world size) or ``exchange="two-level"`` asks for it; the history
records which (``"exchange"``). Under torchrun, ``moeflow.train.worker`` runs it on every rank.

Balance losses are per rank (on its own tokens), as in Switch/GShard; with W > 1 and a nonzero
``load_balance_coef`` the training trajectory therefore differs slightly from one process on the
whole batch (the task loss of the first step is identical); it is the trajectory of one process
that accumulates the ranks' halves of each batch as micro-batches (tested in fp64).

The run's settings are ``LMTrainConfig`` (``moeflow.train.lm_config``); the run directory (one
run per ``out_dir``: refusing another run, resuming, what a checkpoint holds besides the weights)
and rebuilding a model from a checkpoint are ``moeflow.train.lm_checkpoint``; the checks of the
settings against the ranks, the schedule, the optimizer and the validation loss are
``moeflow.train.lm_setup``. Every check of the settings and of ``out_dir`` runs before any
training work, on every rank alike.

Legend: moeflow.types, plus ``L`` MoE layers of the model.
"""

from __future__ import annotations

import json
import time

import torch

import moeflow
from moeflow.checkpoint import load_checkpoint, read_index, save_checkpoint, save_checkpoint_async
from moeflow.models import MoEGPT, vocab_parallel
from moeflow.parallel import (
    all_reduce_gradients,
    clip_grad_norm_,
    dense_parameters,
    expert_parallel,
    fix_tuned_settings,
    make_groups,
    sync_load_counts,
    sync_replica_gradients,
    tuned_settings,
)
from moeflow.parallel.comm import ProcessGroup, all_reduce_sum, process_position
from moeflow.train.data import load_corpus
from moeflow.train.init_from import check_init_weights, init_model
from moeflow.train.lm_checkpoint import (
    MODEL_FAMILY,
    build_from_checkpoint,
    checkpoint_extra,
    open_run,
    write_history,
)
from moeflow.train.lm_config import LMTrainConfig
from moeflow.train.lm_data import open_run_data
from moeflow.train.lm_setup import (
    autocast,
    build_optimizer,
    check_world_settings,
    corpus_tokenizer,
    evaluate,
    exchange_for,
    lr_at,
    rebalance_experts,
)
from moeflow.train.metrics import METRICS_FILE, RunLog, read_metrics
from moeflow.train.nonfinite import check_weights, nonfinite_step, step_is_finite
from moeflow.train.placement_state import rebalance_record, restore_rebalance
from moeflow.train.tokens import Prefetcher, TokenStream

__all__ = ["LMTrainConfig", "train_lm", "check_world_settings", "exchange_for", "MODEL_FAMILY",
           "build_from_checkpoint"]


def train_lm(cfg: LMTrainConfig, *, group: ProcessGroup | None = None, node_size: int | None = None) -> dict:
    """Run the training; every rank of ``group`` calls it. ``node_size``: the ranks per node
    (torchrun's ``LOCAL_WORLD_SIZE``; None: one node), for the two-level exchange, which needs
    ``group=None`` (the whole job). Returns (on every rank) the history:
    ``{"run_id": str, "step": [...], "train_loss": [...], "val": [[step, loss], ...], "load":
    [[step, [[frac per expert] per MoE layer]], ...], "tokens_per_s": float, "checkpoint": path,
    "exchange": "flat" | "two-level" | None, ...}``; rank 0 also writes it to
    ``out_dir/history.json`` (before every checkpoint too) and, with ``plot``,
    ``out_dir/training.png``. With ``resume`` on a run already at ``steps`` it
    trains nothing, touches no file and returns the saved history. ``cfg.device="cuda"`` (no
    index) is this process's current GPU: on a torchrun rank ``cuda:LOCAL_RANK``, which
    ``init_distributed`` made current."""
    rank, world = process_position(group)
    device = torch.device(cfg.device)
    if device.type == "cuda" and device.index is None:  # this process's GPU (a rank's cuda:LOCAL_RANK)
        device = torch.device("cuda", torch.cuda.current_device())
    recorded = check_world_settings(cfg, world, node_size)
    exchange = exchange_for(cfg, world, node_size)
    if exchange == "two-level" and (group is not None or node_size is None):
        raise ValueError(f"exchange='two-level' groups the ranks of the whole job by node: it needs group=None and "
                         f"node_size (ranks per node, the same on every node), got node_size={node_size}")
    corpus = None if cfg.data else load_corpus(cfg.val_works)
    if cfg.init_from is not None and not cfg.resume:  # a new run: its weights can be read (before out_dir is claimed)
        check_init_weights(cfg.init_from)
    run = open_run(cfg, group)  # refuses another run in out_dir, claims it, finds the checkpoint to resume
    if run.finished:
        return run.history
    data_notes: list[str] = []
    fingerprint = None
    if corpus is not None:
        tok = corpus_tokenizer(cfg, corpus.train_text, group)
        train_sampler = TokenStream.from_text(corpus.train_text, tok, cfg.seq_len, cfg.seed)
        val = TokenStream.from_text(corpus.val_text, tok, cfg.seq_len, cfg.seed + 1)
    else:  # one's own data: prepared (once) and memory-mapped, each rank reading its own rows
        own = open_run_data(cfg, group)
        tok, val, data_notes, fingerprint = own.tokenizer, own.val, own.notes, own.fingerprint
        train_sampler = own.train
        if run.checkpoint is not None:
            saved = read_index(run.checkpoint)["extra"].get("data")
            if saved is not None and saved != fingerprint:
                raise ValueError(f"data: the training or validation data differs from the data the checkpoint "
                                 f"{run.checkpoint} was trained on (their tokens changed); resume=True continues a run "
                                 "on its own data: restore it, or start a new run (another out_dir, or overwrite=True)")
    train = Prefetcher(train_sampler)  # the next batch is read while this step runs

    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    model_cfg = cfg.model_config(vocab_size=tok.vocab_size)
    if cfg.init_from is not None and run.checkpoint is None:  # the whole model on every rank, then spread
        model = init_model(cfg.init_from, model_cfg, dtype=getattr(torch, cfg.dtype), device=device)
    else:  # random, or the weights of the checkpoint the run continues (loaded below)
        model = MoEGPT(model_cfg, device=device, dtype=getattr(torch, cfg.dtype))
    if world > 1:
        hierarchy = make_groups(world, node_size=node_size).hierarchy if exchange == "two-level" else None
        expert_parallel(model, group, config=cfg.parallel_config(), hierarchy=hierarchy)
        if cfg.vocab_parallel:
            vocab_parallel(model, group)
        if recorded is not None:
            fix_tuned_settings(model, recorded)
    slots = cfg.expert_slots or model_cfg.num_experts // world
    layers = moeflow.moe_layers(model)
    E = model_cfg.num_experts
    counts_LE = torch.zeros(len(layers), E, dtype=torch.float64, device=device)
    window_LE = torch.zeros_like(counts_LE)  # load since the last rebalance (this rank's tokens)
    if cfg.rebalance_every and run.checkpoint is not None:  # the saved placement and window (before the optimizer)
        restore_rebalance(model, read_index(run.checkpoint)["extra"].get("rebalance"), world=world, rank=rank,
                          window_LE=window_LE, slots=slots)
    torch.manual_seed(cfg.seed * 1_000 + 1 + rank)  # router noise and dropout: per rank, reproducible
    opt = build_optimizer(model, cfg)
    ckpt_root = cfg.out_dir / "checkpoints"
    extra = checkpoint_extra(cfg, model_cfg, tok, run.run_id, data=fingerprint)

    start, history = run.start, run.history
    if run.checkpoint is not None:  # weights, optimizer and router state, this rank's RNG
        load_checkpoint(run.checkpoint, model, opt, group=group)

    micro = cfg.batch_size // cfg.grad_accum
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bias_update = model_cfg.router.bias_update_rate > 0

    log_every = cfg.log_every or max(1, min(10, cfg.steps // 50 or 1))
    bar = None  # rank 0's console and metrics files (moeflow.train.metrics)
    if rank == 0:
        bar = RunLog(cfg.out_dir, start=start, total=cfg.steps, every=log_every, progress=cfg.progress,
                     tensorboard=cfg.tensorboard)
        for note in data_notes:
            bar.write(note)
    if start == 0:
        history["val"].append([0, evaluate(model, val, cfg, group, device)])
        if bar is not None:
            bar.validation(0, history["val"][-1][1])
    since_log, t_start, t_log = 0, time.perf_counter(), time.perf_counter()
    pending = None  # the latest background save (a stop waits for it: it holds the last good weights)
    for step in range(start, cfg.steps):
        t_step = time.perf_counter()
        for group_ in opt.param_groups:
            group_["lr"] = lr_at(step, cfg)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        aux_sum = torch.zeros((), dtype=torch.float64, device=device)
        for m in range(cfg.grad_accum):
            x, y = train.batch(step * cfg.grad_accum + m, micro, rank=rank, world=world)
            with autocast(cfg, device):
                loss = model.loss(x.to(device), y.to(device))
                aux = moeflow.aux_loss(model)
                objective = (loss + aux) / (world * cfg.grad_accum)
            objective.backward()
            loss_sum += loss.detach().double()
            aux_sum += torch.as_tensor(aux, device=device).detach().double()
            for i, layer in enumerate(layers):
                counts_LE[i] += layer.last_counts_E.to(counts_LE.dtype)
                window_LE[i] += layer.last_counts_E.to(counts_LE.dtype)
        if world > 1:
            sync_replica_gradients(model)
            all_reduce_gradients(dense_parameters(model), group, average=False)
        grad_norm = float(clip_grad_norm_(model, cfg.grad_clip, group))
        # the same two numbers on every rank (both reduced over the group): every rank decides alike
        step_loss = float(all_reduce_sum(loss_sum, group)) / (world * cfg.grad_accum)
        finite = step_is_finite(step_loss, grad_norm)
        if not finite:
            nonfinite_step(cfg, history, step + 1, step_loss, grad_norm, pending, rank, bar)
        else:
            opt.step()
        moeflow.zero_grad_(model)  # the experts' gradients kept and zeroed in place, the rest dropped
        if bias_update and finite:
            if world > 1:
                sync_load_counts(model, group)
            moeflow.update_expert_bias(model)
        since_log += 1
        if cfg.rebalance_every and (step + 1) % cfg.rebalance_every == 0 and step + 1 != cfg.steps:
            moved = rebalance_experts(model, opt, window_LE, group, slots)
            history["rebalance"].append([step + 1, moved])
            window_LE.zero_()
            if bar is not None:
                mean = lambda v: sum(v) / len(v)  # noqa: E731
                bar.write(f"step {step + 1}: experts moved; busiest rank's share of the rows since the last move "
                          f"{mean(moved['before']):.1%} -> {mean(moved['after']):.1%} (mean over layers)")

        if finite:  # a skipped step leaves no point on the loss curve (and no NaN in history.json)
            history["step"].append(step + 1)
            history["train_loss"].append(step_loss)
            history["lr"].append(lr_at(step, cfg))
        now = time.perf_counter()
        record = {"step": step + 1, "loss": step_loss, "lr": lr_at(step, cfg), "grad_norm": grad_norm,
                  "aux_loss": float(aux_sum) / cfg.grad_accum,  # this rank's (rank 0's) balance losses
                  "tokens_per_s": tokens_per_step / max(now - t_step, 1e-9), "time_s": now - t_start}
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            all_reduce_sum(counts_LE, group)
            frac_LE = counts_LE / counts_LE.sum(-1, keepdim=True).clamp(min=1)
            history["load"].append([step + 1, frac_LE.tolist()])
            balance = float((frac_LE.max(-1).values * E).mean())  # max/mean load, 1.0 = balanced
            record["max_load"] = balance
            record["window_tokens_per_s"] = tokens_per_step * since_log / max(now - t_log, 1e-9)
            counts_LE.zero_()
            since_log, t_log = 0, now
        if bar is not None and finite:
            bar.step(record)
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 != cfg.steps:
            t_eval = time.perf_counter()
            history["val"].append([step + 1, evaluate(model, val, cfg, group, device)])
            t_log += time.perf_counter() - t_eval  # the window's tokens/s counts training time only
            if bar is not None:
                bar.validation(step + 1, history["val"][-1][1])
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 != cfg.steps:
            if rank == 0:  # before the checkpoint, so that it never lags behind one (resume cuts it back)
                write_history(cfg.out_dir, history)
            check_weights(model, step + 1, group, pending)
            if cfg.rebalance_every:
                extra = {**extra, "rebalance": rebalance_record(model, window_LE, group, world)}
            if cfg.async_checkpoints:
                pending = save_checkpoint_async(ckpt_root, step + 1, model, opt, extra=extra, group=group,
                                                keep=cfg.keep_checkpoints)
            else:
                save_checkpoint(ckpt_root, step + 1, model, opt, extra=extra, group=group, keep=cfg.keep_checkpoints)
    elapsed = time.perf_counter() - t_start
    if not history["val"] or history["val"][-1][0] != cfg.steps:
        history["val"].append([cfg.steps, evaluate(model, val, cfg, group, device)])
        if bar is not None:
            bar.validation(cfg.steps, history["val"][-1][1])
    if bar is not None:
        bar.close()
    history["tokens_per_s"] = tokens_per_step * (cfg.steps - start) / max(elapsed, 1e-9)
    # the time steps waited for their data (read one batch ahead)
    history["data_wait_s"] = train.waited_s
    history["data_share"] = train.waited_s / max(elapsed, 1e-9)
    train.close()
    history["world_size"] = world
    history["exchange"], history["node_size"] = exchange, node_size
    tuned = tuned_settings(model) if world > 1 and "auto" in (cfg.parallel, cfg.overlap_degree) else None
    if tuned is not None:
        history["tuned"] = tuned
    if rank == 0:
        write_history(cfg.out_dir, history)
    check_weights(model, cfg.steps, group, pending)
    if cfg.rebalance_every:
        extra = {**extra, "rebalance": rebalance_record(model, window_LE, group, world)}
    path = save_checkpoint(ckpt_root, cfg.steps, model, opt, extra=extra, group=group, keep=cfg.keep_checkpoints)
    history["checkpoint"] = str(path)
    if rank == 0:
        write_history(cfg.out_dir, history)
        if tuned is not None:
            (cfg.out_dir / "tuned.json").write_text(json.dumps(tuned, indent=1))
        if cfg.plot:
            from moeflow.train.plots import plot_training

            plot_training(history, cfg.out_dir / "training.png", metrics=read_metrics(cfg.out_dir / METRICS_FILE))
    return history
