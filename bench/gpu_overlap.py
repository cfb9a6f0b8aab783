"""Does the pipelined exchange overlap the expert GEMMs, and what does chunking cost the GEMMs?
Timings, a profile per degree and the step time the cost model predicts at 8 and 64 GPUs.

    python -m bench.gpu_overlap                          # one GPU: 1 rank, NCCL loopback exchange
    torchrun --nproc-per-node 8 -m bench.gpu_overlap     # 8 GPUs: a real all-to-all
    python -m bench.gpu_overlap --device cpu --tiny      # smoke run (gloo; no kernels to profile)

Two layers (``--layers``): Mixtral-like (T=16384 per rank, D=4096, H=14336, E=8, K=2) and
DeepSeek-like routed experts (T=16384, D=2048, H=1408, E=64, K=6), dropless by default. For each
``overlap_degree`` in ``--degrees`` it times the expert-parallel layer's forward and
forward+backward (median of ``--repeats``, after warm-up; the slowest rank counts), then
profiles one forward+backward with ``torch.profiler`` and reads the device kernels from the
exported Chrome trace:

- ``exchange``: NCCL kernels (the all-to-all; under NCCL they run on the process group's own
  stream) and device copies on those streams, ``compute``: every other kernel (the measured
  compute of the degree: the GEMMs and everything else but the exchange);
- ``overlap``: the time during which an exchange kernel and a compute kernel run at once (the
  union of the exchange intervals intersected with the union of the compute intervals), and the
  share of the exchange time it hides;
- the CUDA streams each kind ran on.

Per layer it reports the compute of each degree over degree 1's (``compute_ratio``: what the
chunks cost the GEMMs; the issue's target is at most 1.05 at degree 2) and, per degree, the
step the cost model (``moeflow.parallel.placement.costmodel.predicted_step_time``: the default
links of 8-GPU NVLink nodes on 400 Gb/s InfiniBand, or ``--calibration``'s fit) predicts on 8
and 64 GPUs with T tokens per rank: this degree's measured compute (a third forward, two thirds
backward) pipelined with the exchange of ``T*K*D`` elements per rank each way.

With one rank the exchange is NCCL's send to itself: it shows whether the chunks' copies run
beside the GEMMs, not what an inter-GPU link costs (if that exchange leaves no NCCL kernel or
copy in the trace, the report says so instead of printing an overlap). The traces are written
to ``--trace-dir`` (open them in Perfetto). On CPU there are no device kernels: the timings print,
the overlap columns say so, and the predictions use the fwd+bwd time as the compute.
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
from moeflow.parallel.placement.costmodel import LinkModel, predicted_step_time


# name: (T per rank, D, H, E, K); --tiny: the small shapes
LAYERS = {"mixtral": (16384, 4096, 14336, 8, 2), "deepseek": (16384, 2048, 1408, 64, 6)}
TINY_LAYERS = {"mixtral": (256, 64, 128, 4, 2), "deepseek": (256, 64, 32, 16, 4)}
WORLDS = (8, 64)  # the predicted step times


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--layers", default="mixtral,deepseek", help=f"comma-separated, of {sorted(LAYERS)}")
    for name in ("tokens", "dim", "hidden", "experts", "top-k"):
        p.add_argument(f"--{name}", type=int, default=None, help="override every layer's value")
    p.add_argument("--capacity-factor", type=float, default=0.0)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--degrees", default="1,2,4")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="small shapes for a smoke run")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a moeflow.bench.calibrate JSON: its latency and bandwidth for both link levels")
    p.add_argument("--trace-dir", type=Path, default=None, help="where the Chrome traces go (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    try:
        args.degrees = [int(d) for d in args.degrees.split(",")]
    except ValueError:
        p.error(f"--degrees must be comma-separated ints, got {args.degrees!r}")
    if not args.degrees or min(args.degrees) < 1 or 1 not in args.degrees:
        p.error(f"--degrees must be positive ints including 1, got {args.degrees}")
    args.layers = [name.strip() for name in args.layers.split(",") if name.strip()]
    if not args.layers or any(name not in LAYERS for name in args.layers):
        p.error(f"--layers must name some of {sorted(LAYERS)}, got {args.layers}")
    for name in ("tokens", "dim", "hidden", "experts", "top_k"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.repeats < 1 or args.warmup < 0:
        p.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
    if args.calibration is not None and not args.calibration.is_file():
        p.error(f"--calibration {args.calibration} is not a file")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    return args


def layer_shape(name: str, args: argparse.Namespace) -> dict:
    """``{tokens, dim, hidden, experts, top_k}`` of layer ``name`` (its preset, ``--tiny``'s, then
    the overrides)."""
    T, D, H, E, K = (TINY_LAYERS if args.tiny else LAYERS)[name]
    shape = {"tokens": T, "dim": D, "hidden": H, "experts": E, "top_k": K}
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    return shape


def links_of(args: argparse.Namespace) -> tuple[LinkModel, str]:
    """The cost model's links and where they come from."""
    if args.calibration is None:
        return LinkModel(), "defaults: 8-GPU NVLink nodes on 400 Gb/s InfiniBand"
    cal = json.loads(args.calibration.read_text())
    a, b = float(cal["latency_s"]), float(cal["bandwidth_Bps"])
    return (LinkModel(intra_latency=a, intra_bandwidth=b, inter_latency=a, inter_bandwidth=b),
            f"calibrated ({cal.get('backend', '?')}: {a * 1e6:.1f} us, {b / 1e9:.2f} GB/s) for both levels")


def predictions(shape: dict, dtype: torch.dtype, compute_ms: dict[int, float], links: LinkModel) -> dict:
    """``{world: {degree: predicted fwd+bwd ms}}`` from each degree's measured compute."""
    bytes_per_rank = shape["tokens"] * shape["top_k"] * shape["dim"] * torch.finfo(dtype).bits // 8
    return {str(w): {str(d): 1e3 * predicted_step_time(w, bytes_per_rank, c / 3e3, 2 * c / 3e3, d, links)
                     for d, c in compute_ms.items()} for w in WORLDS}


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


def _run_layer(name: str, args, device, rank: int, world: int, trace_dir: Path) -> dict:  # type: ignore[no-untyped-def]
    """Every degree's timings and profile on layer ``name``."""
    shape = layer_shape(name, args)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = moeflow.MoE(dim=shape["dim"], hidden=shape["hidden"], num_experts=shape["experts"], top_k=shape["top_k"],
                        capacity_factor=args.capacity_factor, device=device, dtype=dtype)
    expert_parallel(layer)
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    x = torch.randn(shape["tokens"], shape["dim"], generator=gen, device=device, dtype=dtype).requires_grad_(True)
    g = torch.randn(shape["tokens"], shape["dim"], generator=gen, device=device, dtype=dtype)
    rows = []
    for degree in args.degrees:
        fwd = _time(layer, x, g, degree, False, args, device)
        both = _time(layer, x, g, degree, True, args, device)
        prof = _profile(layer, x, g, degree, device, trace_dir / f"rank{rank}_{name}_degree{degree}.json")
        rows.append({"overlap_degree": degree, "forward_ms": fwd * 1e3, "fwd_bwd_ms": both * 1e3,
                     "compute_ms": prof.get("compute_ms"), "profile": prof})
    del layer, x, g
    if device.type == "cuda":
        torch.cuda.empty_cache()
    measured = all(r["compute_ms"] is not None for r in rows)
    compute = {r["overlap_degree"]: (r["compute_ms"] if measured else r["fwd_bwd_ms"]) for r in rows}
    for r in rows:
        r["compute_ratio"] = r["compute_ms"] / compute[1] if measured else None
    links, source = links_of(args)
    return {"shape": shape, "timings": rows, "compute_source": "device kernels but the exchange's" if measured
            else "fwd+bwd wall time (no device kernels)", "predicted_ms": predictions(shape, dtype, compute, links),
            "links": source, "world": world}


def _print_layer(name: str, r: dict, args) -> None:  # type: ignore[no-untyped-def]
    s = r["shape"]
    print(f"\n{name}-like layer: T={s['tokens']}/rank D={s['dim']} H={s['hidden']} E={s['experts']} K={s['top_k']} "
          f"cf={args.capacity_factor}; compute: {r['compute_source']}")
    worlds = list(r["predicted_ms"])
    print(f"{'degree':>7} {'forward ms':>11} {'fwd+bwd ms':>11} {'compute ms':>11} {'compute/d1':>11}"
          + "".join(f" {'pred ' + w + ' GPUs':>14}" for w in worlds))
    for t in r["timings"]:
        d = t["overlap_degree"]
        comp = "-" if t["compute_ms"] is None else f"{t['compute_ms']:.3f}"
        ratio = "-" if t["compute_ratio"] is None else f"{t['compute_ratio']:.3f}x"
        print(f"{d:>7} {t['forward_ms']:>11.3f} {t['fwd_bwd_ms']:>11.3f} {comp:>11} {ratio:>11}"
              + "".join(f" {r['predicted_ms'][w][str(d)]:>14.3f}" for w in worlds))
    for t in r["timings"]:
        prof, d = t["profile"], t["overlap_degree"]
        if not prof.get("kernels"):
            print(f"  degree {d}: no device kernels in the trace (CPU run): overlap not measurable")
        elif prof["exchange_hidden"] is None:
            print(f"  degree {d}: no NCCL kernel or copy in the trace (the exchange did not run on the device): "
                  f"overlap not measurable")
        else:
            print(f"  degree {d}: exchange kernels {prof['exchange_ms']:.3f} ms on streams {prof['exchange_streams']}, "
                  f"compute on {prof['compute_streams']}, overlap {prof['overlap_ms']:.3f} ms "
                  f"({prof['exchange_hidden']:.0%} of the exchange hidden)")
    print(f"  predicted: links {r['links']}")


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_overlap: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    _init(args.device)
    rank, world = process_position()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if args.device == "cuda" else "cpu")
    bad = [f"{n} ({layer_shape(n, args)['experts']} experts)" for n in args.layers
           if layer_shape(n, args)["experts"] % world]
    if bad:
        print(f"gpu_overlap: the experts of {', '.join(bad)} must be divisible by the {world} ranks", file=sys.stderr)
        shutdown_distributed()
        return 2
    # one directory for all ranks (they share MASTER_PORT)
    trace_dir = args.trace_dir or Path(tempfile.gettempdir()) / f"moeflow-overlap-{os.environ['MASTER_PORT']}"
    trace_dir.mkdir(parents=True, exist_ok=True)
    layers = {name: _run_layer(name, args, device, rank, world, trace_dir) for name in args.layers}
    shutdown_distributed()
    if rank != 0:
        return 0

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"expert-parallel layers on {world} rank(s), {name}, {args.dtype}; traces: {trace_dir}")
    for layer_name, r in layers.items():
        _print_layer(layer_name, r, args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        first = layers[args.layers[0]]
        args.json.write_text(json.dumps({
            "device": name, "world": world,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                       if k not in ("json", "trace_dir")},
            "layers": layers, "timings": first["timings"],  # (timings: the first layer's, as before)
            "profiles": {str(t["overlap_degree"]): t["profile"] for t in first["timings"]},
            "date": time.strftime("%Y-%m-%d")}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
