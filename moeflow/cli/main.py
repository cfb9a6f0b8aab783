"""``moeflow`` command line: ``moeflow bench ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

__all__ = ["main", "build_parser"]


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="time the MoE layer beside the einsum/loop references and the expert-GEMM floor",
        description="Time moeflow, the GShard einsum reference, the per-expert loop reference and the "
        "floor (bare expert FFN on balanced input), forward and forward+backward, in one process.",
    )
    p.add_argument("--tokens", type=int, default=4096, help="T, tokens per call (default 4096)")
    p.add_argument("--dim", type=int, default=512, help="D, model dim (default 512)")
    p.add_argument("--hidden", type=int, default=1024, help="H, expert hidden dim (default 1024)")
    p.add_argument("--experts", type=int, default=8, help="E, number of experts (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="K, experts per token (default 2)")
    p.add_argument(
        "--capacity-factor", type=float, default=1.0, help="cf: >0 fixed capacity, 0 dropless, <0 dropless capped (default 1.0)"
    )
    p.add_argument("--activation", default="swiglu", choices=["relu", "gelu", "silu", "swiglu", "geglu"])
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default 2; 1 with --nproc)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per implementation (default 7)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--impls", default="moeflow,einsum,loop,floor", help="comma-separated subset of moeflow,einsum,loop,floor"
    )
    p.add_argument("--no-memory", action="store_true", help="skip the (untimed) peak-memory pass")
    p.add_argument(
        "--nproc", type=int, default=None,
        help="expert parallelism: launch N local ranks with torchrun (T tokens and E/N experts each) "
        "and compare with one rank holding all experts",
    )
    p.add_argument("--node-size", type=int, default=None, help="with --nproc: ranks per node for the two-level exchange")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the full report as JSON")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    if args.nproc is not None:
        return _run_parallel_bench(args)
    from moeflow.bench import BenchConfig, format_table, run_layer_bench

    if args.threads is None:
        args.threads = 2
    try:
        flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(BenchConfig) if hasattr(args, f.name)}
        flags["impls"] = tuple(s.strip() for s in args.impls.split(",") if s.strip())
        cfg = BenchConfig(**flags, memory=not args.no_memory)
    except (ValueError, TypeError) as err:
        print(f"moeflow bench: error: {err}", file=sys.stderr)
        return 2
    report = run_layer_bench(cfg, progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _run_parallel_bench(args: argparse.Namespace) -> int:
    from moeflow.bench.parallel import ParallelBenchConfig, format_parallel_table, run_parallel_bench

    if args.threads is None:
        args.threads = 1
    if args.device != "cpu" or args.impls != "moeflow,einsum,loop,floor":
        print("moeflow bench: error: --nproc runs the moeflow layer on this machine's devices; "
              "--device/--impls do not apply", file=sys.stderr)
        return 2
    try:
        flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(ParallelBenchConfig) if hasattr(args, f.name)}
        cfg = ParallelBenchConfig(**flags)
    except (ValueError, TypeError) as err:
        print(f"moeflow bench: error: {err}", file=sys.stderr)
        return 2
    report = run_parallel_bench(cfg)
    print(format_parallel_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeflow", description="Mixture-of-Experts layers for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
