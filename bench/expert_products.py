"""The expert products of a CPU decode step: ``lean_ffn_no_grad`` (what the step's MoE layers run)
over the weights themselves (``F.grouped_mm``, MKL here) and over packed copies
(``moeflow.kernels.packed_cpu``, what the CPU's compiled decode runs), on the same weights and
rows in one run.

Per batch size ``B``: ``B * top_k`` rows routed by a seeded random top-k to ``--experts``
experts, and ``--layers`` layers of random fp32 expert weights (``[E, D, 2H]`` and ``[E, H, D]``,
SwiGLU), called in turn as a step calls them, so the weights come from memory (the bench
model's four layers hold 48 MiB of experts, more than this VM's 32 MiB L3). Each round times one
call per layer for each candidate in turn (order reversed every other round); reported: the
median microseconds per layer call, the expert weights it reads (experts with rows only) per
second, the ratio grouped GEMM / packed (> 1: packed faster) and the largest difference of the
outputs.

    .venv/bin/python -m bench.expert_products --threads 1   # writes bench/results/expert_products.json
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from moeflow.experts.lean import lean_ffn_no_grad
from moeflow.experts.packed import packed_ffn
from moeflow.kernels.packed_cpu import MAX_ROWS_PER_EXPERT, pack_weight, packed_cpu_available
from bench.common import RESULTS

__all__ = ["main", "run_expert_products_bench"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.expert_products", description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512, help="expert hidden size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="layers of weights called in turn")
    p.add_argument("--batch-sizes", default="1,8,16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    return p


def run_expert_products_bench(args: argparse.Namespace) -> dict:
    if not packed_cpu_available():
        raise SystemExit("bench.expert_products: the packed kernel is not available here (no C++ compiler on the "
                         "PATH, or its build failed: see the warning)")
    for name in ("dim", "hidden", "experts", "top_k", "layers", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.top_k > args.experts:
        raise SystemExit(f"--top-k must be at most --experts ({args.experts}), got {args.top_k}")
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batch-sizes must be positive integers, got {args.batch_sizes!r}")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, batches)
    finally:
        torch.set_num_threads(threads_before)


def _run(args: argparse.Namespace, batches: list[int]) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    E, D, H = args.experts, args.dim, args.hidden
    layers = [(torch.randn(E, D, 2 * H, generator=gen) * 0.05, torch.randn(E, H, D, generator=gen) * 0.05)
              for _ in range(args.layers)]
    packs = [(pack_weight(w_in), pack_weight(w_out)) for w_in, w_out in layers]
    rows = []
    for B in batches:
        expert_BK = torch.rand(B, E, generator=gen).topk(args.top_k, dim=1).indices
        counts_E = torch.bincount(expert_BK.flatten(), minlength=E)
        x_RD = torch.randn(B * args.top_k, D, generator=gen)
        touched = int((counts_E > 0).sum()) * (D * 2 * H + H * D) * 4  # bytes of weights read per layer

        def grouped() -> list[torch.Tensor]:
            return [lean_ffn_no_grad(x_RD, w_in, w_out, counts_E, activation="swiglu") for w_in, w_out in layers]

        def packed() -> list[torch.Tensor]:
            return [packed_ffn(x_RD, p_in, p_out, counts_E, activation="swiglu", width_in=2 * H, width_out=D)
                    for p_in, p_out in packs]

        # whether the decode step's packed experts would run the kernel at these rows (past
        # MAX_ROWS_PER_EXPERT rows per expert they hand the call to the weights themselves)
        packed_used = B * args.top_k <= MAX_ROWS_PER_EXPERT * E
        cands = {"grouped_mm": grouped, "packed": packed}
        times: dict[str, list[float]] = {name: [] for name in cands}
        outs = {name: run() for name, run in cands.items()}  # warm-up (and the kernel's build)
        for r in range(args.repeats):
            for name in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                t0 = time.perf_counter()
                cands[name]()
                times[name].append((time.perf_counter() - t0) / args.layers)
        med = {name: statistics.median(t) for name, t in times.items()}
        diff = max(float((a - b).abs().max()) for a, b in zip(outs["grouped_mm"], outs["packed"]))
        row = {"batch": B, "rows": B * args.top_k, "counts": counts_E.tolist(), "weights_read_MiB": touched / 2**20,
               "packed_kernel_ran": packed_used,
               **{f"{n}_us": med[n] * 1e6 for n in cands},
               **{f"{n}_GiB_s": touched / med[n] / 2**30 for n in cands},
               "grouped_over_packed": med["grouped_mm"] / med["packed"], "max_abs_diff": diff}
        rows.append(row)
        print(f"B={B:3d} rows={row['rows']:3d} counts={row['counts']}: grouped_mm {row['grouped_mm_us']:8.1f} us "
              f"({row['grouped_mm_GiB_s']:5.1f} GiB/s)  packed {row['packed_us']:8.1f} us "
              f"({row['packed_GiB_s']:5.1f} GiB/s)  ratio {row['grouped_over_packed']:.2f}x  max diff {diff:.1e}"
              + ("" if packed_used else f"  (over {MAX_ROWS_PER_EXPERT} rows per expert: the packs are not used)"))
    return {"bench": "expert_products", "date": datetime.date.today().isoformat(),
            "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": "float32", "args": {k: str(v) for k, v in vars(args).items()},
            "results": rows}


def main(argv: list[str] | None = None, default_json: Path | None = None) -> int:
    from bench.generate import write_report

    args = _parser().parse_args(argv)
    write_report(run_expert_products_bench(args), args.json if args.json is not None else default_json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(default_json=RESULTS / "expert_products.json"))
