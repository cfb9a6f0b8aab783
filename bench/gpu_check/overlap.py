"""Stage overlap: ``bench.gpu_overlap`` on one device (NCCL loopback exchange on CUDA, gloo on
CPU), overlap degrees 1, 2, 4 (1, 2 at tiny shapes): fwd+bwd time and how much of the exchange
the pipeline hides."""

from __future__ import annotations

import json

from bench.gpu_check.runner import Context, python, run_command

__all__ = ["stage_overlap"]


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
    rows = r["timings"]
    base = next(t for t in rows if t["overlap_degree"] == 1)
    parts = [f"degree {t['overlap_degree']} {t['fwd_bwd_ms']:.1f} ms ({t['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x)"
             for t in rows]
    hidden = [f"degree {d}: {p['exchange_hidden']:.0%} of the exchange hidden" for d, p in r["profiles"].items()
              if p.get("exchange_hidden") is not None]
    return {"timings": rows, "profiles": r["profiles"], "json": str(path),
            "summary": "fwd+bwd " + ", ".join(parts) + ("; " + ", ".join(hidden) if hidden else
                                                          "; overlap not measurable (no device exchange kernels)")}
