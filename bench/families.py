"""The public MoE families on moeflow against transformers, whole models on the same weights in
one process: a training step (forward and backward of the language-model loss) and decoding
(moeflow's compiled decode against transformers' default ``generate`` and its static-cache
compiled ``generate``), on the CPU or a CUDA GPU, in fp32, bf16 or fp16.

    python -m bench.families                              # every registered family, published shapes, CPU, fp32
    python -m bench.families --families qwen3_moe --shape tiny --repeats 2   # a quick look
    python -m bench.families --device cuda --dtype bfloat16                  # the GPU shapes (--shape gpu)

Each family is built by transformers from its own config class at the family's published layer
shapes (``PUBLISHED``: Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, OLMoE-1B-7B, Moonlight-16B-A3B for
DeepSeek-V3's architecture, gpt-oss-20b, Mixtral-8x7B; two MoE layers, one for Mixtral), randomly
initialised in ``--dtype``, saved with ``save_pretrained`` and read by moeflow's converter
(``gpt_from_hf(dir, dtype=)``): the same weights, both then run on ``--device``. transformers
builds its model there (``with torch.device(...)``: on the host its random initialisation draws
every weight on one thread, most of a family's build time on a GPU machine); moeflow's model is
read on the host (``gpt_from_hf`` takes no device) and moved. What is cut to fit a 24 GiB machine
with both models resident is said in each row's ``cut`` (the vocabulary; routed experts, so that
each model holds about 1 B parameters). ``--shape gpu`` (the default on CUDA; ``GPU``) restores
every family's published expert count and Mixtral's second layer (1.0-3.2 B parameters a model:
both models, one model's gradients and the decode caches take well under 40 GiB); what stays cut
is said in ``cut``. The vocabulary stays at 32,768 on the GPU too, by choice rather than for
memory: with two layers a published head (151,936 x 2,048 for Qwen) would be most of a step's
work in both models, where at the published depth it is a small part, and the ratio would say
more about one dense GEMM than about the layers. DeepSeek-V3's own 7,168-wide layers stay out:
256 experts are 11 B parameters a layer, and a cut to 64 (7 B a model) would spend most of the
GPU check's time drawing and copying weights on the host.

The training step: ``tokens`` random tokens per row, ``--train-batch`` rows, both models in train
mode without dropout, each step readying the last one's gradients as the candidate's training
loop does, inside the timing (moeflow's keeps the experts' gradients on the CPU and zeroes them
in place, ``moeflow.zero_grad_``, so that its backward adds into them; transformers' Trainer
drops them, ``zero_grad()``), no optimizer (its update is the same elementwise work for both);
transformers' experts in each of ``--hf-experts`` implementations (default ``grouped_mm,eager``
on the CPU, ``grouped_mm`` on CUDA, the implementation the issue's GPU target is stated
against), the fastest taken, and the ratio to each kept. Each candidate's
loss at its first (untimed) step is kept: the same weights and tokens must give about the same
loss. Decoding: ``--prompt-len`` random prompt tokens, ``--new-tokens`` greedy tokens, for each
batch size of ``--decode-batch``, for the families of ``--decode-families`` (default: all); the
candidates take turns within every repeat (medians); greedy tokens are compared (in bf16 they
may part: a random model's logits are nearly tied, and another kernel order flips an argmax).
On CUDA every clock reading follows a device synchronisation, moeflow's compiled decode runs CUDA
graphs and transformers' static-cache ``generate`` ``mode="reduce-overhead"``, and each
candidate's peak device memory is reported (``bench.common.PeakMemory``: the most allocated
during its calls, both models' weights included; ``resident_gib`` is what was allocated before
them). ``--time-cap`` starts a family only while the time left exceeds 1.3 times the longest
family so far (the first always runs): the GPU check's capped run. The JSON is written after
every family, so a run cut short keeps the families it finished.

Legend: ``B`` rows, ``S`` tokens a row.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import moeflow
from bench.common import RESULTS, PeakMemory
from bench.generate_runs import (CLOCKS, HFStaticGenerate, run_hf, run_moeflow, synced, take_turns,
                                 warm_until_settled)

__all__ = ["PUBLISHED", "GPU", "TINY", "SHAPES", "TIME_CAP_MARGIN", "hf_config", "run_family", "main"]

VOCAB = 32768  # every family's vocabulary, cut to fit both models' embeddings and heads in memory

# model_type -> (transformers config class name, its keyword arguments at the published shapes,
# what was cut). Two MoE layers each (DeepSeek-V3: its first layer is dense, as published)
PUBLISHED: dict[str, tuple[str, dict, str]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
        intermediate_size=6144, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True,
        num_hidden_layers=2), "Qwen3-30B-A3B's layers with 64 of its 128 experts; vocabulary 151,936 -> 32,768"),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632, intermediate_size=5632, num_experts=32, num_experts_per_tok=4,
        num_hidden_layers=2), "Qwen1.5-MoE-A2.7B's layers with 32 of its 60 experts; vocabulary 151,936 -> 32,768"),
    "olmoe": ("OlmoeConfig", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, num_experts=64,
        num_experts_per_tok=8, clip_qkv=None, num_hidden_layers=2, eos_token_id=VOCAB - 1, pad_token_id=1),
        "OLMoE-1B-7B's layers; vocabulary 50,304 -> 32,768"),
    "deepseek_v3": ("DeepseekV3Config", dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, moe_intermediate_size=1408,
        intermediate_size=11264, n_routed_experts=32, num_experts_per_tok=6, n_group=1, topk_group=1,
        n_shared_experts=2, routed_scaling_factor=2.446, first_k_dense_replace=1, num_hidden_layers=3),
        "Moonlight-16B-A3B's layers (a published deepseek_v3 checkpoint: MLA without a query bottleneck, sigmoid "
        "scores with the correction bias, 2 shared experts, a dense first layer) with 32 of its 64 routed experts; "
        "vocabulary 163,840 -> 32,768. DeepSeek-V3's own layers (hidden 7,168) do not fit twice in 24 GiB"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, intermediate_size=2880,
        num_local_experts=16, num_experts_per_tok=4, sliding_window=128, num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"]),
        "gpt-oss-20b's layers with 16 of its 32 experts; vocabulary 201,088 -> 32,768"),
    "mixtral": ("MixtralConfig", dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, num_local_experts=4,
        num_experts_per_tok=2, num_hidden_layers=1), "one of Mixtral-8x7B's layers with 4 of its 8 experts; "
                                                     "vocabulary 32,000 -> 32,768"),
}

# --shape gpu: PUBLISHED's fields overridden by these (every published expert count; Mixtral's two
# layers), and what is still cut
GPU: dict[str, tuple[dict, str]] = {
    "qwen3_moe": (dict(num_experts=128), "Qwen3-30B-A3B's layers, all 128 experts; vocabulary 151,936 -> 32,768"),
    "qwen2_moe": (dict(num_experts=60), "Qwen1.5-MoE-A2.7B's layers, all 60 experts; vocabulary 151,936 -> 32,768"),
    "olmoe": ({}, "OLMoE-1B-7B's layers, all 64 experts; vocabulary 50,304 -> 32,768"),
    "deepseek_v3": (dict(n_routed_experts=64), "Moonlight-16B-A3B's layers (deepseek_v3), all 64 routed experts; "
                    "vocabulary 163,840 -> 32,768; DeepSeek-V3's own 7,168-wide layers left out (module docstring)"),
    "gpt_oss": (dict(num_local_experts=32), "gpt-oss-20b's layers, all 32 experts; vocabulary 201,088 -> 32,768"),
    "mixtral": (dict(num_local_experts=8, num_hidden_layers=2),
                "two of Mixtral-8x7B's layers, all 8 experts; vocabulary 32,000 -> 32,768"),
}

# the same families at test sizes (``--shape tiny``): every structural option of PUBLISHED kept
TINY: dict[str, dict] = {
    "qwen3_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      moe_intermediate_size=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=96, num_experts=8, num_experts_per_tok=2),
    "olmoe": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2),
    "deepseek_v3": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                        intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2),
    "gpt_oss": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=8),
    "mixtral": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                    num_local_experts=4, num_experts_per_tok=2),
}


SHAPES = ("published", "gpu", "tiny")
TIME_CAP_MARGIN = 1.3  # --time-cap: a family starts while the time left exceeds this times the longest so far


def hf_config(family: str, shape: str, max_seq_len: int):  # type: ignore[no-untyped-def]
    """The transformers config of ``family`` at ``shape`` (one of ``SHAPES``)."""
    import transformers

    if family not in PUBLISHED:
        raise SystemExit(f"--families: {family!r} is not one of {', '.join(PUBLISHED)}")
    if shape not in SHAPES:
        raise SystemExit(f"--shape: {shape!r} is not one of {', '.join(SHAPES)}")
    cls_name, fields, _ = PUBLISHED[family]
    if shape == "tiny":
        fields = {**fields, **TINY[family]}
    elif shape == "gpu":
        fields = {**fields, **GPU[family][0]}
    fields = {**fields, "vocab_size": 512 if shape == "tiny" else VOCAB, "max_position_embeddings": max_seq_len,
              "tie_word_embeddings": False}
    return getattr(transformers, cls_name)(**fields)


def _cut(family: str, shape: str) -> str:
    return {"published": PUBLISHED[family][2], "gpu": GPU[family][1]}.get(shape, "tiny test shapes")


def _build(family: str, args: argparse.Namespace, tmp: Path):  # type: ignore[no-untyped-def]
    """transformers' model of ``family`` (random, eval, ``--dtype``, built on ``--device``) and
    moeflow's reading of its ``save_pretrained`` directory (moved there): the same weights."""
    import transformers

    from moeflow.convert.hf import gpt_from_hf

    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    config = hf_config(family, args.shape, args.prompt_len + args.new_tokens + args.tokens)
    with torch.device(args.device):  # transformers' own way to build on a device (module docstring)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    hf.save_pretrained(tmp / family)
    model = gpt_from_hf(tmp / family, dtype=dtype).eval()
    return hf, model.to(args.device)


def _tokens(args: argparse.Namespace, vocab: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random token ids ``[rows, cols]``, drawn on the host (the same ids on every device), on ``--device``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (rows, cols), generator=gen, device="cpu").to(args.device)


def _train_step(zero, run, idx_BS: torch.Tensor, clock) -> float:  # type: ignore[no-untyped-def]
    """Seconds of one step's gradient work: ``zero()`` readying the last step's gradients (as the
    candidate's training loop does), then forward and backward of ``run(idx_BS)``'s loss."""
    t0 = clock()
    zero()
    run(idx_BS).backward()
    return clock() - t0


def _first_loss(zero, run, idx_BS: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """The untimed first step (the warm-up): its loss, read on the host once."""
    zero()
    loss = run(idx_BS)
    loss.backward()
    return float(loss.detach().float().item())


def _train_rows(args: argparse.Namespace, hf, model, clock) -> dict:  # type: ignore[no-untyped-def]
    """Median train-step times of moeflow and of transformers' experts implementations, in turn;
    each one's ratio (transformers' time over moeflow's), first-step loss and peak memory."""
    idx_BS = _tokens(args, hf.config.vocab_size, args.train_batch, args.tokens, args.seed + 1)
    # each candidate readies its gradients as its own training loop does: moeflow's keeps the
    # experts' gradients and zeroes them in place (``moeflow.zero_grad_``; its backward adds into
    # them), transformers' Trainer drops them (``zero_grad()``, set_to_none)
    cands = {"moeflow": (lambda: moeflow.zero_grad_(model), lambda x: model.loss(x[:, :-1], x[:, 1:]))}
    for impl in args.hf_experts:
        cands[f"hf:{impl}"] = (lambda: hf.zero_grad(set_to_none=True), lambda x, impl=impl: _hf_loss(hf, impl, x))
    peaks = {name: PeakMemory(args.device) for name in cands}
    for m in (model, hf):
        m.train()
    times: dict[str, list[float]] = {name: [] for name in cands}
    try:
        losses = {name: peaks[name].wrap(_first_loss)(zero, run, idx_BS) for name, (zero, run) in cands.items()}
        for r in range(args.repeats):
            for name in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                zero, run = cands[name]
                times[name].append(peaks[name].wrap(_train_step)(zero, run, idx_BS, clock))
    finally:
        for m in (model, hf):
            m.eval()
            m.zero_grad(set_to_none=True)
    tokens = args.train_batch * (args.tokens - 1)
    med = {name: statistics.median(t) for name, t in times.items()}
    best_hf = min((n for n in med if n.startswith("hf:")), key=med.__getitem__)
    return {"tokens": tokens, "median_s": med, "tokens_per_s": {n: tokens / s for n, s in med.items()},
            "hf_best": best_hf, "ratio": med[best_hf] / med["moeflow"],
            "ratios": {n: med[n] / med["moeflow"] for n in med if n != "moeflow"}, "first_loss": losses,
            "peak_gib": {n: pk.gib for n, pk in peaks.items()}}


def _hf_loss(hf, impl: str, idx_BS: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' own loss over the targets moeflow's ``loss`` takes: every next token. Its
    ``labels`` alone would be shifted inside, dropping the last row position's target."""
    hf.set_experts_implementation(impl)
    targets = idx_BS[:, 1:].contiguous()
    return hf(input_ids=idx_BS[:, :-1], labels=targets, shift_labels=targets).loss


def _decode_rows(args: argparse.Namespace, hf, model, clock, batch: int) -> dict:  # type: ignore[no-untyped-def]
    """Greedy decoding of ``batch`` rows: moeflow compiled against transformers' default
    ``generate`` and its static-cache compiled ``generate`` (each warmed up until it settles),
    in turn; each one's peak memory over its warm-up and timed calls."""
    idx_BS = _tokens(args, hf.config.vocab_size, batch, args.prompt_len, args.seed + 2)
    n = args.new_tokens
    hf.set_experts_implementation(args.hf_experts[0])
    static = HFStaticGenerate(hf) if args.hf_static else None
    cands = {"moeflow:compiled": lambda: run_moeflow(model, idx_BS, n, clock, compile=True),
             "hf:generate": lambda: run_hf(hf, idx_BS, n, clock)}
    if static is not None:
        cands["hf:static"] = lambda: static(idx_BS, n, clock)
    peaks = {name: PeakMemory(args.device) for name in cands}
    cands = {name: peaks[name].wrap(run) for name, run in cands.items()}
    warm, failed = {}, {}
    for name, run in list(cands.items()):
        if name == "hf:generate":
            continue
        try:
            warm[name] = warm_until_settled(run, max_calls=args.max_warmups)
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as err:
            if name != "hf:static":
                raise
            # transformers' static cache with sliding-window layers (gpt-oss) recompiles at every
            # step until dynamo's limit: that candidate is reported as failed, the others run on
            failed[name] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            del cands[name], peaks[name]
            static = None
    cands["hf:generate"]()
    med, tokens = take_turns(cands, args.repeats)
    steps = batch * (n - 1)
    rates = {name: steps / dec for name, (_, dec) in med.items()}
    out = {"batch": batch, "tokens_per_s": rates, "warm_up_calls": {k: v["calls"] for k, v in warm.items()},
           "tokens_equal": {name: tokens[name] == tokens["hf:generate"] for name in tokens},
           "compiled_over_default": rates["moeflow:compiled"] / rates["hf:generate"],
           "peak_gib": {name: pk.gib for name, pk in peaks.items()}}
    if failed:
        out["failed"] = failed
    if static is not None:
        out["compiled_over_static"] = rates["moeflow:compiled"] / rates["hf:static"]
    return out


def _gib(value: float | None) -> str:
    return "" if value is None else f", peak {value:.1f} GiB"


def run_family(family: str, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moeflow-bench-families-") as tmp:
        hf, model = _build(family, args, Path(tmp))
    params = sum(p.numel() for p in model.parameters())
    cuda = args.device.type == "cuda"
    row = {"family": family, "cut": _cut(family, args.shape), "parameters": params,
           "build_s": time.monotonic() - t0,
           "resident_gib": torch.cuda.memory_allocated(args.device) / 2**30 if cuda else None}
    print(f"{family}: {params / 1e6:,.1f} M parameters ({row['cut']})", flush=True)
    row["train"] = None  # (--no-train: the decoding rows alone)
    if args.train:
        train = row["train"] = _train_rows(args, hf, model, synced(CLOCKS[args.clock], args.device))
        best = train["hf_best"]
        print(f"  train step: moeflow {train['tokens_per_s']['moeflow']:,.0f} tok/s{_gib(train['peak_gib']['moeflow'])}, "
              f"{best} {train['tokens_per_s'][best]:,.0f} tok/s{_gib(train['peak_gib'][best])}: {train['ratio']:.2f}x; "
              f"first losses {', '.join(f'{k} {v:.4f}' for k, v in train['first_loss'].items())}", flush=True)
    row["decode"] = []
    for batch in (args.decode_batch if family in args.decode_families else []):
        with torch.no_grad():
            d = _decode_rows(args, hf, model, CLOCKS[args.clock], batch)
        row["decode"].append(d)
        rates, peak = d["tokens_per_s"], d["peak_gib"]
        print(f"  decode B={batch}: moeflow compiled {rates['moeflow:compiled']:,.0f} tok/s"
              f"{_gib(peak['moeflow:compiled'])}, transformers' generate {rates['hf:generate']:,.0f}"
              f"{_gib(peak['hf:generate'])}: {d['compiled_over_default']:.2f}x"
              + (f"; static-cache compiled {rates['hf:static']:,.0f}{_gib(peak['hf:static'])}: "
                 f"{d['compiled_over_static']:.2f}x" if "compiled_over_static" in d else "")
              + "".join(f"; {k} failed ({v})" for k, v in d.get("failed", {}).items())
              + f"; tokens equal: {d['tokens_equal']}", flush=True)
    del hf, model
    gc.collect()
    torch._dynamo.reset()  # the family's compiled graphs (and their CUDA graph pools) go with it
    if cuda:
        torch.cuda.empty_cache()
    row["seconds"] = time.monotonic() - t0
    return row


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(PUBLISHED), help="comma-separated model types, run in this order")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="both models' weights and activations (default float32)")
    p.add_argument("--shape", choices=SHAPES, default=None,
                   help="published (the CPU's cuts), gpu (fewer cuts), tiny (tests); "
                        "default: gpu on CUDA, else published")
    p.add_argument("--tokens", type=int, default=257, help="tokens a training row (S + 1)")
    p.add_argument("--train-batch", type=int, default=2)
    p.add_argument("--train", action=argparse.BooleanOptionalAction, default=True,
                   help="time the train step (--no-train: the decoding rows alone; the report's train is null)")
    p.add_argument("--decode-batch", default="1,8", help="comma-separated rows of the decoding runs")
    p.add_argument("--decode-families", default=None,
                   help="comma-separated families that also decode (default: all of --families; '': none)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hf-experts", default=None, help="transformers' experts implementations (first: decode's); "
                   "default grouped_mm,eager on the CPU, grouped_mm on CUDA")
    p.add_argument("--hf-static", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' static-cache compiled generate")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-warmups", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--clock", choices=list(CLOCKS), default="wall")
    p.add_argument("--time-cap", type=float, default=None,
                   help="seconds: start a family only while the time left exceeds 1.3x the longest so far")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def _names(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip()]


def _check(args: argparse.Namespace) -> argparse.Namespace:
    """The flags checked (each refusal names its flag and value), defaults by device filled in;
    whether CUDA is there is checked last, so that every other refusal shows on any machine."""
    try:
        args.decode_batch = [int(b) for b in args.decode_batch.split(",") if b]
    except ValueError:
        raise SystemExit(f"--decode-batch: comma-separated integers, got {args.decode_batch!r}") from None
    if not args.decode_batch or min(args.decode_batch) < 1:
        raise SystemExit(f"--decode-batch: every batch must be at least 1, got {args.decode_batch}")
    for name in ("tokens", "train_batch", "prompt_len", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < (2 if name in ("tokens", "new_tokens") else 1):
            raise SystemExit(f"--{name.replace('_', '-')} must be at least {2 if name in ('tokens', 'new_tokens') else 1}")
    if args.max_warmups < 3:  # bench.generate_runs.warm_until_settled compares the last calls of at least 3
        raise SystemExit(f"--max-warmups must be at least 3, got {args.max_warmups}")
    if args.time_cap is not None and not (math.isfinite(args.time_cap) and args.time_cap > 0):
        raise SystemExit(f"--time-cap must be a positive number of seconds, got {args.time_cap}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise SystemExit(f"--device: cpu or cuda[:N], got {args.device!r}")
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    if cuda and args.clock == "cpu":
        raise SystemExit("--clock cpu with --device cuda: the process's CPU time does not count the GPU's work "
                         "(use --clock wall)")
    args.shape = args.shape or ("gpu" if cuda else "published")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    known = ["eager", *ALL_EXPERTS_FUNCTIONS.valid_keys()]
    args.hf_experts = _names(args.hf_experts if args.hf_experts is not None else
                             "grouped_mm" if cuda else "grouped_mm,eager")
    unknown = [s for s in args.hf_experts if s not in known]
    if unknown or not args.hf_experts:
        raise SystemExit(f"--hf-experts: {', '.join(map(repr, unknown)) or 'name at least one'} "
                         f"(transformers' implementations: {', '.join(known)})")
    args.families = _names(args.families)
    from moeflow.convert.hf import FAMILIES

    missing = [f for f in args.families if f not in FAMILIES]
    if missing or not args.families:
        raise SystemExit(f"--families: moeflow does not convert {', '.join(missing)} yet "
                         f"({', '.join(sorted(FAMILIES))})" if missing else "--families: name at least one")
    args.decode_families = args.families if args.decode_families is None else _names(args.decode_families)
    stray = [f for f in args.decode_families if f not in args.families]
    if stray:
        raise SystemExit(f"--decode-families: {', '.join(stray)} not among --families ({', '.join(args.families)})")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device is visible (torch {torch.__version__})")
    if cuda and (args.device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"--device {args.device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return args


def _write(path: Path | None, args: argparse.Namespace, rows: list[dict], not_run: dict[str, str]) -> None:
    if path is None:
        return
    cuda = args.device.type == "cuda"
    report = {"bench": "families", "date": time.strftime("%Y-%m-%d"),
              "machine": platform.processor() or platform.machine(),
              "device": str(args.device), "device_name": torch.cuda.get_device_name(args.device) if cuda else None,
              "threads": args.threads, "clock": args.clock, "dtype": args.dtype, "shape": args.shape,
              "torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k != "json"},
              "rows": rows, "not_run": not_run}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    args = _check(_parser().parse_args(argv))
    path = args.json or default_json
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    not_run: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        for family in args.families:
            left = math.inf if args.time_cap is None else args.time_cap - (time.monotonic() - t0)
            longest = max((r["seconds"] for r in rows), default=0.0)
            if rows and left < TIME_CAP_MARGIN * longest:
                not_run[family] = (f"time cap: {max(left, 0):.0f} s left of --time-cap {args.time_cap:.0f}, under "
                                   f"{TIME_CAP_MARGIN}x the longest family so far ({longest:.0f} s)")
                print(f"{family}: not run ({not_run[family]})", flush=True)
            else:
                rows.append(run_family(family, args))
            _write(path, args, rows, not_run)  # after every family: a run cut short keeps what it finished
    finally:
        torch.set_num_threads(threads)
    if path is not None:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "families.json"))
