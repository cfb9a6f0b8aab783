"""Stage profile: ``bench.stage_profile`` on the DeepSeek-like layer: device kernel time of one
forward+backward per stage (router, slots, dispatch, GEMM, activation, combine, losses; forward
and backward), CPU op time without CUDA. ``worker_profile`` is the in-process part
(``--worker profile``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.gpu_check.runner import Context, run_worker

__all__ = ["stage_profile", "worker_profile"]


def stage_profile(ctx: Context, timeout_s: float) -> dict:
    r = run_worker(ctx, "profile", "profile", timeout_s)
    ctx.printed.append(r["table"])
    shares = ", ".join(f"{row['stage']} {row['share']:.0%}" for row in r["rows"] if row["share"] >= 0.005)
    return {**{k: v for k, v in r.items() if k != "table"},
            "summary": f"{r['shape']} fwd+bwd {r['total_ms']:.2f} ms of {r['unit']} time: {shares}"}


def worker_profile(args: argparse.Namespace) -> dict:
    """Stage profile: the stage table of the DeepSeek-like layer (``bench.gpu_kernels``'s)."""
    import torch

    from bench.gpu_kernels import FULL_SHAPES, Shape, _layer
    from bench.stage_profile import format_stage_table, profile_stages

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shape = (Shape("deepseek-tiny", T=256, D=32, H=32, E=16, K=4) if args.tiny
             else next(s for s in FULL_SHAPES if s.name == "deepseek"))
    layer = _layer(shape, "auto", device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(shape.T, shape.D, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    trace = Path(args.out_dir) / "traces" / "stage_profile.json"
    trace.parent.mkdir(parents=True, exist_ok=True)
    result = profile_stages(layer, x, steps=3, trace_path=trace)
    name = f"{shape.name} T={shape.T} D={shape.D} H={shape.H} E={shape.E} K={shape.K}"
    table = (f"stage profile, {name}, {dtype}, experts backend {layer.experts.config.backend}:\n"
             + format_stage_table(result))
    return {**result, "shape": name, "trace": str(trace), "table": table}
