"""Stage fp8: ``bench.gpu_fp8``: the MoE layer's forward+backward with bf16 experts against
``ExpertsConfig(fp8="rowwise")`` at the Mixtral-like and DeepSeek-like shapes (ms, the speed-up,
the FP8 output's and gradients' error against bf16), and FP8 weight-only experts at decode's row
counts, and a 400-step training of the demo model with bf16 and with FP8 experts (validation
loss); in the smoke run the emulated (reference) FP8 path at a tiny shape and 4 steps. A part
that fails is in the figures' ``failures`` with its error text; the stage fails only when
nothing was measured."""

from __future__ import annotations

import json

from bench.gpu_check.runner import Context, StageFailed, python, run_command

__all__ = ["stage_fp8"]

# the targets for the FP8 layer's fwd+bwd speed-up over bf16
TARGETS = {"mixtral": 1.5, "deepseek": 1.3}


def stage_fp8(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "fp8.json"
    path.unlink(missing_ok=True)
    argv = python("-m", "bench.gpu_fp8", "--json", str(path), "--repeats", str(ctx.repeats or (1 if ctx.tiny else 5)),
                  "--warmup", "1" if ctx.tiny else "2", "--train-steps", "4" if ctx.tiny else "400")
    if ctx.device == "cpu":
        argv += ["--device", "cpu"]
    if ctx.tiny:
        argv += ["--tiny"]
    try:
        run_command(ctx, "fp8", argv, timeout_s)
    except StageFailed as exc:  # a timeout or a crash: keep what the report already holds (rewritten per part)
        if not path.is_file():
            raise
        raise StageFailed(str(exc), _figures(json.loads(path.read_text()), path)) from None
    figures = _figures(json.loads(path.read_text()), path)
    if figures["summary"] is None:
        raise StageFailed("fp8: nothing measured: " + "; ".join(f"{f['what']}: {f['error'][-300:]}"
                                                               for f in figures["failures"]), figures)
    return figures


def _figures(r: dict, path) -> dict:
    """The stage's figures from ``bench.gpu_fp8``'s report; ``summary`` None when nothing was timed."""
    figures: dict = {"json": str(path), "header": r["header"], "probe": r.get("probe"), "layer": r["layer"],
                     "weight_only": r["weight_only"], "failures": r["failures"], "targets": TARGETS}
    parts = []
    for name, part in r["layer"].items():
        if "speedup_fwd_bwd" in part:
            target = TARGETS.get(name)
            parts.append(f"{name} fwd+bwd bf16 {part['bf16']['fwd_bwd_ms']:.1f} ms, fp8 {part['fp8']['fwd_bwd_ms']:.1f} ms "
                         f"({part['speedup_fwd_bwd']:.2f}x" + (f", target {target}x" if target else "") + ")"
                         + (f", y err {part['rel_err']['y']:.3f}" if "rel_err" in part else ""))
    train = r.get("train")
    figures["train"] = train
    if train:
        parts.append(f"train {train['steps']} steps val loss fp8 {train['rel_diff']:+.2%} vs bf16 (target within 2%)")
    decode = [w for w in r["weight_only"] if "speedup" in w]
    if decode:
        parts.append("weight-only fp8 " + ", ".join(f"{w['tokens']} tok {w['speedup']:.2f}x" for w in decode))
    if r["failures"]:
        parts.append(f"{len(r['failures'])} failed: " + "; ".join(f["what"] for f in r["failures"]))
    measured = decode or any("speedup_fwd_bwd" in p for p in r["layer"].values())
    return {**figures, "summary": "; ".join(parts) if measured else None}
