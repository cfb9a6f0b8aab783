"""Stage kernels: ``bench.gpu_kernels`` (dense mm TFLOP/s, copy GB/s, the layer per experts
backend at the Mixtral-like and DeepSeek-like shapes, the bare FFN, permute, routing and slots;
not the one-hot einsum reference on CUDA, minutes at these shapes) with fewer repeats; its JSON
is kept."""

from __future__ import annotations

import json

from bench.gpu_check.runner import Context, python, run_command

__all__ = ["stage_kernels"]


def stage_kernels(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "kernels.json"
    path.unlink(missing_ok=True)
    repeats = ctx.repeats or (1 if ctx.tiny else 5)
    argv = python("-m", "bench.gpu_kernels", "--json", str(path), "--repeats", str(repeats))
    if ctx.device == "cpu":
        argv += ["--device", "cpu", "--tiny"]
    elif ctx.tiny:
        argv += ["--tiny"]
    else:  # the one-hot einsum reference took over a minute of the stage's 100 s on an H100
        argv += ["--no-einsum"]
    run_command(ctx, "kernels", argv, timeout_s)
    report = json.loads(path.read_text())
    rows = report["rows"]
    figures: dict = {"header": report["header"], "json": str(path), "rows": len(rows)}
    ceil = {r["unit"]: r["rate"] for r in rows if r["case"] == "ceiling"}
    figures["mm_tflops"], figures["copy_gbps"] = ceil.get("TFLOP/s"), ceil.get("GB/s")
    parts = [f"mm {figures['mm_tflops']:.3g} TFLOP/s, copy {figures['copy_gbps']:.3g} GB/s"]
    for case in dict.fromkeys(r["case"] for r in rows if r["case"] != "ceiling"):
        layer = {r["impl"]: r for r in rows if r["case"] == case and r["pass_"] == "fwd+bwd" and "moeflow" in r["impl"]}
        figures[case] = {impl: {"ms": r["ms"], "tflops": r["rate"], "pct_of_mm": r["pct"]} for impl, r in layer.items()}
        gbps = {r["impl"]: r["rate"] for r in rows if r["case"] == case and r["unit"] == "GB/s"}
        figures[case]["permute_gbps"] = gbps.get("permute")
        shown = ", ".join(f"{impl.split(' ')[0]} {r['ms']:.1f} ms ({r['pct']:.0f}%)" for impl, r in layer.items())
        parts.append(f"{case} layer fwd+bwd: {shown}")
    return {**figures, "summary": "; ".join(parts)}
