"""Measure gloo/NCCL all-to-all latency and bandwidth between local ranks (torchrun worker).

Each rank sends ``m`` bytes to every other rank with ``all_to_all_single``; the median time of
each size is fitted to ``t = a + m_total_sent / b``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moeflow.parallel.costmodel import fit_latency_bandwidth
from moeflow.parallel.groups import init_distributed

SIZES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB per destination


def measure(repeats: int = 15) -> dict:
    init_distributed()
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
    rows = []
    for size in SIZES:
        n = size // 4
        src = torch.randn(W * n, device=device)
        dst = torch.empty_like(src)
        times = []
        for rep in range(repeats + 2):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(dst, src)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep >= 2:
                times.append(time.perf_counter() - t0)
        rows.append((size * (W - 1), statistics.median(times)))
    dist.barrier()
    a, b = fit_latency_bandwidth([r[0] for r in rows], [r[1] for r in rows])
    return {"rank": rank, "world": W, "backend": dist.get_backend(), "points": rows, "latency_s": a, "bandwidth_Bps": b}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    result = measure()
    if result["rank"] == 0:
        parser.parse_args().out.write_text(json.dumps(result))
    dist.destroy_process_group()
