"""MoE layer benchmark: moeflow beside the einsum and loop references and the floor.

All four run in one process, interleaved round-robin inside each repeat (so a noisy neighbour
slows all of them alike), on the same layer parameters and the same input:

- ``moeflow``: the layer as users call it (routing, dispatch, experts, combine, losses);
- ``einsum``: GShard one-hot einsum dispatch/combine (``moeflow.testing.einsum_moe``) with the
  same router;
- ``loop``: a per-expert Python loop (``moeflow.testing.loop_moe``) with the same router;
- ``floor``: only the expert FFN (GEMMs + activation) on perfectly balanced
  ``[E, ceil(T*K/E), D]`` input: what any MoE layer must at least spend.

TFLOP/s counts the useful expert FLOPs of ``T*K`` routed rows (``2*T*K*D*(F+H)`` forward, three
times that for forward+backward), the same count for every implementation.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from moeflow.bench.memory import keep_freed_heap, peak_memory_bytes
from moeflow.config import ExpertsConfig, MoEConfig, check_capacity_factor
from moeflow.layer.moe import MoE
from moeflow.testing import einsum_moe, loop_moe

__all__ = ["LayerBenchFlags", "BenchConfig", "run_layer_bench", "format_table", "IMPLEMENTATIONS"]

IMPLEMENTATIONS = ("moeflow", "einsum", "loop", "floor")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class LayerBenchFlags:
    """The layer shape and timing flags shared by ``moeflow bench`` and ``moeflow bench --nproc``."""

    tokens: int = 4096
    dim: int = 512
    hidden: int = 1024
    experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.0
    activation: str = "swiglu"
    dtype: str = "float32"
    threads: int = 2
    repeats: int = 7
    warmup: int = 1
    seed: int = 0

    _positive = ("tokens", "dim", "hidden", "experts", "top_k", "threads", "repeats")

    def __post_init__(self) -> None:
        for name in self._positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k must be <= --experts={self.experts}, got {self.top_k}")
        check_capacity_factor(self.capacity_factor, "--capacity-factor")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class BenchConfig(LayerBenchFlags):
    device: str = "cpu"
    impls: tuple[str, ...] = IMPLEMENTATIONS
    memory: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [i for i in self.impls if i not in IMPLEMENTATIONS]
        if unknown or not self.impls:
            raise ValueError(f"--impls must be a non-empty subset of {list(IMPLEMENTATIONS)}, got {list(self.impls)}")
        if self.capacity_factor < 0 and "einsum" in self.impls:
            raise ValueError("the einsum reference has no capped-dropless mode; drop it from --impls for capacity_factor < 0")


def _machine(cfg: BenchConfig) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "date": datetime.date.today().isoformat(),
    }
    if cfg.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(cfg.device))
    return info


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(cfg: BenchConfig) -> tuple[MoE, torch.Tensor, torch.Tensor, torch.Tensor]:
    device = torch.device(cfg.device)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed)
    layer = MoE(
        config=MoEConfig(
            dim=cfg.dim,
            hidden=cfg.hidden,
            num_experts=cfg.experts,
            top_k=cfg.top_k,
            capacity_factor=cfg.capacity_factor,
            experts=ExpertsConfig(activation=cfg.activation),
        ),
        device=device,
        dtype=cfg.torch_dtype,
    ).train()
    x_TD = torch.randn(cfg.tokens, cfg.dim, generator=gen).to(device, cfg.torch_dtype)
    grad_TD = torch.randn(cfg.tokens, cfg.dim, generator=gen).to(device, cfg.torch_dtype)
    per_expert = math.ceil(cfg.tokens * cfg.top_k / cfg.experts)
    x_ECD = torch.randn(cfg.experts, per_expert, cfg.dim, generator=gen).to(device, cfg.torch_dtype)
    return layer, x_TD, grad_TD, x_ECD


def _implementations(cfg: BenchConfig, layer: MoE, x_TD: torch.Tensor, x_ECD: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    cf, k = cfg.capacity_factor, cfg.top_k
    counts_E = torch.full((cfg.experts,), x_ECD.shape[1], dtype=torch.long, device=x_ECD.device)

    def routed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = layer.router(x, top_k=k)
        return r.weights_TK, r.ids_TK

    table = {
        "moeflow": lambda x: layer(x, capacity_factor=cf, top_k=k),
        "einsum": lambda x: einsum_moe(layer, x, capacity_factor=cf, top_k=k, routing=routed(x)),
        "loop": lambda x: loop_moe(layer, x, capacity_factor=cf, top_k=k, routing=routed(x)),
        "floor": lambda x: layer.experts(x, counts_E),
    }
    return {name: table[name] for name in cfg.impls}


def _one_pass(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, grad: torch.Tensor, backward: bool, layer: MoE) -> None:
    if not backward:
        with torch.no_grad():
            fn(x)
        return
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y = fn(x)
    y.backward(grad)


def run_layer_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict:
    """Time every implementation for forward and forward+backward; return a JSON-able dict."""
    heap_kept = False
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
        heap_kept = keep_freed_heap()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    layer, x_TD, grad_TD, x_ECD = _build(cfg)
    impls = _implementations(cfg, layer, x_TD, x_ECD)
    grad_ECD = torch.randn_like(x_ECD)
    inputs = {name: (x_ECD, grad_ECD) if name == "floor" else (x_TD, grad_TD) for name in impls}

    F = 2 * cfg.hidden if activation_is_gated(cfg.activation) else cfg.hidden
    rows = cfg.tokens * cfg.top_k
    flops = {"forward": 2.0 * rows * cfg.dim * (F + cfg.hidden)}
    flops["forward_backward"] = 3.0 * flops["forward"]

    results: dict[str, dict] = {name: {"name": name} for name in impls}
    for pass_name, backward in (("forward", False), ("forward_backward", True)):
        times: dict[str, list[float]] = {name: [] for name in impls}
        for rep in range(cfg.warmup + cfg.repeats):
            for name, fn in impls.items():
                x, g = inputs[name]
                _sync(device)
                t0 = time.perf_counter()
                _one_pass(fn, x, g, backward, layer)
                _sync(device)
                if rep >= cfg.warmup:
                    times[name].append(time.perf_counter() - t0)
            if progress:
                what = f"warm-up {rep + 1}/{cfg.warmup}" if rep < cfg.warmup else f"repeat {rep - cfg.warmup + 1}/{cfg.repeats}"
                progress(f"{pass_name}: {what}")
        for name, fn in impls.items():
            x, g = inputs[name]
            med = statistics.median(times[name])
            layer.zero_grad(set_to_none=True)  # the gradients a pass allocates count as its memory
            peak = peak_memory_bytes(lambda: _one_pass(fn, x, g, backward, layer), device) if cfg.memory else None
            results[name][pass_name] = {
                "median_ms": med * 1e3,
                "min_ms": min(times[name]) * 1e3,
                "times_ms": [t * 1e3 for t in times[name]],
                "tokens_per_s": cfg.tokens / med,
                "tflops": flops[pass_name] / med / 1e12,
                "peak_mem_mb": None if peak is None else peak / 2**20,
            }
    if "floor" in results:
        for name in results:
            for pass_name in ("forward", "forward_backward"):
                rec = results[name][pass_name]
                rec["ratio_to_floor"] = rec["median_ms"] / results["floor"][pass_name]["median_ms"]
                floor_mem = results["floor"][pass_name]["peak_mem_mb"]
                if rec["peak_mem_mb"] is not None and floor_mem:
                    rec["mem_ratio_to_floor"] = rec["peak_mem_mb"] / floor_mem
    for name in results:
        for pass_name in ("forward", "forward_backward"):
            rec = results[name][pass_name]
            if "moeflow" in results:
                rec["speedup_of_moeflow"] = rec["median_ms"] / results["moeflow"][pass_name]["median_ms"]
    return {
        "benchmark": "moe_layer",
        "config": asdict(cfg),
        "machine": {**_machine(cfg), "heap_kept": heap_kept},
        "flops": flops,
        "records": [results[name] for name in impls],
    }


def activation_is_gated(activation: str) -> bool:
    return ExpertsConfig(activation=activation).gated  # type: ignore[arg-type]


def format_table(report: dict) -> str:
    """A plain-text table of the report (one line per implementation and pass)."""
    c, m = report["config"], report["machine"]
    lines = [
        f"MoE layer  T={c['tokens']} D={c['dim']} H={c['hidden']} E={c['experts']} K={c['top_k']} "
        f"cf={c['capacity_factor']} act={c['activation']} dtype={c['dtype']} device={c['device']} "
        f"threads={m['threads']} repeats={c['repeats']}",
        f"machine: {m['cpu']} ({m['logical_cpus']} logical CPUs), torch {m['torch']}, {m['date']}"
        + (f", {m['gpu']}" if "gpu" in m else "")
        + (", glibc heap kept (mallopt)" if m.get("heap_kept") else ""),
        "",
        f"{'pass':<17}{'impl':<9}{'median ms':>11}{'tokens/s':>12}{'TFLOP/s':>9}{'peak MiB':>10}{'x floor':>9}{'x moeflow':>11}"
        f"{'mem x floor':>13}",
    ]
    for pass_name in ("forward", "forward_backward"):
        for rec in report["records"]:
            r = rec[pass_name]
            mem = "n/a" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"
            ratio = f"{r['ratio_to_floor']:.3f}" if "ratio_to_floor" in r else "n/a"
            speed = f"{r['speedup_of_moeflow']:.2f}" if "speedup_of_moeflow" in r else "n/a"
            mem_ratio = f"{r['mem_ratio_to_floor']:.2f}" if "mem_ratio_to_floor" in r else "n/a"
            lines.append(
                f"{pass_name:<17}{rec['name']:<9}{r['median_ms']:>11.1f}{r['tokens_per_s']:>12.0f}{r['tflops']:>9.3f}"
                f"{mem:>10}{ratio:>9}{speed:>11}{mem_ratio:>13}"
            )
    lines.append("")
    lines.append("x floor: median time / floor median time (lower is better; 1.0 = nothing but the expert GEMMs).")
    lines.append("x moeflow: median time / moeflow median time (how many times slower than moeflow).")
    lines.append("peak MiB: tensor memory a pass adds at its peak (activations, saved tensors, temporaries, parameter")
    lines.append("gradients; moeflow.bench.memory), measured the same way for every implementation; mem x floor: / floor's.")
    return "\n".join(lines)
