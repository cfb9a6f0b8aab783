"""Decode at the memory-bandwidth limit (issue 50, item 3): moeflow's compiled decode step
(``CompiledDecoder``: ``MoEGPT.decode_step`` under ``torch.compile``, CUDA graphs on CUDA) on a
Qwen3-30B-A3B-shaped model with all its layers, against the bytes a step must read at the
device's measured copy bandwidth.

    python -m bench.decode_bandwidth --shape tiny --device cpu            # a quick look (seconds)
    python -m bench.decode_bandwidth --shape qwen3-30b-a3b --device cuda  # the whole model in bf16

The model: ``SHAPES[--shape]`` is a Qwen3-MoE ``config.json`` read by moeflow's own converter
(``moeflow.convert.qwen3_moe.gpt_config_from_hf``), so the model is what ``gpt_from_hf`` builds
from the published checkpoint: 48 blocks of grouped-query attention (32 query heads, 4 key/value
heads of 128, per-head QK norms) and a MoE of 128 experts, top-8, expert hidden 768, width 2048,
vocabulary 151,936: about 30.5 B parameters, 61 GB in bf16. Its weights are random and never
exist on the host (``build_model``: built on the meta device, ``to_empty`` on the device, each
parameter then drawn in place there; buffers zeroed, as their modules start them), so a build
takes seconds. ``--experts-backend`` names the expert GEMM backends to time; ``--weights`` the
weight format (``WEIGHT_FORMATS``: ``bf16``, or ``fp8``: the routed experts' weights in e4m3, ``moeflow.experts.quantize_experts_fp8``).
The cases run batch-major: every backend at the first batch size (batch 1, the issue's target),
then the later ones with the backend that was fastest there (``--later-batches all``: with every
backend); each case is a compilation of its own (``torch._dynamo.reset()`` after every case: the
step does not guard on the backend).

Per backend and batch size (``--batch-sizes``): a cache of ``capacity`` columns (the compiled
decoder's power-of-two bucket of ``prompt_len + warmup + steps``), compiled and warmed up (timed
apart: ``compile_s``), a random prompt of ``--prompt-len`` tokens prefilled eagerly, ``--warmup``
steps, then ``--steps`` timed steps, greedy (the argmax feeds the next step, on the device). On
CUDA an event is recorded between steps and read after the loop (no host synchronisation inside
it); on the CPU ``time.perf_counter`` per step. ``ms_per_step`` is the median step. A
``CompileWatch`` over the timed steps must see no compilation and no CUDA graph recorded.

Bytes a step must read (``bench.generate_checks.decode_step_bytes``): every parameter outside the
routed experts (attention, norms, routers, the head), the embedding rows of the step's tokens,
the routed experts the step's tokens pick, each distinct expert once (``experts_hit``: counted
per MoE layer from the routing of ``--count-steps`` eager steps after the timed ones, on the
same cache; ``expected_experts_hit`` is ``E (1 - (1 - K/E)^B)``, the mean for uniform routing,
beside it), and the keys and values of the context (``mean_context`` columns in every block:
the prompt, the warm-up and, on average, half the timed steps; the static step attends over all
``capacity`` columns, masked, which ``kv_capacity_bytes`` counts). ``copy_gbps``: ``bench.common.copy_bandwidth_gbps``, a 1 GiB
device-to-device copy with its read *and* written bytes counted (what a bandwidth-bound kernel
can reach). ``floor_ms = bytes_per_step / copy_gbps``; ``bandwidth_fraction = floor_ms /
ms_per_step``.

``--profile-steps``: that many more steps of each case at the first batch size under
``torch.profiler`` (``profile_steps``: the kernels a step runs, their count and time per step,
the longest first; a step's time past their sum is the time between kernels).

``--time-budget`` (seconds from the start): a case starts only while the time left exceeds the
longest case so far (the first always runs); the rest are listed in ``skipped``. The JSON
(``--json``) is written after every case, so a run cut short keeps what it finished.

Legend: ``B`` rows, ``E`` experts, ``K`` experts a token picks, ``V`` vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from bench.common import CompileWatch, copy_bandwidth_gbps, sync
from bench.generate_checks import bandwidth_fraction, decode_step_bytes

__all__ = ["SHAPES", "WEIGHT_FORMATS", "gpt_config_for", "build_model", "fill_random_", "expected_experts_hit",
           "count_experts_hit", "time_decode", "main"]

# Qwen3-30B-A3B's config.json (the fields moeflow's converter reads), and a tiny model of the same form
_QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
    "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "tiny": {**_QWEN3_30B_A3B, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
             "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 16, "num_experts_per_tok": 4,
             "num_hidden_layers": 2, "max_window_layers": 2, "vocab_size": 512, "max_position_embeddings": 1024},
}


def _bf16_weights(model: torch.nn.Module) -> None:
    """The model as built: every weight in the model's dtype (nothing to convert)."""


# weight format -> what turns a freshly drawn model into it (in place). The hook for an FP8
# weight-only format: add its name and a function that quantises the experts' weights
def _fp8_weights(model: torch.nn.Module) -> None:
    """The routed experts' weights in e4m3 with a scale per output column
    (``moeflow.experts.quantize_experts_fp8``: the weight-only format, half the experts' bytes)."""
    from moeflow.experts import quantize_experts_fp8

    if quantize_experts_fp8(model) == 0:
        raise ValueError("--weights fp8: the model has no GroupedExperts to quantise")


WEIGHT_FORMATS: dict[str, Callable[[torch.nn.Module], None]] = {"bf16": _bf16_weights, "fp8": _fp8_weights}


def gpt_config_for(shape: str, *, backend: str = "auto", layers: int | None = None):  # type: ignore[no-untyped-def]
    """The ``GPTConfig`` of ``SHAPES[shape]`` as moeflow's Qwen3-MoE converter reads it, its
    experts on the grouped GEMM ``backend``; ``layers``: that many blocks instead of the
    shape's own (a quicker look at the same layers)."""
    from moeflow.convert.qwen3_moe import gpt_config_from_hf

    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    hf = dict(SHAPES[shape])
    if layers is not None:
        if not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be an int >= 1, got {layers!r}")
        hf["num_hidden_layers"] = hf["max_window_layers"] = layers
    config = gpt_config_from_hf(hf)
    return dataclasses.replace(config, experts=dataclasses.replace(config.experts, backend=backend))


@torch.no_grad()
def fill_random_(model: torch.nn.Module, *, std: float, seed: int) -> None:
    """Draw every parameter in place on its own device: norm weights ones (as ``RMSNorm``
    starts them), biases zeros, everything else ``N(0, std)``; every buffer zeros (the routers'
    balance counters and biases start so). Nothing goes through the host."""
    from moeflow.models.gpt import RMSNorm

    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        gen = generators.get(p.device)
        if gen is None:
            gen = generators[p.device] = torch.Generator(device=p.device)
            gen.manual_seed(seed)
        if id(p) in norms:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, std, generator=gen)
    for b in model.buffers():
        b.zero_()


def build_model(config, *, device: torch.device, dtype: torch.dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    """A ``MoEGPT`` of ``config`` in ``dtype`` on ``device`` with random weights (``fill_random_``,
    ``config.init_std``), in eval mode, built on the meta device and given its memory on
    ``device`` (``to_empty``): no weight is ever materialised on the host."""
    from moeflow.models.gpt import MoEGPT

    model = MoEGPT(config, device="meta", dtype=dtype)
    if device.type == "cuda":
        need = sum(p.numel() * p.element_size() for p in model.parameters())
        free, _ = torch.cuda.mem_get_info(device)
        if need > free * 0.95:
            raise ValueError(f"the model's weights take {need / 2**30:.1f} GiB but {device} has {free / 2**30:.1f} GiB "
                             "free: pick a smaller --shape")
    model = model.to_empty(device=device)
    fill_random_(model, std=config.init_std, seed=seed)
    return model.eval()


def expected_experts_hit(num_experts: int, top_k: int, rows: int) -> float:
    """The mean number of distinct experts ``rows`` tokens pick, each ``top_k`` distinct ones of
    ``num_experts`` uniformly at random: ``E (1 - (1 - K/E)^B)`` (an expert is missed by one
    token with probability ``1 - K/E``)."""
    if not 1 <= top_k <= num_experts or rows < 1:
        raise ValueError(f"need 1 <= top_k <= num_experts and rows >= 1, got top_k={top_k}, "
                         f"num_experts={num_experts}, rows={rows}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


@torch.no_grad()
def count_experts_hit(model, next_B: torch.Tensor, pos: torch.Tensor, cache, steps: int  # type: ignore[no-untyped-def]
                      ) -> list[float]:
    """Per MoE layer, the mean number of distinct experts over ``steps`` eager greedy decode steps
    (``MoEGPT.decode_step``, uncompiled, a forward hook on every router) continuing from token
    ``next_B`` at column ``pos`` of ``cache`` (both advanced in place)."""
    from moeflow.layer.moe import moe_layers

    layers = moe_layers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in layers]
    hooks = [layer.router.register_forward_hook(lambda mod, args, out, i=i: calls[i].append(
        out.ids_TK.unique().numel())) for i, layer in enumerate(layers)]
    try:
        for _ in range(steps):
            logits_BV = model.decode_step(next_B, pos, cache)
            next_B.copy_(logits_BV.argmax(-1))
            pos += 1
    finally:
        for h in hooks:
            h.remove()
    return [statistics.fmean(c) for c in calls]


def _step_times(device: torch.device, run_step: Callable[[], None], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``run_step``: on CUDA from events recorded between
    the steps and read after the last one (no synchronisation in between), else the host clock."""
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            run_step()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(steps)]
    seconds = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_step()
        seconds.append(time.perf_counter() - t0)
    return seconds


def profile_steps(device: torch.device, run_step: Callable[[], None], steps: int, top: int = 30) -> dict:
    """What ``steps`` calls of ``run_step`` run, under ``torch.profiler``: on CUDA the kernels
    (those a CUDA graph replays included), on the CPU the ops; per name the calls and self time
    (microseconds) per step, the ``top`` longest first, and the sums per step (a step's wall
    time past ``us_per_step`` is time between kernels). A profiler that fails gives
    ``{"error": ...}``: the case's timings stand without it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    try:
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            for _ in range(steps):
                run_step()
            sync(device)
        rows = []
        for e in prof.key_averages():
            if cuda and "CUDA" not in str(getattr(e, "device_type", "")):
                continue
            us = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) if cuda \
                else e.self_cpu_time_total
            if us > 0:
                rows.append({"name": e.key[:160], "calls_per_step": e.count / steps, "us_per_step": us / steps})
    except Exception as err:  # (CUPTI missing or busy, an API of another torch version)
        return {"error": f"{type(err).__name__}: {err}"[:500]}
    rows.sort(key=lambda r: -r["us_per_step"])
    return {"unit": "CUDA kernels" if cuda else "CPU ops", "steps": steps,
            "calls_per_step": sum(r["calls_per_step"] for r in rows),
            "us_per_step": sum(r["us_per_step"] for r in rows), "top": rows[:top]}


@torch.no_grad()
def time_decode(model, *, batch: int, prompt_len: int, warmup: int, steps: int,  # type: ignore[no-untyped-def]
                count_steps: int, copy_gbps: float, seed: int = 0, profile: int = 0) -> dict:
    """One case: the compiled decode of ``batch`` rows (module docstring); its figures, with
    ``profile_steps`` of ``profile`` more steps where ``profile > 0``."""
    from moeflow.layer.moe import moe_layers
    from moeflow.models.compiled_decode import CompiledDecoder, _bucket

    c, device = model.config, model.embed.weight.device
    context = prompt_len + warmup + steps
    extra = 1 + profile + count_steps  # the steps after the timed ones: the finite check, the profile, the count
    capacity = _bucket(context + extra, c.max_seq_len)
    if prompt_len < 1 or context + extra > c.max_seq_len:
        raise ValueError(f"prompt_len + warmup + steps + profile + count_steps + 1 must be in [1, max_seq_len="
                         f"{c.max_seq_len}], got {context + extra}")
    gen = torch.Generator(device=device)
    gen.manual_seed(seed + batch)
    prompt_BP = torch.randint(0, c.vocab_size, (batch, prompt_len), device=device, generator=gen)
    decoder = CompiledDecoder(model)
    decoder.prepare(model)
    with decoder.generation(model):
        sync(device)
        t0 = time.perf_counter()
        cache = decoder.cache(model, torch.zeros(batch, dtype=torch.long, device=device), capacity)
        sync(device)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits_BV = model.forward_cached(prompt_BP, cache)  # the prefill, eager
        sync(device)
        prefill_s = time.perf_counter() - t0
        next_B = logits_BV.argmax(-1)
        pos = torch.full((), prompt_len, dtype=torch.long, device=device)
        guarded = [True]  # the first compiled step runs dynamo's guards in full

        def step() -> None:
            logits = decoder.run(next_B, pos, cache, guarded=guarded[0])
            guarded[0] = False
            next_B.copy_(logits.argmax(-1))
            pos.add_(1)

        for _ in range(warmup):
            step()
        sync(device)
        with CompileWatch() as watch:
            seconds = _step_times(device, step, steps)
        finite = bool(torch.isfinite(decoder.run(next_B, pos, cache)).all())  # (one more step, untimed)
        pos.add_(1)
        profiled = profile_steps(device, step, profile) if profile > 0 else None
    hits = count_experts_hit(model, next_B, pos, cache, count_steps)
    step_s = statistics.median(seconds)
    mean_context = prompt_len + warmup + (steps + 1) / 2  # timed step i attends prompt + warmup + i + 1 columns
    nbytes = decode_step_bytes(model, rows=batch, cache_len=mean_context, experts_hit=hits)
    column = nbytes["kv_cache"] / mean_context
    layers = moe_layers(model)
    floor_s = nbytes["total"] / (copy_gbps * 1e9)
    return {
        "batch": batch, "prompt_len": prompt_len, "context": context, "mean_context": mean_context,
        "capacity": capacity, "steps": steps,
        "ms_per_step": step_s * 1e3, "ms_per_step_mean": statistics.fmean(seconds) * 1e3,
        "ms_per_step_min": min(seconds) * 1e3, "tokens_per_s": batch / step_s,
        "bytes_per_step": nbytes, "kv_capacity_bytes": column * capacity,
        "experts_hit": statistics.fmean(hits), "experts_hit_per_layer": hits,
        "expected_experts_hit": expected_experts_hit(layers[0].config.num_experts, layers[0].config.top_k, batch)
        if layers else 0.0,
        "floor_ms": floor_s * 1e3, "bandwidth_fraction": bandwidth_fraction(nbytes["total"], copy_gbps, step_s),
        "compile_s": compile_s, "prefill_s": prefill_s, "timed_compile": watch.as_dict(), "finite_logits": finite,
        "profile": profiled,
    }


def _csv(kind: Callable[[str], object], text: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.decode_bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--layers", type=_positive, default=None, help="blocks (default: the shape's own)")
    p.add_argument("--weights", choices=sorted(WEIGHT_FORMATS), default="bf16")
    p.add_argument("--experts-backend", type=lambda s: _csv(str, s), default=["auto"],
                   help="comma-separated expert GEMM backends, each timed (grouped_mm, triton, loop, auto)")
    p.add_argument("--batch-sizes", type=lambda s: _csv(int, s), default=[1, 4, 16])
    p.add_argument("--prompt-len", type=_positive, default=448)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=_positive, default=32)
    p.add_argument("--count-steps", type=_positive, default=4)
    p.add_argument("--profile-steps", type=int, default=0,
                   help="steps profiled (torch.profiler) after the timed ones, in the cases of the first batch size")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--later-batches", choices=["fastest", "all"], default="fastest",
                   help="the batch sizes after the first: with the fastest backend at the first only, or with all")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; cases past it are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes):
        p.error(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    from moeflow.config import ExpertsBackend  # (a Literal of the backend names)

    known = getattr(ExpertsBackend, "__args__", ())
    bad = [b for b in args.experts_backend if known and b not in known]
    if bad:
        p.error(f"--experts-backend: unknown {bad}; choose from {list(known)}")
    return args


def _cases(batches: Sequence[int], backends: Sequence[str], results: list[dict], later: str):
    """``(backend, batch)`` in the order they run: every backend at the first batch size (the
    issue's target is batch 1), then the later batch sizes with every backend (``later="all"``)
    or only with the fastest at the first batch size (``"fastest"``: a case is a compilation of
    its own; where none finished, every backend). Reads ``results`` as they grow."""
    for backend in backends:
        yield backend, batches[0]
    first = [r for r in results if r["batch"] == batches[0]]
    keep = backends if later == "all" or not first else [min(first, key=lambda r: r["ms_per_step"])["backend"]]
    for B in batches[1:]:
        for backend in keep:
            yield backend, B


def _use_backend(model, backend: str) -> None:  # type: ignore[no-untyped-def]
    """Every MoE layer's experts on the grouped GEMM ``backend`` (their config's ``backend``;
    the compiled step does not guard on it: the caller resets dynamo between cases)."""
    from moeflow.layer.moe import moe_layers

    for layer in moe_layers(model):
        if not hasattr(layer.experts, "config"):  # (FP8 weight-only experts: their own product)
            continue
        if layer.experts.config.backend != backend:
            layer.experts.config = dataclasses.replace(layer.experts.config, backend=backend)


def _write(path: Path | None, report: dict) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    t_start = time.monotonic()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = gpt_config_for(args.shape, backend=args.experts_backend[0], layers=args.layers)
    t0 = time.perf_counter()
    model = build_model(config, device=device, dtype=dtype, seed=args.seed)
    WEIGHT_FORMATS[args.weights](model)
    sync(device)
    build_s = time.perf_counter() - t0
    total, active = model.num_parameters()
    copy_gbps = copy_bandwidth_gbps(device)
    report: dict = {
        "shape": args.shape, "layers": config.n_layers, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
        or platform.machine(), "dtype": str(dtype).removeprefix("torch."), "weights": args.weights,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "parameters": total,
        "active_parameters": active, "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "build_s": build_s, "copy_gbps": copy_gbps, "copy_gbps_counts": "bytes read + bytes written",
        "results": [], "skipped": [], "failed": [],
    }
    print(f"{args.shape}: {total / 1e9:.2f} B parameters ({active / 1e9:.2f} B active), {report['dtype']}, "
          f"on {report['device']}; built in {build_s:.1f} s; copy {copy_gbps:,.0f} GB/s (read + write)", flush=True)
    longest = 0.0
    for backend, B in _cases(args.batch_sizes, args.experts_backend, report["results"], args.later_batches):
        left = None if args.time_budget is None else args.time_budget - (time.monotonic() - t_start)
        if left is not None and (report["results"] or report["failed"]) and left < longest:
            report["skipped"].append({"backend": backend, "batch": B,
                                      "why": f"{left:.0f} s left, the longest case took {longest:.0f} s"})
            continue
        _use_backend(model, backend)
        t_case = time.monotonic()
        try:
            row = time_decode(model, batch=B, prompt_len=args.prompt_len, warmup=args.warmup, steps=args.steps,
                              count_steps=args.count_steps, copy_gbps=copy_gbps, seed=args.seed,
                              profile=args.profile_steps if B == args.batch_sizes[0] else 0)
        except Exception as err:  # (one failing case is reported; the others still run)
            report["failed"].append({"backend": backend, "batch": B, "error": f"{type(err).__name__}: {err}"[:2000]})
            print(f"  backend {backend} B={B}: FAILED {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            continue
        finally:
            longest = max(longest, time.monotonic() - t_case)
            torch._dynamo.reset()  # (the case's graphs: the next case compiles its own shape anyway)
        row = {"backend": backend, **row}
        report["results"].append(row)
        _write(args.json, report)
        print(f"  backend {backend:10s} B={B:<3d} {row['ms_per_step']:8.3f} ms/step {row['tokens_per_s']:10,.1f} tok/s "
              f"{row['bytes_per_step']['total'] / 1e9:7.3f} GB/step (experts hit {row['experts_hit']:.1f}, "
              f"expected {row['expected_experts_hit']:.1f}) floor {row['floor_ms']:.3f} ms = "
              f"{row['bandwidth_fraction']:6.1%} of the bandwidth limit; compile {row['compile_s']:.1f} s",
              flush=True)
    report["total_s"] = time.monotonic() - t_start
    _write(args.json, report)
    return report


if __name__ == "__main__":
    main()
