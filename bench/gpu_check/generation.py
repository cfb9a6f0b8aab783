"""Stages generate and decode.

    generate  ``python -m moeflow generate`` from the training run's checkpoint, sampled
              (temperature, top-k, top-p, a seed; 4 prompts in one batch) and greedy
    decode    ``bench.generate`` (greedy generation, the same weights in moeflow and
              transformers) on issue 27's Mixtral-shaped model (dim 1024, 8 layers, 16/8 heads,
              8 experts top-2, expert hidden 1408, vocabulary 32000), bf16, 128-token prompts,
              128 new tokens, batch 1 and 16: moeflow's eager and compiled decode
              (``generate(compile=True)``: CUDA graphs) beside transformers' eager ``grouped_mm``
              ``generate`` and its static-cache compiled ``generate`` (one ``StaticCache``
              reused), each compared with its like; compiled and eager tokens of an fp32 copy
              at batch 16 (they must be equal: the stage fails if not); the first decode step's
              bf16 logits against fp32; and each decode's fraction of the memory-bandwidth limit
              (the bytes a step must read at the measured copy bandwidth). Its compilations
              (moeflow's and transformers', bf16, both batch sizes, and moeflow's fp32 one) are
              most of its time.
"""

from __future__ import annotations

import json
import re
import time

from bench.gpu_check.runner import Context, StageFailed, python, run_command
from bench.gpu_check.training import device_line, needs_run

__all__ = ["stage_generate", "stage_decode", "decode_summary", "DECODE_FLAGS", "DECODE_TINY_FLAGS"]


def _rates(stderr: str) -> dict:
    found = {}
    for phase in ("prefill", "decode"):
        m = re.search(rf"{phase}: (\d+) tokens in [\d.]+ s \(([\d,]+) tokens/s\)", stderr)
        if m:
            found[f"{phase}_tokens"], found[f"{phase}_tokens_per_s"] = int(m[1]), float(m[2].replace(",", ""))
    return found


def stage_generate(ctx: Context, timeout_s: float) -> dict:
    run = needs_run(ctx)
    prompts = ctx.out / "prompts.txt"
    prompts.write_text("ROMEO.\nJULIET.\nTo be, or not to be\nHAMLET.\n")
    new = "16" if ctx.tiny else "128"
    common = ["-m", "moeflow", "generate", str(run), "--device", ctx.device, "--max-new-tokens", new]
    t_end = time.monotonic() + timeout_s
    sampled = run_command(ctx, "generate", python(*common, "--prompts-file", str(prompts), "--batch-size", "4",
                                                    "--temperature", "0.8", "--sample-top-k", "20", "--top-p", "0.9",
                                                    "--seed", "1"), timeout_s)
    greedy = run_command(ctx, "generate", python(*common, "--temperature", "0"), t_end - time.monotonic())
    texts = [t for t in re.split(r"^### prompt \d+\n", sampled.stdout, flags=re.M) if t.strip()]
    if len(texts) != 4 or not greedy.stdout.strip():
        raise StageFailed(f"expected 4 sampled completions and a greedy one, got {len(texts)} and "
                          f"{len(greedy.stdout.strip())} characters")
    figures = {"device": device_line(sampled.stderr), "sampled": _rates(sampled.stderr),
               "greedy": _rates(greedy.stderr), "greedy_text": greedy.stdout[:200]}
    s, g = figures["sampled"], figures["greedy"]
    return {**figures, "summary": f"on {figures['device']}: sampled 4 prompts x {new} tokens, decode "
                                  f"{s.get('decode_tokens_per_s', 0):,.0f} tokens/s; greedy, decode "
                                  f"{g.get('decode_tokens_per_s', 0):,.0f} tokens/s"}


# issue 27's GPU model and workload; the fp32 check at batch 16 only (a compilation of its own
# for each batch size, and the budget holds one). The tiny smoke shapes: a 2-layer model,
# 8-token prompts, the fp32 check at every batch size (fp32 is the smoke's dtype: no new
# compilation) and transformers' static-cache compiled generate on (off by default on a CPU)
DECODE_FLAGS = ["--dim", "1024", "--layers", "8", "--heads", "16", "--kv-heads", "8", "--experts", "8", "--top-k", "2",
                "--hidden", "1408", "--vocab", "32000", "--prompt-len", "128", "--new-tokens", "128",
                "--batch-sizes", "1,16", "--dtype", "bfloat16", "--repeats", "3", "--fp32-check-batches", "16"]
DECODE_TINY_FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--top-k", "2",
                     "--hidden", "96", "--vocab", "256", "--prompt-len", "8", "--new-tokens", "12", "--batch-sizes", "2",
                     "--repeats", "1", "--threads", "1", "--hf-static", "on", "--max-warmups", "4"]


def decode_summary(report: dict) -> str:
    """The decode stage's line from ``bench.generate``'s report, per batch size: the fp32 token
    check, the bench dtype's first-step logits against fp32 (max relative difference), the
    compiled decode's tokens/s and fraction of the bandwidth limit, and the like-with-like ratios
    (> 1: moeflow faster; a withdrawn one says so)."""
    parts = []
    for case in report["cases"]:
        B, by = case["batch"], {r["candidate"]: r for r in report["results"] if r["batch"] == case["batch"]
                                and r["new_tokens"] == case["new_tokens"]}
        fp32 = case["fp32_tokens"]
        bits = [f"fp32 compiled vs eager tokens {fp32['agreement']}" if fp32["checked"] else
                "fp32 tokens not checked here"]
        logits = ", ".join(f"{name.replace('moeflow:', '').replace('moeflow', 'eager')} {d['max_rel']:.1e}"
                           for name, d in case["first_step_logits"].items())
        bits.append(f"{case['dtype']} first-step logits vs fp32 (max rel): {logits}")
        fast = by.get("moeflow:compiled", by["moeflow"])
        line = f"{fast['candidate']} {fast['decode_tok_s'] or 0:,.0f} tok/s"
        if fast["bandwidth_fraction"] is not None:
            limit = case["limit"]
            line += (f" = {fast['bandwidth_fraction']:.1%} of the bandwidth limit "
                     f"({limit['bytes_per_step']['total'] / 1e6:,.1f} MB a step at {limit['copy_gbps']:,.0f} GB/s)")
        bits.append(line)
        pairs = [r["pair"] for r in case["ratios"]]
        if "moeflow:compiled" in by and "moeflow compiled / transformers static-cache compiled" not in pairs:
            bits.append(f"no transformers static-cache compiled baseline ({report['hf_static']})")
        for r in case["ratios"]:
            if r["pair"] == "moeflow compiled / moeflow eager":
                continue
            bits.append(f"{r['pair']} withdrawn ({r['withdrawn']})" if r["withdrawn"] else
                        f"{r['pair']} {r['decode_x']:.2f}x")
        parts.append(f"B={B}: " + "; ".join(bits))
    return " | ".join(parts)


def stage_decode(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "decode.json"
    path.unlink(missing_ok=True)
    argv = python("-m", "bench.generate", *(DECODE_TINY_FLAGS if ctx.tiny else DECODE_FLAGS),
                  "--hf-experts", "grouped_mm", "--layer-tokens", "", "--device", ctx.device, "--json", str(path))
    run_command(ctx, "decode", argv, timeout_s)
    report = json.loads(path.read_text())
    figures: dict = {k: report[k] for k in ("copy_gbps", "hf_static", "cases", "ratios")}
    figures["rows"] = report["results"]
    for B in sorted({r["batch"] for r in report["results"]}):
        figures[f"batch_{B}"] = {r["candidate"]: r["decode_tok_s"] for r in report["results"] if r["batch"] == B}
    checked = [c for c in report["cases"] if c["fp32_tokens"]["checked"]]
    if not checked:
        raise StageFailed("no fp32 token check ran (--fp32-check-batches names no batch size of the run)", figures)
    differ = [f"B={c['batch']}: {c['fp32_tokens']['agreement']}" for c in checked if not c["fp32_tokens"]["equal"]]
    if differ:
        raise StageFailed("compiled and eager decode of the fp32 model give different tokens: " + "; ".join(differ)
                          + f" | {decode_summary(report)}", figures)
    return {**figures, "summary": decode_summary(report)}
