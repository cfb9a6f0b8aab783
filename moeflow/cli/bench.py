"""``moeflow bench`` (the layer beside its baselines, one process or N expert-parallel ranks) and
``moeflow a2a-model`` (the all-to-all cost model, optionally calibrated on this machine)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moeflow.cli.flags import DEVICE_HELP, check_device, choose_device, config_from_flags, float_at_least
from moeflow.kernels.activation import ACTIVATIONS

__all__ = ["add_bench", "add_a2a_model"]


def add_bench(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--activation", default="swiglu", choices=ACTIVATIONS)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help=f"{DEVICE_HELP}; not with --nproc")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default 2; 1 with --nproc)")
    p.add_argument("--repeats", type=int, default=7,
                   help="timed repeats per implementation (default 7), after the --warmup untimed ones")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up repeats before the timed ones (default 1)")
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
    p.add_argument("--hidden-shards", type=int, default=1,
                   help="with --nproc: split every expert's hidden units over this many ranks (allows E < nproc)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="with --nproc: force this share of tokens onto expert 0 and compare contiguous experts "
                        "with a load-aware placement")
    p.add_argument("--expert-slots", type=int, default=0,
                   help="with --skew: experts per rank for the placement (default E/nproc; more allows replicas)")
    p.add_argument("--sweep", action="store_true",
                   help="with --nproc: also time every parallel mode / overlap_degree and the auto-tuner's choice")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the full report as JSON")
    p.set_defaults(func=_run_bench)


def _check_json_path(path: Path | None) -> str | None:
    """Why ``--json PATH`` cannot be written (checked before the benchmark runs), or None: its
    folder is created as writing would, and a file is opened there for appending (then removed
    again if it was not there before)."""
    if path is None:
        return None
    if path.is_dir():
        return f"--json {path}: is a directory, not a file path"
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as err:
        return f"--json {path}: cannot write there ({err.strerror or err})"
    if not existed:
        path.unlink()
    return None


def _run_bench(args: argparse.Namespace) -> int:
    problem = _check_json_path(args.json)
    if problem is not None:
        print(f"moeflow bench: error: {problem}", file=sys.stderr)
        return 2
    if args.nproc is not None:
        if args.device is not None:
            check_device("--device", args.device)  # a missing CUDA is one line, not torch's assertion
        return _run_parallel_bench(args)
    device = choose_device("--device", args.device)  # before any work; CUDA where available
    if args.sweep or args.skew or args.expert_slots or args.hidden_shards != 1:
        print("moeflow bench: error: --sweep, --skew, --expert-slots and --hidden-shards need --nproc N", file=sys.stderr)
        return 2
    from moeflow.bench import BenchConfig, format_table, run_layer_bench

    if args.threads is None:
        args.threads = 2
    impls = tuple(s.strip() for s in args.impls.split(",") if s.strip())
    cfg = config_from_flags(BenchConfig, args, impls=impls, memory=not args.no_memory, device=device.device)
    if cfg is None:
        return 2
    print(device.line, file=sys.stderr, flush=True)  # stdout: the table alone
    report = run_layer_bench(cfg, progress=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    return _show(format_table(report), report, args.json)


def _show(table: str, report: dict, json_path: Path | None) -> int:
    print(table)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {json_path}")
    return 0


def _run_parallel_bench(args: argparse.Namespace) -> int:
    from moeflow.bench.parallel import ParallelBenchConfig, format_parallel_table, run_parallel_bench

    if args.threads is None:
        args.threads = 1
    if args.device not in (None, "cpu") or args.impls != "moeflow,einsum,loop,floor":
        print("moeflow bench: error: --nproc runs the moeflow layer on this machine's devices; "
              "--device/--impls do not apply", file=sys.stderr)
        return 2
    cfg = config_from_flags(ParallelBenchConfig, args)
    if cfg is None:
        return 2
    report = run_parallel_bench(cfg)
    return _show(format_parallel_table(report), report, args.json)


def add_a2a_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "a2a-model",
        help="predicted flat vs two-level all-to-all times for 16..2048 ranks, and the crossover",
        description="Latency + bytes/bandwidth model of the flat and two-level all-to-all "
        "(moeflow.parallel.placement.costmodel). Defaults: 8-GPU NVLink nodes on 400 Gb/s InfiniBand.",
    )
    p.add_argument("--bytes-per-rank", type=float_at_least(0, strict=True), default=2 * 4096 * 4096 * 2.0,
                   help="bytes each rank exchanges (default: T=4096, K=2, D=4096, bf16 = 64 MiB)")
    p.add_argument("--node-size", type=int, default=8)
    p.add_argument("--calibrate", action="store_true",
                   help="also measure gloo all-to-all between 2 local ranks and print the model with those parameters")
    p.set_defaults(func=_run_a2a_model)


def _model_table(bytes_per_rank: float, links, title: str) -> str:  # type: ignore[no-untyped-def]
    from moeflow.parallel.placement.costmodel import crossover, flat_time, two_level_time

    worlds = [w for w in (16, 32, 64, 128, 256, 512, 1024, 2048) if w % links.node_size == 0]
    lines = [title, f"{'ranks':>7}{'flat ms':>12}{'2-level ms':>13}{'2-level/flat':>14}"]
    for w in worlds:
        f, t = flat_time(w, bytes_per_rank, links), two_level_time(w, bytes_per_rank, links)
        lines.append(f"{w:>7}{f * 1e3:>12.3f}{t * 1e3:>13.3f}{t / f:>14.2f}")
    cross = crossover(bytes_per_rank, links, worlds)
    lines.append(f"crossover: two-level is faster from {cross} ranks on" if cross else "crossover: none in 16..2048")
    return "\n".join(lines)


def _copy_bandwidth() -> float:
    import statistics
    import time

    import torch

    src = torch.randn(16 * 2**20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 4 / statistics.median(times[1:])  # read + write


def _run_a2a_model(args: argparse.Namespace) -> int:
    import tempfile

    from moeflow.parallel.placement.costmodel import LinkModel
    from moeflow.parallel.launch.torchrun import run_torchrun

    try:
        links = LinkModel(node_size=args.node_size)
    except ValueError as err:
        print(f"moeflow a2a-model: error: {err}", file=sys.stderr)
        return 2
    mib = args.bytes_per_rank / 2**20
    print(_model_table(args.bytes_per_rank, links,
                       f"NVLink nodes of {links.node_size} on 400 Gb/s InfiniBand, {mib:.0f} MiB per rank:"))
    if not args.calibrate:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cal.json"
        try:
            run_torchrun("moeflow.bench.calibrate", [str(out)], nproc=2, threads=1)
        except RuntimeError as err:
            print(f"moeflow a2a-model: error: {err}", file=sys.stderr)
            return 1
        cal = json.loads(out.read_text())
    a, b = cal["latency_s"], cal["bandwidth_Bps"]
    print(f"\ncalibration ({cal['backend']}, {cal['world']} local ranks, all_to_all_single, median of 15):")
    for sent, sec in cal["points"]:
        print(f"  {sent / 2**10:>9.0f} KiB sent per rank: {sec * 1e3:8.3f} ms  (fit {(a + sent / b) * 1e3:8.3f} ms)")
    print(f"  fit: latency {a * 1e6:.1f} us per exchange, bandwidth {b / 1e9:.2f} GB/s per rank")
    copy_bw = _copy_bandwidth()
    print(f"  host memory copy: {copy_bw / 1e9:.1f} GB/s (64 MiB tensor copy, median of 5), used for the reorders")
    gloo = LinkModel(node_size=args.node_size, intra_latency=a, intra_bandwidth=b, inter_latency=a,
                     inter_bandwidth=b, memory_bandwidth=copy_bw)
    print()
    print(_model_table(args.bytes_per_rank, gloo,
                       f"gloo-calibrated links (intra = inter = this machine's loopback), {mib:.0f} MiB per rank:"))
    return 0
