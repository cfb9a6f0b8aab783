"""Measure the all-to-all latency and bandwidth between local ranks (gloo, or NCCL on GPUs).

A torchrun worker; ``moeflow a2a-model --calibrate`` runs it on 2 local ranks and fits the cost
model's link parameters (``moeflow.parallel.placement.costmodel``) to what it writes:

    torchrun --nproc-per-node=2 -m moeflow.bench.calibrate OUT.json

Each rank sends ``m`` bytes to every rank (itself included) with one equal-split all-to-all, for
``m`` from 4 KiB to 16 MiB; the median time of each size, after 2 untimed runs, is fitted to
``t = a + m_sent / b`` with ``m_sent = m * (W - 1)`` (the bytes that leave the rank). Rank 0
writes ``{"points": [[m_sent, seconds], ...], "latency_s": a, "bandwidth_Bps": b, ...}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moeflow.parallel.comm import all_to_all_equal, backend_name, barrier, group_device, process_position
from moeflow.parallel.placement.costmodel import fit_latency_bandwidth
from moeflow.parallel.groups import init_distributed, shutdown_distributed

__all__ = ["SIZES", "measure", "main"]

SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB per destination


def measure(repeats: int = 15) -> dict:
    """Time the exchange of every size in ``SIZES`` on the default process group (initialised
    from torchrun's environment if it is not yet); every rank returns the same fit."""
    init_distributed()
    rank, W = process_position()
    device = group_device()  # the device the backend's collectives take
    rows = []
    for size in SIZES:
        n = size // 4
        src = torch.randn(W * n, device=device)
        dst = torch.empty_like(src)
        times = []
        for rep in range(repeats + 2):
            barrier()
            t0 = time.perf_counter()
            all_to_all_equal(dst, src)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        rows.append((size * (W - 1), statistics.median(times)))
    barrier()
    a, b = fit_latency_bandwidth([r[0] for r in rows], [r[1] for r in rows])
    return {"rank": rank, "world": W, "backend": backend_name(), "points": rows, "latency_s": a, "bandwidth_Bps": b}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON file rank 0 writes")
    args = parser.parse_args(argv)
    result = measure()
    if result["rank"] == 0:
        args.out.write_text(json.dumps(result))
    shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
