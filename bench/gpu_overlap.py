"""Does the pipelined exchange overlap the expert GEMMs? Timings and a profile, in one command.

    python -m bench.gpu_overlap                          # one GPU: 1 rank, NCCL loopback exchange
    torchrun --nproc-per-node 8 -m bench.gpu_overlap # 8 GPUs: a real all-to-all
    python -m bench.gpu_overlap --device cpu --tiny      # smoke run (gloo; no kernels to profile)


For each ``overlap_degree`` in ``--degrees`` it times the expert-parallel layer's forward and
forward+backward (median of ``--repeats``, after warm-up; the slowest rank counts), then
profiles one forward+backward at degree 1 and at the best degree above 1 with
``torch.profiler`` and reads the device kernels from the exported Chrome trace:

- ``exchange``: NCCL kernels (the all-to-all; under NCCL they run on the process group's own
  stream) and device copies on those streams, ``compute``: every other kernel;
- ``overlap``: the time during which an exchange kernel and a compute kernel run at once (the
  union of the exchange intervals intersected with the union of the compute intervals), and the
  share of the exchange time it hides;
- the CUDA streams each kind ran on.

With one rank the exchange is NCCL's send to itself: it shows whether the chunks' copies run
beside the GEMMs, not what an inter-GPU link costs (if that exchange leaves no NCCL kernel or
copy in the trace, the report says so instead of printing an overlap). The traces are written to ``--trace-dir``
(open them in Perfetto). On CPU there are no device kernels: the timings print and the overlap
columns say so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import moeflow
from moeflow.parallel import expert_parallel, init_distributed, shutdown_distributed
from moeflow.parallel.comm import barrier, gather_objects, process_position


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--tokens", type=int, default=16384, help="T per rank")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=14336)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=0.0)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--degrees", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small shapes (T=256, D=64, H=128, E=4) for a smoke run")
    p.add_argument("--trace-dir", type=Path, default=None, help="where the Chrome traces go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.dim, args.hidden, args.experts = 256, 64, 128, 4
    try:
        args.degrees = [int(d) for d in args.degrees.split(",")]
    except ValueError:
        p.error(f"--degrees must be comma-separated ints, got {args.degrees!r}")
    if not args.degrees or min(args.degrees) < 1 or 1 not in args.degrees:
        p.error(f"--degrees must be positive ints including 1, got {args.degrees}")
    for name in ("tokens", "dim", "hidden", "experts", "top_k", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def _init(device: str) -> None:
    """torchrun's environment, or a 1-rank group on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("nccl" if device == "cuda" else "gloo")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(layer: moeflow.MoE, x: torch.Tensor, g: torch.Tensor, degree: int, backward: bool) -> None:
    y = layer(x, overlap_degree=degree)
    if backward:
        torch.autograd.grad(y, [x, *layer.parameters()], g, allow_unused=True)


def _time(layer, x, g, degree: int, backward: bool, args, device) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of the slowest rank."""
    times = []
    for rep in range(args.warmup + args.repeats):
        barrier()
        _sync(device)
        t0 = time.perf_counter()
        _step(layer, x, g, degree, backward)
        _sync(device)
        if rep >= args.warmup:
            times.append(time.perf_counter() - t0)
    every = gather_objects(times)  # the slowest rank per repeat
    return statistics.median(max(per_rank) for per_rank in zip(*every))


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(u: list[tuple[float, float]], v: list[tuple[float, float]]) -> float:
    """Total length where two sorted, disjoint interval lists overlap."""
    i = j = 0
    total = 0.0
    while i < len(u) and j < len(v):
        lo, hi = max(u[i][0], v[j][0]), min(u[i][1], v[j][1])
        total += max(0.0, hi - lo)
        if u[i][1] < v[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_overlap(trace: dict) -> dict:
    """Exchange (NCCL) and compute kernel time, their overlap and streams, from a Chrome trace
    dict exported by ``torch.profiler`` (times in microseconds in the trace, ms here)."""
    device_events = [ev for ev in trace.get("traceEvents", [])
                     if ev.get("cat") in ("kernel", "gpu_memcpy") and "dur" in ev]
    stream = lambda ev: ev.get("args", {}).get("stream", ev.get("tid"))  # noqa: E731
    nccl_streams = {stream(ev) for ev in device_events if "nccl" in ev.get("name", "").lower()}
    comm, comp = [], []
    streams: dict[str, set] = {"exchange": set(), "compute": set()}
    for ev in device_events:
        is_comm = "nccl" in ev.get("name", "").lower() or (ev["cat"] == "gpu_memcpy" and stream(ev) in nccl_streams)
        kind = "exchange" if is_comm else "compute"
        (comm if is_comm else comp).append((float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])))
        streams[kind].add(stream(ev))
    if not comm and not comp:
        return {"kernels": 0}
    u_comm, u_comp = _union(comm), _union(comp)
    hidden = _intersection(u_comm, u_comp)
    exchange = _length(u_comm)
    return {
        "kernels": len(comm) + len(comp),
        "exchange_ms": exchange / 1e3,
        "compute_ms": _length(u_comp) / 1e3,
        "overlap_ms": hidden / 1e3,
        "exchange_hidden": hidden / exchange if exchange else None,
        "exchange_streams": sorted(map(str, streams["exchange"])),
        "compute_streams": sorted(map(str, streams["compute"])),
    }


def _profile(layer, x, g, degree: int, device: torch.device, path: Path) -> dict:  # type: ignore[no-untyped-def]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _step(layer, x, g, degree, True)  # warm
    _sync(device)
    with profile(activities=activities) as prof:
        _step(layer, x, g, degree, True)
        _sync(device)
    prof.export_chrome_trace(str(path))
    return kernel_overlap(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_overlap: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    _init(args.device)
    rank, world = process_position()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    if args.experts % world:
        print(f"gpu_overlap: --experts {args.experts} must be divisible by the {world} ranks", file=sys.stderr)
        shutdown_distributed()
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = moeflow.MoE(dim=args.dim, hidden=args.hidden, num_experts=args.experts, top_k=args.top_k,
                        capacity_factor=args.capacity_factor, device=device, dtype=dtype)
    expert_parallel(layer)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(args.tokens, args.dim, generator=gen, device=device, dtype=dtype).requires_grad_(True)
    g = torch.randn(args.tokens, args.dim, generator=gen, device=device, dtype=dtype)

    rows = []
    for degree in args.degrees:
        fwd = _time(layer, x, g, degree, False, args, device)
        both = _time(layer, x, g, degree, True, args, device)
        rows.append({"overlap_degree": degree, "forward_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3})
    base = next(r for r in rows if r["overlap_degree"] == 1)
    best = min((r for r in rows if r["overlap_degree"] > 1), key=lambda r: r["fwd_bwd_ms"], default=None)
    # one directory for all ranks (they share MASTER_PORT)
    trace_dir = args.trace_dir or Path(tempfile.gettempdir()) / f"moeflow-overlap-{os.environ['MASTER_PORT']}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    profiles = {}
    for degree in [1] + ([best["overlap_degree"]] if best else []):
        profiles[degree] = _profile(layer, x, g, degree, device, trace_dir / f"rank{rank}_degree{degree}.json")
    shutdown_distributed()
    if rank != 0:
        return 0

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"expert-parallel layer on {world} rank(s), {name}, {args.dtype}: T={args.tokens}/rank D={args.dim} "
          f"H={args.hidden} E={args.experts} K={args.top_k} cf={args.capacity_factor}")
    print(f"{'overlap_degree':>14} {'forward ms':>11} {'fwd+bwd ms':>11} {'vs degree 1':>12}")
    for r in rows:
        print(f"{r['overlap_degree']:>14} {r['forward_ms']:>11.3f} {r['fwd_bwd_ms']:>11.3f} "
              f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:>11.3f}x")
    print(f"\nprofile of one forward+backward (traces: {trace_dir}):")
    for degree, prof in profiles.items():
        if not prof.get("kernels"):
            print(f"  degree {degree}: no device kernels in the trace (CPU run): overlap not measurable")
            continue
        if prof["exchange_hidden"] is None:
            print(f"  degree {degree}: no NCCL kernel or copy in the trace (the exchange did not run on the "
                  f"device): overlap not measurable; compute kernels {prof['compute_ms']:.3f} ms")
            continue
        print(f"  degree {degree}: exchange kernels {prof['exchange_ms']:.3f} ms on streams {prof['exchange_streams']}, "
              f"compute kernels {prof['compute_ms']:.3f} ms on streams {prof['compute_streams']}, "
              f"overlap {prof['overlap_ms']:.3f} ms ({prof['exchange_hidden']:.0%} of the exchange hidden)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": name, "world": world, "config": {
            k: v for k, v in vars(args).items() if k not in ("json", "trace_dir")}, "timings": rows,
            "profiles": {str(k): v for k, v in profiles.items()}, "date": time.strftime("%Y-%m-%d")}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
