"""GPU kernel benchmark: moeflow's Triton kernels against the machine's ceilings and baselines.

One command, one process, one table (and optionally JSON):

    python -m bench.gpu_kernels                    # CUDA: full-size shapes
    python -m bench.gpu_kernels --json out.json    # ... and write the rows
    python -m bench.gpu_kernels --device cpu --tiny   # smoke run under the Triton interpreter


What it measures, in order:

1. ceilings: the dense bf16 GEMM rate (``torch.mm``, 8192^3) and the copy bandwidth
   (``Tensor.copy_`` of 1 GiB, read + write counted);
2. the whole MoE layer, forward and forward+backward, bf16, dropless (cf = 0), for a
   Mixtral-like shape (T=16384, D=4096, H=14336, E=8, K=2) and a DeepSeek-like shape
   (T=16384, D=2048, H=1408, E=64, K=6, no shared experts), with the experts backend
   ``"triton"`` (row "moeflow-triton FFN": the layer's torch routing and dispatch with the
   Triton fused expert FFN; of the kernels with rows of their own below, the layer runs the
   permute ones on CUDA, not the fused routing and slot ones), ``"grouped_mm"`` (moeflow-torch: ``F.grouped_mm``) and the
   GShard one-hot einsum reference (``moeflow.testing.einsum_moe``, padded to the busiest
   expert). The einsum is skipped, with the reason printed, where its ``[T, E, C]`` tensors
   would exceed half the free memory or its two einsums would cost over 10x the expert GEMMs,
   and with ``--no-einsum`` (the GPU check's choice: on an H100 at the Mixtral-like shape it takes
   2.6 s forward and 11.4 s forward+backward, over a minute with the warm-ups);
3. the bare expert FFN on the same routed rows: the Triton fused kernel against the
   ``F.grouped_mm`` floor;
4. permute / unpermute (``moeflow.kernels.permute``: its Triton kernels on CUDA) in GB/s against the copy bandwidth;
5. fused top-k routing (``fused_topk_routing`` vs ``moeflow.routing.select_experts``) and slot
   assignment (``assign_positions`` vs ``moeflow.dispatch.assign_slots``), in GB/s of their
   compulsory traffic (routing: logits read, scores, weights and ids written; slots: ids read,
   positions and counts written) against the copy bandwidth, with the time in ms.

TFLOP/s count only the expert GEMMs (``2 * T*K * D * (F + H)`` per forward, 3x that for
forward+backward), so the layer rows show how close the whole layer gets to the GEMM ceiling.
Times are medians of ``--repeats`` runs after warm-up, with CUDA events. Backward passes use
``torch.autograd.grad`` (nothing accumulates into ``.grad`` across repeats, which would add an
in-place add per parameter to every timed run).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import moeflow
from bench.common import median_ms_timer
from moeflow import ExpertsConfig


@dataclass(frozen=True)
class Shape:
    name: str
    T: int
    D: int
    H: int
    E: int
    K: int


FULL_SHAPES = [
    Shape("mixtral", T=16384, D=4096, H=14336, E=8, K=2),
    Shape("deepseek", T=16384, D=2048, H=1408, E=64, K=6),
]
TINY_SHAPES = [Shape("tiny", T=24, D=16, H=16, E=4, K=2)]


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")


def ceilings(device: torch.device, tiny: bool, measure) -> tuple[float, float, list[dict]]:
    """(dense GEMM TFLOP/s, copy GB/s) and their rows."""
    n = 256 if tiny else 8192
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = measure(lambda: torch.mm(a, b))
    tflops = 2 * n**3 / (ms * 1e-3) / 1e12
    numel = (1 << 20) if tiny else (1 << 29)  # 1 GiB of bf16 at full size
    src = torch.randn(numel, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    ms_copy = measure(lambda: dst.copy_(src))
    gbps = 2 * src.numel() * src.element_size() / (ms_copy * 1e-3) / 1e9
    rows = [
        dict(case="ceiling", impl=f"torch.mm {n}^3 {str(dtype)[6:]}", pass_="fwd", ms=ms, rate=tflops, unit="TFLOP/s", pct=100.0),
        dict(case="ceiling", impl="copy_", pass_="fwd", ms=ms_copy, rate=gbps, unit="GB/s", pct=100.0),
    ]
    return tflops, gbps, rows


def _layer(shape: Shape, backend: str, device: torch.device, dtype: torch.dtype) -> moeflow.MoE:
    torch.manual_seed(0)
    return moeflow.MoE(
        dim=shape.D, hidden=shape.H, num_experts=shape.E, top_k=shape.K, capacity_factor=0.0,
        experts=ExpertsConfig(backend=backend, activation="swiglu"), device=device, dtype=dtype,
    )


def _expert_flops(shape: Shape) -> float:
    # swiglu: w_in is D x 2H, w_out is H x D
    return 2.0 * shape.T * shape.K * shape.D * (3 * shape.H)


def _einsum_skip_reason(shape: Shape, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the one-hot einsum reference would not fit or would take too long, or None."""
    C = int(1.5 * shape.T * shape.K / shape.E)  # padded to the busiest expert: ~1.2-1.5x the mean
    elems = shape.T * shape.E * C
    itemsize = torch.empty((), dtype=dtype).element_size()
    mask_bytes = 4 * elems * itemsize  # dispatch + combine tensors, and their gradients
    einsum_flops = 2 * 2.0 * elems * shape.D
    ratio = einsum_flops / _expert_flops(shape)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info()[0]
        if mask_bytes > free / 2:
            return f"[T,E,C] one-hot tensors need ~{mask_bytes / 2**30:.0f} GiB, over half the free memory"
    if ratio > 10:
        return f"one-hot einsums cost ~{ratio:.0f}x the expert GEMMs ({einsum_flops / 1e12:.0f} TFLOP per forward)"
    return None


def _torch_backend(shape: Shape, device: torch.device, dtype: torch.dtype) -> str:
    """moeflow's torch experts path here: ``F.grouped_mm`` where it runs, else the loop."""
    from moeflow.kernels import native_grouped_mm_supported

    dims = (shape.D, 2 * shape.H, shape.H)
    return "grouped_mm" if native_grouped_mm_supported(device, dtype, dims) else "loop"


def layer_rows(shape: Shape, device: torch.device, dtype: torch.dtype, gemm_tflops: float, measure, tiny: bool,
               einsum: bool = True) -> list[dict]:
    from moeflow.testing import einsum_moe

    rows: list[dict] = []
    x = torch.randn(shape.T, shape.D, device=device, dtype=dtype)
    torch_backend = "loop" if tiny else _torch_backend(shape, device, dtype)
    # the triton row is the layer as it runs: torch routing + dispatch, Triton fused expert FFN
    impls: list[tuple[str, str | None]] = [
        ("moeflow-triton FFN (torch route)", "triton"), (f"moeflow-torch ({torch_backend})", torch_backend)
    ]
    impls.append(("einsum (GShard)", None))
    flops = _expert_flops(shape)
    for impl, backend in impls:
        layer = _layer(shape, backend or "auto", device, dtype)
        if backend is None:
            reason = _einsum_skip_reason(shape, device, dtype) if einsum else "--no-einsum"
            if reason is not None:
                rows.append(dict(case=shape.name, impl=impl, pass_="skipped", ms=float("nan"), rate=float("nan"),
                                 unit="", pct=float("nan"), note=reason))
                continue
            fwd = lambda: einsum_moe(layer, x, capacity_factor=0.0)  # noqa: E731
        else:
            fwd = lambda: layer(x)  # noqa: E731
        xg = x.detach().clone().requires_grad_(True)

        grad_inputs = [xg] + [p for p in layer.parameters() if p.requires_grad]

        def fwd_bwd(layer=layer, backend=backend, grad_inputs=grad_inputs):
            y = einsum_moe(layer, xg, capacity_factor=0.0) if backend is None else layer(xg)
            # autograd.grad, not backward: no .grad accumulation inside the timed region
            torch.autograd.grad(y, grad_inputs, torch.ones_like(y), allow_unused=True)

        for pass_, fn, mult in (("fwd", fwd, 1), ("fwd+bwd", fwd_bwd, 3)):
            _peak_reset(device)
            try:
                if pass_ == "fwd":
                    with torch.no_grad():
                        ms = measure(fn)
                else:
                    ms = measure(fn)
            except torch.OutOfMemoryError:
                rows.append(dict(case=shape.name, impl=impl, pass_=pass_, ms=float("nan"), rate=float("nan"),
                                 unit="", pct=float("nan"), note="out of memory"))
                continue
            rate = mult * flops / (ms * 1e-3) / 1e12
            rows.append(dict(case=shape.name, impl=impl, pass_=pass_, ms=ms, rate=rate, unit="TFLOP/s",
                             pct=100 * rate / gemm_tflops, peak_gib=_peak_gib(device)))
        del layer
    return rows


def expert_rows(shape: Shape, device: torch.device, dtype: torch.dtype, gemm_tflops: float, measure, tiny: bool) -> list[dict]:
    """The bare grouped FFN on the routed rows: Triton fused vs the F.grouped_mm floor."""
    from moeflow.experts.ffn import grouped_ffn
    from moeflow.kernels.triton import grouped_ffn_triton

    torch.manual_seed(0)
    R = shape.T * shape.K
    ids = torch.randint(0, shape.E, (R,), device=device)
    counts = torch.bincount(ids, minlength=shape.E)
    x = torch.randn(R, shape.D, device=device, dtype=dtype, requires_grad=True)
    w_in = (torch.randn(shape.E, shape.D, 2 * shape.H, device=device, dtype=dtype) * shape.D**-0.5).requires_grad_(True)
    w_out = (torch.randn(shape.E, shape.H, shape.D, device=device, dtype=dtype) * shape.H**-0.5).requires_grad_(True)
    floor = "loop" if tiny else _torch_backend(shape, device, dtype)
    impls = {
        "triton fused FFN": lambda: grouped_ffn_triton(x, counts, w_in, w_out, activation="swiglu"),
        f"{floor} FFN (floor)": lambda: grouped_ffn(x, counts, w_in, w_out, activation="swiglu", backend=floor),
    }
    rows = []
    flops = _expert_flops(shape)
    for impl, fn in impls.items():
        for pass_, mult in (("fwd", 1), ("fwd+bwd", 3)):
            _peak_reset(device)
            if pass_ == "fwd":
                with torch.no_grad():
                    ms = measure(fn)
            else:
                ones = torch.ones(R, shape.D, device=device, dtype=dtype)
                ms = measure(lambda fn=fn, ones=ones: torch.autograd.grad(fn(), (x, w_in, w_out), ones))
            rate = mult * flops / (ms * 1e-3) / 1e12
            rows.append(dict(case=shape.name, impl=impl, pass_=pass_, ms=ms, rate=rate, unit="TFLOP/s",
                             pct=100 * rate / gemm_tflops, peak_gib=_peak_gib(device)))
    return rows


def _bandwidth_rows(
    shape: Shape, cases: dict[str, tuple[Callable[[], object], int]], copy_gbps: float, measure
) -> list[dict]:
    """One forward-only row per ``name -> (fn, compulsory bytes)``: GB/s against the copy bandwidth."""
    rows = []
    for impl, (fn, nbytes) in cases.items():
        with torch.no_grad():
            ms = measure(fn)
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append(dict(case=shape.name, impl=impl, pass_="fwd", ms=ms, rate=gbps, unit="GB/s", pct=100 * gbps / copy_gbps))
    return rows


def permute_rows_bench(shape: Shape, device: torch.device, dtype: torch.dtype, copy_gbps: float, measure) -> list[dict]:
    from moeflow.kernels.permute import permute_rows, unpermute_rows

    T, K, E, D = shape.T, shape.K, shape.E, shape.D
    ids_TK = torch.rand(T, E, device=device).topk(K, dim=1).indices
    order_A = torch.sort(ids_TK.reshape(-1), stable=True).indices
    row_A = torch.empty_like(order_A).scatter_(0, order_A, torch.arange(T * K, device=device))
    x_TD = torch.randn(T, D, device=device, dtype=dtype)
    y_MD = torch.randn(T * K, D, device=device, dtype=dtype)
    w_TK = torch.rand(T, K, device=device, dtype=dtype)
    token_M = torch.div(order_A, K, rounding_mode="floor")
    row_TK = row_A.view(T, K)
    item = x_TD.element_size()
    cases = {
        # bytes: every routed row read once and written once
        "permute": (lambda: permute_rows(x_TD, token_M, None, row_TK, None), 2 * T * K * D * item),
        # bytes: T*K rows read, T rows written
        "unpermute (weighted)": (lambda: unpermute_rows(y_MD, row_TK, None, w_TK, order_A, None), (T * K + T) * D * item),
        "torch index_select": (lambda: x_TD.index_select(0, token_M), 2 * T * K * D * item),
    }
    return _bandwidth_rows(shape, cases, copy_gbps, measure)


def routing_slots_bench(shape: Shape, device: torch.device, dtype: torch.dtype, copy_gbps: float, measure) -> list[dict]:
    """The fused routing and slot kernels against their torch references, forward only."""
    from moeflow.dispatch import assign_slots
    from moeflow.kernels.triton import assign_positions, fused_topk_routing
    from moeflow.kernels.triton.routing import MAX_ROUTING_EXPERTS
    from moeflow.routing import select_experts

    T, E, K = shape.T, shape.E, shape.K
    logits_TE = torch.randn(T, E, device=device, dtype=dtype)
    ids_TK = torch.rand(T, E, device=device).topk(K, dim=1).indices
    w_TK = torch.rand(T, K, device=device, dtype=dtype)
    item = logits_TE.element_size()
    route_kw = dict(top_k=K, scoring="softmax", normalize_topk=True)
    # bytes: logits read, scores written, weights and int64 ids written
    route_bytes = 2 * T * E * item + T * K * (item + 8)
    # bytes: int64 ids read, int64 positions written (counts are negligible)
    slot_bytes = 2 * T * K * 8
    cases = {
        "torch select_experts": (lambda: select_experts(logits_TE, **route_kw), route_bytes),
        "torch assign_slots": (lambda: assign_slots(ids_TK, w_TK, num_experts=E, drop_policy="position"), slot_bytes),
        "triton assign_positions": (lambda: assign_positions(ids_TK, E, choice_major=True), slot_bytes),
    }
    if E <= MAX_ROUTING_EXPERTS:
        cases = {"triton fused routing": (lambda: fused_topk_routing(logits_TE, **route_kw), route_bytes), **cases}
    return _bandwidth_rows(shape, cases, copy_gbps, measure)


def print_table(rows: list[dict], header: str) -> None:
    print(header)
    print(f"{'case':<9} {'impl':<32} {'pass':<8} {'ms':>10} {'rate':>10} {'unit':<8} {'% ceil':>7} {'peak GiB':>9}  note")
    for r in rows:
        peak = r.get("peak_gib", float("nan"))
        print(
            f"{r['case']:<9} {r['impl']:<32} {r['pass_']:<8} {r['ms']:>10.3f} {r['rate']:>10.2f} {r['unit']:<8} "
            f"{r['pct']:>7.1f} {peak:>9.2f}  {r.get('note', '')}"
        )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (smoke run; CPU needs the Triton interpreter)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per row (median reported)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--no-einsum", action="store_true",
                        help="skip the GShard one-hot einsum reference rows (minutes at the full shapes)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        # the CPU smoke mode needs Triton's interpreter: switch it on before Triton is first
        # imported (below); where Triton was imported without it, triton_available says so
        os.environ.setdefault("TRITON_INTERPRET", "1")

    from moeflow.kernels.triton import triton_available

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "bench.gpu_kernels needs a CUDA GPU (none is visible). For a smoke run on CPU use "
            "`TRITON_INTERPRET=1 python -m bench.gpu_kernels --device cpu --tiny`."
        )
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("--device cpu runs the Triton interpreter, which is only usable with --tiny")
    if not triton_available(device):
        raise SystemExit(
            f"Triton kernels cannot run on {device.type} here: "
            + ("install triton" if device.type == "cuda" else "set TRITON_INTERPRET=1 before starting Python")
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = args.repeats or (2 if args.tiny else 10)
    measure = median_ms_timer(device, repeats=repeats, warmup=1 if args.tiny else 3)
    shapes = TINY_SHAPES if args.tiny else FULL_SHAPES

    gemm_tflops, copy_gbps, rows = ceilings(device, args.tiny, measure)
    for shape in shapes:
        rows += layer_rows(shape, device, dtype, gemm_tflops, measure, args.tiny, einsum=not args.no_einsum)
        rows += expert_rows(shape, device, dtype, gemm_tflops, measure, args.tiny)
        rows += permute_rows_bench(shape, device, dtype, copy_gbps, measure)
        rows += routing_slots_bench(shape, device, dtype, copy_gbps, measure)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
    header = (
        f"moeflow GPU kernels: {name}, {str(dtype)[6:]}, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, median of {repeats}"
    )
    print_table(rows, header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1, default=str)
    return rows


if __name__ == "__main__":
    main()
