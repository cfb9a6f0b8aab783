"""Stage decode-bw: ``bench.decode_bandwidth`` (issue 50, item 3), moeflow's compiled decode of a
Qwen3-30B-A3B-shaped model with all 48 layers in bf16 (about 61 GB of weights, drawn on the
device), batch 1, 4 and 16, against the bytes a step must read at the measured copy bandwidth;
batch 1 with each expert backend of ``BACKENDS`` (torch's grouped GEMM and moeflow's Triton
grouped FFN, whose few-row tiles are for this), then batch 4 and 16 with the faster of them.
Each case compiles the 48-layer step anew (most of the stage's time); the benchmark starts a
case only while the time left exceeds the longest case so far, and lists the others as skipped.
At tiny shapes: a 2-layer model of the same form (on the CPU: fp32, the backend ``auto`` picks
there, batch 1 and 2).

The weight formats of ``WEIGHTS`` each run once, in a process of their own, with their share of
the stage's time (``SHARES``): bf16, then FP8 weight-only experts at batch 1 (``fp8``: e4m3 codes and a scale per
output column, ``moeflow.experts.quantize_experts_fp8``; their own product whatever the expert
backend, so one backend; the issue's target: at least 1.6x bf16's tokens/s).
The summary: per format and batch, the fastest backend's ms a step and its fraction of the
bandwidth limit (the issue's target: at least 50% at batch 1 in bf16), at batch 1 the kernels a
step runs and their time (``--profile-steps``: the JSON has the longest of them), the other
backends beside it, the copy bandwidth, the compile time of a case; a case that failed fails the stage
(its figures are kept).
"""

from __future__ import annotations

import json
import time

from bench.gpu_check.runner import Context, StageFailed, python, run_command

__all__ = ["stage_decode_bw", "decode_bw_summary", "BACKENDS", "WEIGHTS", "SHARES", "FULL_FLAGS", "TINY_FLAGS"]

BACKENDS = ("grouped_mm", "triton")  # on CUDA; the CPU smoke takes "auto" (no Triton kernels compiled there)
WEIGHTS = ("bf16", "fp8")  # the weight formats, each a run of its own
# each format's share of the stage's time: bf16 times its batch sizes with both backends, FP8
# batch 1 alone (``_FP8_BATCHES``: the format's target is at batch 1, and each case is a compilation)
SHARES = {"bf16": 0.6, "fp8": 0.4}
_FP8_BATCHES = ["--batch-sizes", "1"]
FULL_FLAGS = ["--shape", "qwen3-30b-a3b", "--batch-sizes", "1,4,16", "--prompt-len", "448", "--warmup", "4",
              "--steps", "32", "--count-steps", "4", "--profile-steps", "3"]
TINY_FLAGS = ["--shape", "tiny", "--prompt-len", "16", "--warmup", "1", "--steps", "6", "--count-steps", "2",
              "--profile-steps", "1"]
_MARGIN_S = 25.0  # what the benchmark leaves of the stage's time: the process's start and end


def _amount(n: float, unit: str) -> str:
    """``n`` with a G/M/k prefix (``1.2 GB``, ``350 kB``)."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}{unit}"
    return f"{n:.0f} {unit}"


def _by_batch(report: dict) -> dict[int, list[dict]]:
    rows: dict[int, list[dict]] = {}
    for r in report["results"]:
        rows.setdefault(r["batch"], []).append(r)
    return rows


def decode_bw_summary(weights: str, report: dict) -> str:
    """One format's part of the summary line (module docstring)."""
    head = (f"{weights} {report.get('layers', '?')} layers, {_amount(report.get('parameters', 0), 'params')}, copy "
            f"{report.get('copy_gbps', 0):,.0f} GB/s")
    parts = []
    for B, rows in sorted(_by_batch(report).items()):
        best = min(rows, key=lambda r: r["ms_per_step"])
        others = ", ".join(f"{r['backend']} {r['ms_per_step']:.2f} ms" for r in rows if r is not best)
        prof = best.get("profile") or {}
        kernels = (f", a step {prof['calls_per_step']:.0f} {prof['unit']} taking {prof['us_per_step'] / 1e3:.2f} ms"
                   if "us_per_step" in prof else "")
        parts.append(f"B={B}: {best['ms_per_step']:.2f} ms/step ({best['backend']}) = {best['bandwidth_fraction']:.1%} "
                     f"of the limit ({_amount(best['bytes_per_step']['total'], 'B')}/step, {best['tokens_per_s']:,.0f} "
                     f"tok/s{kernels})" + (f" [{others}]" if others else ""))
    compiles = [r["compile_s"] for r in report["results"]]
    if compiles:
        parts.append(f"compile {min(compiles):.0f}-{max(compiles):.0f} s a case")
    if report.get("skipped"):
        parts.append("skipped " + ", ".join(f"{s['backend']} B={s['batch']}" for s in report["skipped"]))
    if report.get("failed"):
        parts.append("FAILED " + ", ".join(f"{f['backend']} B={f['batch']} ({f['error'][:120]})"
                                           for f in report["failed"]))
    return head + ": " + ("; ".join(parts) if parts else "no case finished")


def _figures(report: dict) -> dict:
    """The JSON's figures, and per batch each backend's ms a step and fraction of the limit."""
    figures = {k: report.get(k) for k in ("shape", "layers", "device", "dtype", "parameters", "active_parameters",
                                           "weight_bytes", "build_s", "copy_gbps", "copy_gbps_counts", "skipped",
                                           "failed", "total_s")}
    figures["rows"] = report.get("results", [])
    for B, rows in _by_batch(report).items():
        figures[f"batch_{B}"] = {r["backend"]: {"ms_per_step": r["ms_per_step"], "tokens_per_s": r["tokens_per_s"],
                                                "bandwidth_fraction": r["bandwidth_fraction"]} for r in rows}
    return figures


def stage_decode_bw(ctx: Context, timeout_s: float) -> dict:
    t_end = time.monotonic() + timeout_s
    flags = TINY_FLAGS if ctx.tiny else FULL_FLAGS
    cuda = ctx.device == "cuda"
    batches = ["--batch-sizes", "1,2"] if ctx.device == "cpu" else []
    figures: dict = {}
    lines: list[str] = []
    failed: list[str] = []
    for i, weights in enumerate(WEIGHTS):
        share = (t_end - time.monotonic()) * SHARES[weights] / sum(SHARES[w] for w in WEIGHTS[i:])
        path = ctx.out / f"decode_bw_{weights}.json"
        path.unlink(missing_ok=True)
        # FP8 weight-only experts run their own product whatever the backend: one backend is enough
        backends = ("auto",) if not cuda else BACKENDS if weights == "bf16" else BACKENDS[:1]
        sizes = _FP8_BATCHES if weights == "fp8" else batches
        argv = python("-m", "bench.decode_bandwidth", *flags, *sizes, "--device", ctx.device, "--weights", weights,
                      "--experts-backend", ",".join(backends), "--time-budget", f"{max(1.0, share - _MARGIN_S):.0f}",
                      "--json", str(path))
        try:
            run_command(ctx, "decode-bw", argv, share)
        except StageFailed as err:  # (a timeout or a crash: what the JSON kept so far is reported)
            report = json.loads(path.read_text()) if path.exists() else {"results": []}
            figures[weights] = _figures(report)
            failed.append(f"{weights}: {err}")
            lines.append(decode_bw_summary(weights, report))
            continue
        report = json.loads(path.read_text())
        figures[weights] = {**_figures(report), "json": str(path)}
        lines.append(decode_bw_summary(weights, report))
        if not report["results"]:
            failed.append(f"{weights}: no case finished")
        elif report["failed"]:
            failed.append(f"{weights}: {len(report['failed'])} case(s) failed")
    summary = " | ".join(lines)
    if failed:
        raise StageFailed("; ".join(failed) + " | " + summary, figures)
    return {**figures, "summary": summary}
