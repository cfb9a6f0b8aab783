"""Stage overlap: ``bench.gpu_overlap`` on one device (NCCL loopback exchange on CUDA, gloo on
CPU), the Mixtral-like and DeepSeek-like layers at overlap degrees 1, 2, 4 (1, 2 at tiny
shapes): per degree the fwd+bwd time, the measured compute (device kernels but the exchange's)
and its ratio to degree 1 (the target: at most ``COMPUTE_RATIO_TARGET`` at degree 2), how much
of the exchange the pipeline hides, and the step the cost model predicts on 8 and 64 GPUs."""

from __future__ import annotations

import json

from bench.gpu_check.runner import Context, python, run_command

__all__ = ["stage_overlap", "COMPUTE_RATIO_TARGET", "overlap_summary"]

COMPUTE_RATIO_TARGET = 1.05  # degree 2's compute over degree 1's (issue 50)


def overlap_summary(report: dict) -> tuple[dict, str]:
    """``(targets, summary)`` of a ``bench.gpu_overlap`` JSON report: per layer, degree 2's
    compute ratio against the target (None where no device kernels were measured)."""
    targets, parts = {}, []
    for name, layer in report["layers"].items():
        rows = {t["overlap_degree"]: t for t in layer["timings"]}
        ratio = rows[2]["compute_ratio"] if 2 in rows else None
        targets[name] = {"compute_ratio_degree2": ratio, "target": COMPUTE_RATIO_TARGET,
                         "met": None if ratio is None else ratio <= COMPUTE_RATIO_TARGET}
        times = ", ".join(f"d{d} {t['fwd_bwd_ms']:.1f}" for d, t in rows.items())
        comp = ("compute " + ", ".join(f"d{d} {t['compute_ms']:.1f}" for d, t in rows.items())
                + f" ms (d2/d1 {ratio:.3f}, target <= {COMPUTE_RATIO_TARGET})") if ratio is not None else \
            "compute not measured (no device kernels)"
        pred = "; ".join(f"{w} GPUs " + "/".join(f"{v:.1f}" for v in per.values())
                         for w, per in layer["predicted_ms"].items())
        hidden = [f"d{d} {t['profile']['exchange_hidden']:.0%}" for d, t in rows.items()
                  if t["profile"].get("exchange_hidden") is not None]
        parts.append(f"{name}: fwd+bwd {times} ms; {comp}; predicted ms per degree {pred}"
                     + (f"; exchange hidden {', '.join(hidden)}" if hidden else ""))
    return targets, " | ".join(parts)


def stage_overlap(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "overlap.json"
    path.unlink(missing_ok=True)
    argv = python("-m", "bench.gpu_overlap", "--json", str(path), "--trace-dir", str(ctx.out / "traces"),
                  "--repeats", str(ctx.repeats or (2 if ctx.tiny else 3)), "--warmup", "1",
                  "--degrees", "1,2" if ctx.tiny else "1,2,4")
    if ctx.device == "cpu":
        argv += ["--device", "cpu"]
    if ctx.tiny:
        argv += ["--tiny"]
    run_command(ctx, "overlap", argv, timeout_s)
    r = json.loads(path.read_text())
    targets, summary = overlap_summary(r)
    return {"timings": r["timings"], "profiles": r["profiles"], "layers": r["layers"], "targets": targets,
            "json": str(path), "summary": summary}
