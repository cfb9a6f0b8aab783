"""The GPU acceptance run: one command that shows what moeflow does on a CUDA machine.

    python -m bench.gpu_check            # CUDA, bf16, full shapes, in a 540 s budget (H100 run: docs/benchmarks.md)
    python -m bench.gpu_check --smoke    # the same stages at tiny shapes on CPU (= --device cpu --tiny)
    make gpu-check


Every stage runs in subprocesses of its own, with its own timeout, under one overall time budget
(``--budget``); a stage that fails or times out is recorded (its log under ``--out-dir/logs``)
and the run goes on. Nothing needs moeflow installed: the subprocesses run ``sys.executable``
with the repository root on ``PYTHONPATH``. Stages, in order:

    gpu-tests  ``pytest -m gpu`` on the test files that mark a test ``gpu``, with compiled Triton
               kernels (``TRITON_INTERPRET`` removed from the environment), less the torchrun
               trainer test (``TRAINER_TEST``: the train and resume stages run its commands):
               passed / failed / skipped from its JUnit XML. Smoke:
               ``--collect-only`` (the gpu tests still import; nothing to run without CUDA)
    kernels    ``bench.gpu_kernels`` (dense mm TFLOP/s, copy GB/s, the layer per experts
               backend at the Mixtral-like and DeepSeek-like shapes, the bare FFN, permute, routing
               and slots; not the one-hot einsum reference, minutes at these shapes), with fewer
               repeats; its JSON is kept
    hf-layer   the whole ``moeflow.MoE`` layer against transformers' ``grouped_mm`` experts on the
               same weights (``bench.hf.make_block``; the layer built from the block's
               tensors with the same routing): forward and forward+backward at Mixtral-like,
               DeepSeek-like (with its shared expert) and T=2048 shapes, for moeflow's default
               backend (``"auto"``), ``"grouped_mm"`` and ``"triton"``, and, where the
               ``scattermoe`` package is importable (CUDA), the layer with ScatterMoE's Triton
               experts on the same weights and routing; ms, the ratio to transformers and the
               output's relative error against it
    train      ``python -m torch.distributed.run --standalone --nproc-per-node 1 -m moeflow train``
               (tiny preset, NCCL on CUDA, gloo on CPU): a checkpoint
    resume     the same run with ``--resume`` and more steps: continues from that checkpoint
    dcp        in a 1-rank process group (NCCL / gloo) under torchrun: the trained model (one more
               optimizer step) saved with ``torch.distributed.checkpoint`` through
               ``moeflow.parallel.save_dcp``, loaded (``load_dcp``) into a scrambled copy and
               compared tensor by tensor (parameters, buffers, optimizer state); and the train
               checkpoint converted with ``moeflow.checkpoint.dcp.moeflow_to_dcp``, loaded the same
               way and compared
    generate   ``python -m moeflow generate --device cuda`` from that checkpoint, sampled
               (temperature, top-k, top-p, a seed; 4 prompts in one batch) and greedy
    infer      ``python -m moeflow infer --offload disk --device cuda --compare`` on that checkpoint:
               experts streamed from disk, output compared with the in-memory model
    decode     ``bench.generate`` (greedy generation, the same weights): moeflow's eager and
               compiled decode (``generate(compile=True)``: CUDA graphs) against transformers'
               ``grouped_mm`` ``generate`` and its static-cache compiled ``generate``, on issue
               27's Mixtral-shaped model (dim 1024, 8 layers, 16/8 heads, 8 experts top-2, expert
               hidden 1408, vocabulary 32000), bf16, 128-token prompts, 128 new tokens, batch 1
               and 16; decode tokens/s and the ratios. Four compilations: most of its time
    overlap    ``bench.gpu_overlap`` on 1 GPU (NCCL loopback exchange, degrees 1, 2, 4)
    profile    ``bench.stage_profile`` on the DeepSeek-like layer: device kernel time of
               one forward+backward per stage (router, slots, dispatch, GEMM, activation, combine,
               losses; forward and backward), CPU op time in the smoke run

It prints a progress line per stage, the hf-layer and profile tables, and last one summary
table (stage, status ``ok`` / ``FAILED`` / ``skipped`` with the reason, seconds, key figures);
writes the JSON report (``--json``; keys in ``REPORT_KEYS`` and ``STAGE_KEYS``) and keeps the
logs, traces and per-stage JSON under ``--out-dir``. Exit status 0 when no stage failed.

Smoke mode (``--smoke``): the same stages on CPU at tiny shapes, fp32, gloo instead of NCCL, the
Triton interpreter (``TRITON_INTERPRET=1`` in the subprocesses' environment) where Triton runs
(not in hf-layer's ``triton`` column: seconds per call), the stages of the training run and the
others in two chains at once (``--jobs 2``); ``tests/test_bench_gpu_check.py`` runs it so the
script cannot rot between GPU runs. On CUDA the stages run one at a time (``--jobs 1``).

Should the 1-rank torchrun training fail, a single-process ``moeflow train`` gives the later
stages a checkpoint (the train stage still reports FAILED, naming it). ``--worker`` runs the
in-process part of a stage (hf, profile; dcp under torchrun) in the subprocess the orchestrator
starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import REPO
from bench.common import child_env as checkout_env

FORMAT = "moeflow-gpu-check/1"
REPORT_KEYS = ("format", "mode", "device", "device_name", "dtype", "versions", "date", "budget_s", "jobs", "total_s",
               "out_dir", "ok", "stages")
STAGE_KEYS = ("name", "status", "reason", "seconds", "timeout_s", "summary", "figures", "log")
STATUSES = ("ok", "FAILED", "skipped")
NO_CUDA = "no CUDA here"  # the words a stage skipped for want of a GPU says


class StageSkipped(Exception):
    """A stage that did not run, and why."""


class StageFailed(Exception):
    """A stage that ran and failed, and why (one line, or a few)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[["Context", float], dict]  # (context, seconds allowed) -> figures (+ "summary")
    timeout_s: float  # CUDA, full shapes
    tiny_timeout_s: float  # tiny shapes (smoke)
    chain: str = "bench"  # stages of one chain run in order; with --jobs 2 the two chains run at once


@dataclasses.dataclass
class Context:
    device: str  # "cuda" or "cpu"
    tiny: bool
    out: Path
    env: dict[str, str]
    repeats: int | None = None
    selected: tuple[str, ...] = ()  # the stages of this invocation
    state: dict = dataclasses.field(default_factory=dict)  # what a stage leaves for later ones (the run dir)
    printed: list[str] = dataclasses.field(default_factory=list)  # detail tables, printed before the summary

    @property
    def mode(self) -> str:
        return "smoke" if self.device == "cpu" else ("gpu-tiny" if self.tiny else "gpu")

    @property
    def dtype(self) -> str:
        return "float32" if self.device == "cpu" else "bfloat16"


# --------------------------------------------------------------------------- subprocesses


def child_env(device: str) -> dict[str, str]:
    """The subprocesses' environment: the repository importable (moeflow need not be installed),
    unbuffered output, and the Triton interpreter on CPU only (on CUDA the kernels compile). On
    CPU one thread per process: the tiny shapes gain nothing from more, and two chains of stages
    on a small, shared machine with two threads each spend their time waiting for each other's
    threads (a tiny decode step went from ~6 ms to ~1 s a token)."""
    env = checkout_env()
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def _tail(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


_LAUNCHER_NOISE = ("ChildFailedError", "torch.distributed.elastic", "error_file", "To enable traceback",
                   "elastic/multiprocessing", "raise ChildFailedError")


def failure_reason(text: str) -> str:
    """The line that says why a command failed: the last ``... error: ...`` or exception line that
    is not torchrun's own report (which ends every failed torchrun output); else the last lines.
    The whole output is in the stage's log."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    cause = [line for line in lines if re.search(r"(^|\W)(error|Error|Exception)\b", line)
             and not any(noise in line for noise in _LAUNCHER_NOISE)]
    return cause[-1] if cause else _tail(text)


def run_command(ctx: Context, log_name: str, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``argv`` in the repository root with the children's environment, in a process group of
    its own (a timeout kills torchrun's workers too); append the command and its output to
    ``logs/<log_name>.log``. Raises ``StageFailed`` on a timeout or a non-zero exit status."""
    log = ctx.out / "logs" / f"{log_name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=ctx.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(1.0, timeout_s))
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this call started (torchrun and its workers)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - t0
    with log.open("a") as f:
        f.write(f"$ {shlex.join(argv)}\n# exit status {proc.returncode}, {seconds:.1f} s"
                f"{' (timed out)' if timed_out else ''}\n--- stdout\n{out}\n--- stderr\n{err}\n\n")
    if timed_out:
        raise StageFailed(f"timed out after {timeout_s:.0f} s: {shlex.join(argv[:6])} ...; {_tail(err or out, 3)}")
    if proc.returncode != 0:
        raise StageFailed(f"exit status {proc.returncode}: {failure_reason(err or out)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _torchrun(*args: str) -> list[str]:
    return _python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args)


def _worker(ctx: Context, stage: str, name: str, timeout_s: float) -> dict:
    """Run ``--worker name`` of this module in a subprocess, logged as ``stage``; returns the JSON
    it wrote."""
    result = ctx.out / f"{name}.json"
    result.unlink(missing_ok=True)
    args = ["-m", "bench.gpu_check", "--worker", name, "--result", str(result), "--device", ctx.device,
            "--out-dir", str(ctx.out), *(["--tiny"] if ctx.tiny else []),
            *(["--repeats", str(ctx.repeats)] if ctx.repeats else [])]
    run_command(ctx, stage, _python(*args), timeout_s)
    return json.loads(result.read_text())


# --------------------------------------------------------------------------- stages


def junit_counts(xml_path: Path) -> dict:
    """``{"passed", "failed", "errors", "skipped", "tests", "failures": [test ids]}`` from a
    pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "tests": counts["tests"], "failures": failing}


def collected_counts(pytest_quiet_output: str) -> dict[str, int]:
    """``{file: tests}`` from ``pytest --collect-only -qq`` (lines ``tests/x.py: 11``)."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+\.py): (\d+)$", pytest_quiet_output, re.M)}


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu`` (collecting only those is what ``-m gpu`` keeps of
    the whole suite, without importing every other test module)."""
    return [f"tests/{p.name}" for p in sorted((REPO / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]


# the gpu test that runs ``torchrun -m moeflow train --device cuda`` and resumes it: the train and
# resume stages run the same commands (40 s of the stage's 150 s on the H100, which the decode
# stage needs)
TRAINER_TEST = "tests/test_gpu.py::test_trainer_on_cuda_under_torchrun_trains_and_resumes"


def stage_gpu_tests(ctx: Context, timeout_s: float) -> dict:
    def pytest(*args: str) -> list[str]:
        return _python("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *args)

    files = gpu_test_files()
    if not files:
        raise StageFailed("no test file under tests/ marks a test gpu")
    if ctx.device == "cpu":
        done = run_command(ctx, "gpu-tests", pytest(*files, "--collect-only"), timeout_s)
        files = collected_counts(done.stdout)  # type: ignore[assignment]
        if not files:
            raise StageFailed(f"pytest collected no gpu test: {_tail(done.stdout)}")
        n = sum(files.values())
        return {"collected": n, "files": files, "summary": f"{n} gpu tests collected ({NO_CUDA}: --collect-only)"}
    xml = ctx.out / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    try:
        run_command(ctx, "gpu-tests", pytest(*files, "--deselect", TRAINER_TEST, "-rfEs", "--junitxml", str(xml)),
                    timeout_s)
    except StageFailed as err:
        if not xml.exists():
            raise
        counts = junit_counts(xml)
        raise StageFailed(f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                          f"{counts['skipped']} skipped; failing: {', '.join(counts['failures'][:5])}") from err
    counts = junit_counts(xml)
    if counts["tests"] == 0:
        raise StageFailed("pytest ran no gpu test")
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if counts["skipped"]:
        summary += " (skips on a GPU machine: see the log)"
    return {**counts, "summary": summary}


def stage_kernels(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "kernels.json"
    path.unlink(missing_ok=True)
    repeats = ctx.repeats or (1 if ctx.tiny else 5)
    argv = _python("-m", "bench.gpu_kernels", "--json", str(path), "--repeats", str(repeats))
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


def stage_hf_layer(ctx: Context, timeout_s: float) -> dict:
    result = _worker(ctx, "hf-layer", "hf", timeout_s)
    ctx.printed.append(result["table"])
    bad = [f"{r['shape']} {impl}: {m['rel_err']:.1e}" for r in result["rows"] for impl, m in r["impl"].items()
           if m.get("rel_err") is not None and not m["rel_err"] <= result["max_rel_err"]]
    parts = []
    for r in result["rows"]:
        ratios = ", ".join(f"{impl} {m['fwd_bwd_ms']:.1f} ms ({m['hf_over_this']:.2f}x)"
                           for impl, m in r["impl"].items() if impl != "transformers grouped_mm")
        hf_ms = r["impl"]["transformers grouped_mm"]["fwd_bwd_ms"]
        parts.append(f"{r['shape']}: transformers {hf_ms:.1f} ms, {ratios}")
    figures = {k: v for k, v in result.items() if k != "table"}
    if bad:
        raise StageFailed(f"outputs differ from transformers' (relative error over {result['max_rel_err']}): "
                          + "; ".join(bad))
    return {**figures, "summary": "fwd+bwd ms (transformers / moeflow): " + " | ".join(parts)}


def _train_sizes(ctx: Context) -> dict:
    if ctx.tiny:
        return dict(steps=4, more=6, every=2, batch=4, seq=32, eval_batches=1)
    return dict(steps=30, more=40, every=10, batch=16, seq=128, eval_batches=2)


def _train_argv(ctx: Context, run: Path, steps: int, *extra: str, torchrun: bool = True) -> list[str]:
    s = _train_sizes(ctx)
    args = ["-m", "moeflow", "train", "--device", ctx.device, "--preset", "tiny", "--steps", str(steps),
            "--checkpoint-every", str(s["every"]), "--batch-size", str(s["batch"]), "--seq-len", str(s["seq"]),
            "--eval-every", "0", "--eval-batches", str(s["eval_batches"]), "--sample-tokens", "0", "--no-plot",
            "--no-progress", "--out", str(run), *extra]
    return _torchrun(*args) if torchrun else _python(*args)


def _history(run: Path) -> dict:
    return json.loads((run / "history.json").read_text())


def _latest_step(run: Path) -> int | None:
    if not (run / "checkpoints").is_dir():
        return None
    steps = sorted(int(p.name.removeprefix("step-")) for p in (run / "checkpoints").glob("step-*")
                   if (p / "index.json").exists())
    return steps[-1] if steps else None


def stage_train(ctx: Context, timeout_s: float) -> dict:
    """The 1-rank torchrun training run. Should it fail, a single-process run (no torchrun, no
    process group) gives the later stages a checkpoint, and this stage still reports FAILED."""
    run = ctx.out / "run"
    steps = _train_sizes(ctx)["steps"]
    t_end = time.monotonic() + timeout_s
    try:
        done = run_command(ctx, "train", _train_argv(ctx, run, steps, "--overwrite"), timeout_s)
    except StageFailed as err:
        single = ctx.out / "run-single"
        try:
            run_command(ctx, "train", _train_argv(ctx, single, steps, "--overwrite", torchrun=False),
                        t_end - time.monotonic())
        except StageFailed:
            raise err from None
        if _latest_step(single) == steps:
            ctx.state["run"] = single
            raise StageFailed(f"{err}\n(the later stages use the checkpoint of a single-process run without "
                              f"torchrun, which worked: {single})") from None
        raise
    hist = _history(run)
    step = _latest_step(run)
    if step != steps:
        raise StageFailed(f"the latest checkpoint under {run}/checkpoints is step {step}, expected {steps}")
    ctx.state["run"] = run
    (_, v0), (_, v1) = hist["val"][0], hist["val"][-1]
    figures = {"device": _device_line(done.stdout + done.stderr), "steps": steps, "checkpoint_step": step,
               "train_loss": hist["train_loss"][-1], "val_before": v0,
               "val_after": v1, "tokens_per_s": hist.get("tokens_per_s"), "world_size": hist.get("world_size")}
    return {**figures, "summary": f"on {figures['device']}: {steps} steps, val loss {v0:.3f} -> {v1:.3f}, "
                                  f"{figures['tokens_per_s'] or 0:,.0f} tokens/s, checkpoint step {step}"}


def _needs_run(ctx: Context) -> Path:
    """The training run of the train stage; without the train stage in this invocation
    (``--stages generate``, say), the one an earlier invocation left in ``--out-dir``."""
    run = ctx.state.get("run")
    if run is None and "train" not in ctx.selected and _latest_step(ctx.out / "run") is not None:
        run = ctx.state["run"] = ctx.out / "run"
    if run is None:
        raise StageSkipped("needs the train stage's checkpoint (that stage did not run or failed)")
    return run


def stage_resume(ctx: Context, timeout_s: float) -> dict:
    run = _needs_run(ctx)
    s = _train_sizes(ctx)
    done = run_command(ctx, "resume", _train_argv(ctx, run, s["more"], "--resume"), timeout_s)
    hist = _history(run)
    step = _latest_step(run)
    if step != s["more"] or hist["step"][-1] != s["more"]:
        raise StageFailed(f"after --resume the latest checkpoint is step {step} and history ends at "
                          f"{hist['step'][-1]}, expected {s['more']}")
    if hist["step"] != list(range(1, s["more"] + 1)):
        raise StageFailed(f"the resumed history's steps are not 1..{s['more']}: {hist['step']}")
    resumed = re.search(r"resuming the run .* at step (\d+)", done.stdout + done.stderr)
    figures = {"resumed_from": int(resumed[1]) if resumed else None, "steps": s["more"], "checkpoint_step": step,
               "train_loss": hist["train_loss"][-1], "val_after": hist["val"][-1][1],
               "world_sizes": hist["world_sizes"]}
    return {**figures, "summary": f"resumed at step {figures['resumed_from']}, ran to {step}, "
                                  f"val loss {figures['val_after']:.3f}"}


def stage_dcp(ctx: Context, timeout_s: float) -> dict:
    run = _needs_run(ctx)
    path = ctx.out / "dcp.json"
    path.unlink(missing_ok=True)
    run_command(ctx, "dcp", _torchrun("-m", "bench.gpu_check", "--worker", "dcp", "--result", str(path),
                                      "--device", ctx.device, "--out-dir", str(ctx.out), "--run-dir", str(run),
                                      *(["--tiny"] if ctx.tiny else [])),
                timeout_s)
    r = json.loads(path.read_text())
    problems = [k for k in ("saved_equal", "converted_equal") if not r[k]]
    if problems:
        raise StageFailed(f"loaded tensors differ ({', '.join(problems)}): max abs diff {r['max_abs_diff']}, "
                          f"{r['converted_max_abs_diff']} (converted)")
    return {**r, "summary": f"{r['backend']}: {r['tensors']} tensors saved and loaded equal "
                            f"({r['optimizer_tensors']} of them optimizer state), converted checkpoint equal; "
                            f"save {r['save_s']:.2f} s, load {r['load_s']:.2f} s"}


def _device_line(text: str) -> str | None:
    """What the ``device: ...`` line of a moeflow command says (its first line names the device)."""
    m = re.search(r"^device: (.+)$", text, re.M)
    return m[1].strip() if m else None


def _rates(stderr: str) -> dict:
    found = {}
    for phase in ("prefill", "decode"):
        m = re.search(rf"{phase}: (\d+) tokens in [\d.]+ s \(([\d,]+) tokens/s\)", stderr)
        if m:
            found[f"{phase}_tokens"], found[f"{phase}_tokens_per_s"] = int(m[1]), float(m[2].replace(",", ""))
    return found


def stage_generate(ctx: Context, timeout_s: float) -> dict:
    run = _needs_run(ctx)
    prompts = ctx.out / "prompts.txt"
    prompts.write_text("ROMEO.\nJULIET.\nTo be, or not to be\nHAMLET.\n")
    new = "16" if ctx.tiny else "128"
    common = ["-m", "moeflow", "generate", str(run), "--device", ctx.device, "--max-new-tokens", new]
    t_end = time.monotonic() + timeout_s
    sampled = run_command(ctx, "generate", _python(*common, "--prompts-file", str(prompts), "--batch-size", "4",
                                                     "--temperature", "0.8", "--sample-top-k", "20", "--top-p", "0.9",
                                                     "--seed", "1"), timeout_s)
    greedy = run_command(ctx, "generate", _python(*common, "--temperature", "0"), t_end - time.monotonic())
    texts = [t for t in re.split(r"^### prompt \d+\n", sampled.stdout, flags=re.M) if t.strip()]
    if len(texts) != 4 or not greedy.stdout.strip():
        raise StageFailed(f"expected 4 sampled completions and a greedy one, got {len(texts)} and "
                          f"{len(greedy.stdout.strip())} characters")
    figures = {"device": _device_line(sampled.stderr), "sampled": _rates(sampled.stderr),
               "greedy": _rates(greedy.stderr), "greedy_text": greedy.stdout[:200]}
    s, g = figures["sampled"], figures["greedy"]
    return {**figures, "summary": f"on {figures['device']}: sampled 4 prompts x {new} tokens, decode "
                                  f"{s.get('decode_tokens_per_s', 0):,.0f} tokens/s; greedy, decode "
                                  f"{g.get('decode_tokens_per_s', 0):,.0f} tokens/s"}


# issue 27's GPU model and workload (the tiny smoke shapes: a 2-layer model, 8-token prompts)
DECODE_FLAGS = ["--dim", "1024", "--layers", "8", "--heads", "16", "--kv-heads", "8", "--experts", "8", "--top-k", "2",
                "--hidden", "1408", "--vocab", "32000", "--prompt-len", "128", "--new-tokens", "128",
                "--batch-sizes", "1,16", "--dtype", "bfloat16", "--repeats", "3"]
DECODE_TINY_FLAGS = ["--dim", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--experts", "4", "--top-k", "2",
                     "--hidden", "96", "--vocab", "256", "--prompt-len", "8", "--new-tokens", "12", "--batch-sizes", "2",
                     "--repeats", "1", "--threads", "1", "--hf-static", "on"]


def stage_decode(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "decode.json"
    path.unlink(missing_ok=True)
    argv = _python("-m", "bench.generate", *(DECODE_TINY_FLAGS if ctx.tiny else DECODE_FLAGS),
                   "--hf-experts", "grouped_mm", "--layer-tokens", "", "--device", ctx.device, "--json", str(path))
    run_command(ctx, "decode", argv, timeout_s)
    rows = json.loads(path.read_text())["results"]
    figures: dict = {"rows": rows}
    parts = []
    for B in sorted({r["batch"] for r in rows}):
        by = {r["candidate"]: r for r in rows if r["batch"] == B}
        compiled = by.get("moeflow:compiled", by["moeflow"])
        base = by.get("hf:grouped_mm")
        static = by.get("hf:static")
        wrong = [name for name, r in by.items() if r["tokens_vs_moeflow"] != "identical"]
        line = f"B={B}: compiled {compiled['decode_tok_s']:,.0f} tok/s"
        if base:
            line += f", {compiled['decode_tok_s'] / base['decode_tok_s']:.2f}x transformers"
        if static:
            line += f", {compiled['decode_tok_s'] / static['decode_tok_s']:.2f}x its static compiled"
        line += f", {compiled['decode_tok_s'] / by['moeflow']['decode_tok_s']:.2f}x eager"
        if wrong:
            line += f" (tokens differ: {', '.join(wrong)})"
        parts.append(line)
        figures[f"batch_{B}"] = {name: r["decode_tok_s"] for name, r in by.items()}
    return {**figures, "summary": "; ".join(parts)}


def stage_infer(ctx: Context, timeout_s: float) -> dict:
    run = _needs_run(ctx)
    path = ctx.out / "infer.json"
    path.unlink(missing_ok=True)
    tier = ctx.out / "tier"
    shutil.rmtree(tier, ignore_errors=True)
    tier.mkdir(parents=True)
    new = "4" if ctx.tiny else "16"
    run_command(ctx, "infer", _python("-m", "moeflow", "infer", str(run), "--offload", "disk", "--device", ctx.device,
                                      "--fast-memory", "8MB", "--dir", str(tier), "--new-tokens", new, "--compare",
                                      "--json", str(path)), timeout_s)
    shutil.rmtree(tier, ignore_errors=True)
    r = json.loads(path.read_text())
    stats = r["stats"]
    figures = {"identical": r.get("identical"), "layout": r.get("layout"), "prefill_s": r["prefill_s"],
               "decode_s": r["decode_s"], "in_memory_decode_s": r.get("in_memory_decode_s"),
               "bytes_from_disk": stats["bytes_from_disk"], "hit_rate": stats["hit_rate"], "stall_s": stats["stall_s"]}
    if figures["identical"] is not True:
        raise StageFailed(f"the offloaded model's tokens differ from the in-memory model's ({r.get('identical')!r})")
    return {**figures, "summary": f"{r['layout']}: {stats['bytes_from_disk'] / 2**20:.1f} MiB from disk, hit rate "
                                  f"{stats['hit_rate']:.0%}, decode {r['decode_s'] * 1e3:.0f} ms "
                                  f"(in memory {figures['in_memory_decode_s'] * 1e3:.0f} ms), same tokens"}


def stage_overlap(ctx: Context, timeout_s: float) -> dict:
    path = ctx.out / "overlap.json"
    path.unlink(missing_ok=True)
    argv = _python("-m", "bench.gpu_overlap", "--json", str(path), "--trace-dir", str(ctx.out / "traces"),
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


def stage_profile(ctx: Context, timeout_s: float) -> dict:
    r = _worker(ctx, "profile", "profile", timeout_s)
    ctx.printed.append(r["table"])
    shares = ", ".join(f"{row['stage']} {row['share']:.0%}" for row in r["rows"] if row["share"] >= 0.005)
    return {**{k: v for k, v in r.items() if k != "table"},
            "summary": f"{r['shape']} fwd+bwd {r['total_ms']:.2f} ms of {r['unit']} time: {shares}"}


STAGES = [
    Stage("gpu-tests", stage_gpu_tests, 200, 90),
    Stage("kernels", stage_kernels, 100, 90),
    Stage("hf-layer", stage_hf_layer, 80, 90),
    Stage("train", stage_train, 60, 90, "run"),
    Stage("resume", stage_resume, 45, 90, "run"),
    Stage("dcp", stage_dcp, 45, 90, "run"),
    Stage("generate", stage_generate, 40, 90, "run"),
    Stage("infer", stage_infer, 30, 90, "run"),
    Stage("decode", stage_decode, 240, 150),
    Stage("overlap", stage_overlap, 45, 90),
    Stage("profile", stage_profile, 40, 90),
]


def run_stages(stages: list[Stage], ctx: Context, budget_s: float, *, jobs: int = 1,
               progress: Callable[[str], None] = print, min_stage_s: float = 5.0,
               reserve_s: float = 20.0) -> list[dict]:
    """Run each stage with ``min(its timeout, what is left of the budget less reserve_s for each
    stage after it)`` (so a slow stage cannot starve all the later ones); a stage that raises is
    recorded (``StageSkipped`` -> skipped, anything else -> FAILED) and the next one runs. A stage
    allowed under ``min_stage_s`` is skipped. ``jobs=2`` runs the two chains (``Stage.chain``) at
    once, each in its order (the reserve counts the later stages of the same chain); the results
    keep the stages' order."""
    deadline = time.monotonic() + budget_s
    lock = threading.Lock()
    finished = [0]

    def later(stage: Stage) -> list[Stage]:
        after = stages[stages.index(stage) + 1:]
        return after if jobs == 1 else [s for s in after if s.chain == stage.chain]

    def one(stage: Stage) -> dict:
        timeout = stage.tiny_timeout_s if ctx.tiny else stage.timeout_s
        left = deadline - time.monotonic()
        allowed = min(timeout, left - reserve_s * len(later(stage)))
        t0 = time.monotonic()
        rec = {"name": stage.name, "status": "ok", "reason": None, "seconds": 0.0, "timeout_s": round(allowed, 1),
               "summary": "", "figures": {}, "log": str(ctx.out / "logs" / f"{stage.name}.log")}
        try:
            if allowed < min_stage_s:
                raise StageSkipped(f"time budget spent ({budget_s:.0f} s, {reserve_s:.0f} s kept for each later "
                                   "stage)")
            figures = stage.run(ctx, allowed)
            rec["summary"] = figures.pop("summary", "")
            rec["figures"] = figures
        except StageSkipped as why:
            rec["status"], rec["reason"] = "skipped", str(why)
        except Exception as err:  # noqa: BLE001 - every failure is recorded, the next stage runs
            rec["status"] = "FAILED"
            rec["reason"] = str(err) if isinstance(err, StageFailed) else f"{type(err).__name__}: {err}"
        rec["seconds"] = round(time.monotonic() - t0, 1)
        if not Path(rec["log"]).exists():
            rec["log"] = None
        note = rec["summary"] if rec["status"] == "ok" else rec["reason"].splitlines()[0]
        with lock:
            finished[0] += 1
            progress(f"[{finished[0]}/{len(stages)}] {stage.name}: {rec['status']} ({rec['seconds']:.1f} s) "
                     f"{note[:160]}")
        return rec

    if jobs == 1:
        return [one(stage) for stage in stages]
    chains: dict[str, list[Stage]] = {}
    for stage in stages:
        chains.setdefault(stage.chain, []).append(stage)
    with ThreadPoolExecutor(max_workers=min(jobs, len(chains))) as pool:
        ran = [pool.submit(lambda chain=chain: [one(s) for s in chain]) for chain in chains.values()]
        by_name = {rec["name"]: rec for future in ran for rec in future.result()}
    return [by_name[stage.name] for stage in stages]


def summary_table(results: list[dict], width: int = 120) -> str:
    """The one summary table: stage, status, seconds, key figures (or the reason)."""
    lines = [f"{'stage':<10} {'status':<8} {'s':>6}  key figures", "-" * width]
    for r in results:
        text = r["summary"] if r["status"] == "ok" else (r["reason"] or "")
        chunks = textwrap.wrap(" ".join(text.split()), width - 28, max_lines=5) or [""]
        lines.append(f"{r['name']:<10} {r['status']:<8} {r['seconds']:>6.1f}  {chunks[0]}")
        lines += [f"{'':<28}{c}" for c in chunks[1:]]
    return "\n".join(lines)


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    smi = shutil.which("nvidia-smi")  # (no CUDA context in this process: the stages need the memory)
    if smi:
        try:
            done = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=10)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "CUDA device"


# --------------------------------------------------------------------------- workers (run in subprocesses)


def _sync(device) -> None:  # type: ignore[no-untyped-def]
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def moe_from_hf_block(block, kind: str, backend: str):  # type: ignore[no-untyped-def]
    """A ``moeflow.MoE`` computing what the HF ``block`` (``bench.hf.make_block``) computes,
    with copies of its tensors: Mixtral (softmax top-2, renormalised; router logits in the model
    dtype, as transformers computes them) or DeepSeek-V3 (sigmoid, group-limited top-6 with the
    score-correction bias as the selection bias, routed scaling, one shared expert). No balance
    loss (the HF block computes none)."""
    import torch

    import moeflow
    from moeflow import ExpertsConfig, MoEConfig, RouterConfig

    experts = block.experts
    w = experts.gate_up_proj  # [E, 2H, D]
    E, D, h = w.shape[0], w.shape[2], w.shape[1] // 2
    kw = dict(device=w.device, dtype=w.dtype)
    if kind == "mixtral":
        router = RouterConfig(scoring="topk_softmax", load_balance_coef=0.0, dtype=w.dtype)
        top_k = getattr(block, "top_k", None) or block.gate.top_k
        cfg = MoEConfig(dim=D, hidden=h, num_experts=E, top_k=top_k, capacity_factor=0.0, router=router,
                        experts=ExpertsConfig(backend=backend, activation="swiglu"))
    else:
        hf_cfg = block.config
        router = RouterConfig(scoring="sigmoid", normalize_topk=bool(hf_cfg.norm_topk_prob),
                              routed_scaling_factor=float(hf_cfg.routed_scaling_factor), num_groups=hf_cfg.n_group,
                              topk_groups=hf_cfg.topk_group, group_score="top2_sum", load_balance_coef=0.0,
                              bias_update_rate=1e-3)  # (> 0: the bias is used for selection; no update is called)
        shared_h = block.shared_experts.gate_proj.weight.shape[0]
        cfg = MoEConfig(dim=D, hidden=h, num_experts=E, top_k=hf_cfg.num_experts_per_tok, capacity_factor=0.0,
                        router=router, experts=ExpertsConfig(backend=backend, activation="swiglu"),
                        num_shared_experts=1, shared_hidden=shared_h)
    layer = moeflow.MoE(config=cfg, **kw)
    with torch.no_grad():
        layer.router.linear.weight.copy_(block.gate.weight)
        layer.experts.w_in.copy_(experts.gate_up_proj.transpose(1, 2))  # [E, D, 2H]: gate columns, then up
        layer.experts.w_out.copy_(experts.down_proj.transpose(1, 2))  # [E, H, D]
        if kind != "mixtral":
            layer.router.expert_bias.copy_(block.gate.e_score_correction_bias)
            s = block.shared_experts
            layer.shared.proj_in.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            layer.shared.proj_out.weight.copy_(s.down_proj.weight)
    return layer


def scattermoe_from_layer(layer):  # type: ignore[no-untyped-def]
    """ScatterMoE's ``GLUMLP`` (``scattermoe.mlp``, Triton) holding copies of the moeflow layer's
    expert weights, and a forward ``x -> y`` that routes with the layer's router (the same
    routing as the layer's rows) and adds the layer's shared expert: the whole layer with
    ScatterMoE's experts, a peer of the same weights. Its ``experts`` weight is ``[E, 2H, D]``
    with the multiplied half first and the activated (gate) half second; moeflow's ``w_in`` is
    ``[E, D, 2H]``, gate columns first."""
    import torch
    from scattermoe.mlp import GLUMLP

    E, D, h2 = layer.experts.w_in.shape
    h = h2 // 2
    w = layer.experts.w_in
    smoe = GLUMLP(D, h, E, layer.config.top_k, activation=torch.nn.SiLU()).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        w_in = w.transpose(1, 2)  # [E, 2H, D]: gate rows, then up rows
        smoe.experts.weight.copy_(torch.cat([w_in[:, h:], w_in[:, :h]], dim=1))
        smoe.output_experts.weight.copy_(layer.experts.w_out.transpose(1, 2))  # [E, D, H]

    def forward(x):  # type: ignore[no-untyped-def]
        x_TD = x.reshape(-1, D)
        routing = layer.router(x_TD, top_k=layer.config.top_k)
        y_TD = smoe(x_TD, routing.weights_TK.to(x.dtype), routing.ids_TK)
        if layer.shared is not None:
            y_TD = y_TD + layer.shared(x_TD)
        return y_TD.view(x.shape)

    params = [*smoe.parameters(), *layer.router.parameters(), *(layer.shared.parameters() if layer.shared else [])]
    return forward, params


# (kind, T, D, H): Mixtral-like, the same block at T=2048, DeepSeek-like (H: the routed experts' hidden)
HF_SHAPES = [("mixtral", 16384, 4096, 14336), ("mixtral", 2048, 4096, 14336), ("deepseek_v3", 16384, 2048, 1408)]
HF_TINY_SHAPES = [("mixtral", 64, 32, 64), ("mixtral", 16, 32, 64), ("deepseek_v3", 64, 32, 16)]
HF_MAX_REL_ERR = 0.05  # the same model: bf16 rounding only (a routing flip on a near-tie moves a few tokens)


def worker_hf(args: argparse.Namespace) -> dict:
    """Stage hf-layer: every shape, transformers' grouped_mm block vs the moeflow layer."""
    import torch

    from bench import hf
    from moeflow.kernels.grouped_mm import resolve_grouped_mm_backend

    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    warmup, repeats = (0, args.repeats or 1) if args.tiny else (2, args.repeats or 5)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
    rows = []
    blocks: dict[tuple, object] = {}
    # ScatterMoE (not on PyPI: a checkout or wheel of github.com/shawntan/scattermoe carried to
    # the machine) runs Triton kernels: on CUDA only here (under the interpreter on CPU it takes
    # seconds a call; checked that way once, its output 1.6e-7 from transformers' in fp32)
    import importlib.util

    scattermoe_runs = importlib.util.find_spec("scattermoe") is not None and device.type == "cuda"
    for kind, T, D, H in HF_TINY_SHAPES if args.tiny else HF_SHAPES:
        key = (kind, D, H)
        if key not in blocks:  # the T=2048 row reuses the Mixtral-like block
            blocks.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(0)
            with torch.device(device):
                container, _, _, _ = hf.make_block(kind, argparse.Namespace(
                    dim=D, hidden=H if kind == "mixtral" else 4 * H))
            block = container["mlp"].to(dtype)
            block.experts.config._experts_implementation = "grouped_mm"
            blocks[key] = (block, moe_from_hf_block(block, kind, "auto"))
        block, layer = blocks[key]
        block.train()
        layer.train()
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
        g = torch.randn(1, T, D, device=device, dtype=dtype, generator=gen)
        xg = x.detach().clone().requires_grad_(True)
        backends = {"moeflow auto": "auto", "moeflow grouped_mm": "grouped_mm", "moeflow triton": "triton"}
        if device.type == "cpu":  # (the interpreter takes seconds a call; the kernels stage runs it)
            del backends["moeflow triton"]
        configs = {name: dataclasses.replace(layer.experts.config, backend=b) for name, b in backends.items()}
        peers = {}
        if scattermoe_runs:  # ScatterMoE's experts in the same layer: the peer issue 30 names
            layer.experts.config = configs["moeflow grouped_mm"]
            peers["scattermoe"] = scattermoe_from_layer(layer)

        def call(name: str, inp):  # type: ignore[no-untyped-def]
            if name == "transformers grouped_mm":
                return block(inp)
            if name in peers:
                return peers[name][0](inp)
            layer.experts.config = configs[name]  # the same layer (same weights), another experts backend
            return layer(inp)

        names = ["transformers grouped_mm", *backends, *peers]
        params = {n: [xg, *(block if n.startswith("transformers") else layer).parameters()] for n in names}
        params.update({n: [xg, *peer_params] for n, (_, peer_params) in peers.items()})

        def fwd(name: str) -> None:
            with torch.no_grad():
                call(name, x)
            sync()

        def fwd_bwd(name: str) -> None:
            torch.autograd.grad(call(name, xg), params[name], g, allow_unused=True)
            sync()

        row = {"shape": f"{kind} T={T} D={D} H={H} E={layer.config.num_experts} K={layer.config.top_k}",
               "auto_backend": resolve_grouped_mm_backend("auto", device, dtype, (D, 2 * H, H)), "impl": {}}
        with torch.no_grad():
            ref = call("transformers grouped_mm", x).float()
            errs = {n: float((call(n, x).float() - ref).norm() / ref.norm()) for n in [*backends, *peers]}
        f_ms = hf.interleaved_times_ms({n: (lambda n=n: fwd(n)) for n in names}, warmup, repeats)
        fb_ms = hf.interleaved_times_ms({n: (lambda n=n: fwd_bwd(n)) for n in names}, warmup, repeats)
        hf_fb = fb_ms[names[0]][0]
        for n in names:
            row["impl"][n] = {"fwd_ms": f_ms[n][0], "fwd_bwd_ms": fb_ms[n][0], "fwd_bwd_min_ms": fb_ms[n][1],
                              "hf_over_this": hf_fb / fb_ms[n][0], "rel_err": errs.get(n)}
        rows.append(row)
        del x, g, xg
    lines = [f"moeflow layer vs transformers grouped_mm experts, same weights ({dtype}, median of {repeats}; "
             "x = transformers ms / this ms, > 1 is faster than transformers)",
             f"{'shape':<42} {'impl':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x':>6} {'rel err':>8}"]
    for r in rows:
        for n, m in r["impl"].items():
            err = "" if m["rel_err"] is None else f"{m['rel_err']:.1e}"
            lines.append(f"{r['shape']:<42} {n:<24} {m['fwd_ms']:>9.2f} {m['fwd_bwd_ms']:>11.2f} "
                         f"{m['hf_over_this']:>6.2f} {err:>8}")
    not_run = {} if device.type == "cuda" else {
        "moeflow triton": f"{NO_CUDA}: the Triton interpreter takes seconds a call (the kernels stage runs it)"}
    if not scattermoe_runs:
        not_run["scattermoe"] = ("not installed (github.com/shawntan/scattermoe; not on PyPI)"
                                 if importlib.util.find_spec("scattermoe") is None else NO_CUDA)
    return {"rows": rows, "dtype": str(dtype), "warmup": warmup, "repeats": repeats, "max_rel_err": HF_MAX_REL_ERR,
            "not_run": not_run, "table": "\n".join(lines)}


def worker_dcp(args: argparse.Namespace) -> dict:
    """Stage dcp, one rank under torchrun: DCP save/load (``moeflow.parallel.save_dcp`` /
    ``load_dcp``) of the trained model and optimizer on the device, and the train checkpoint
    converted to DCP and loaded."""
    import torch

    from moeflow.checkpoint import latest_checkpoint
    from moeflow.checkpoint.dcp import moeflow_to_dcp
    from moeflow.parallel import init_distributed, load_dcp, save_dcp, shutdown_distributed
    from moeflow.train import build_from_checkpoint

    cuda = args.device == "cuda"
    init_distributed("nccl" if cuda else "gloo")
    try:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        run = Path(args.run_dir)
        out = Path(args.out_dir) / "dcp"
        shutil.rmtree(out, ignore_errors=True)

        def scrambled():  # type: ignore[no-untyped-def]
            model, _, _ = build_from_checkpoint(run, device=str(device))
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_()
                persistent = set(model.state_dict())
                for name, b in model.named_buffers():
                    if name in persistent:
                        b.zero_()
            return model

        def snapshot(model, opt=None) -> dict:  # type: ignore[no-untyped-def]
            snap = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
            if opt is not None:
                names = {id(p): n for n, p in model.named_parameters()}
                for p, st in opt.state.items():
                    snap.update({f"optim.{names[id(p)]}.{k}": v.detach().clone()
                                 for k, v in st.items() if isinstance(v, torch.Tensor)})
            return snap

        def compare(want: dict, got: dict) -> tuple[bool, float]:
            if want.keys() != got.keys():
                return False, float("inf")
            diff = max((float((a.double() - b.double()).abs().max()) if a.numel() else 0.0)
                       for a, b in zip(want.values(), (got[k] for k in want)))
            return all(torch.equal(a, got[k]) for k, a in want.items()), diff

        model, _, info = build_from_checkpoint(run, device=str(device))
        trained = snapshot(model)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(0)
        V, S = model.config.vocab_size, min(32, model.config.max_seq_len)
        idx = torch.randint(0, V, (2, S + 1), device=device)
        model.loss(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        want = snapshot(model, opt)
        _sync(device)
        t0 = time.perf_counter()
        save_dcp(out / "saved", model, opt)
        save_s = time.perf_counter() - t0
        model2 = scrambled()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        load_dcp(out / "saved", model2, opt2)
        _sync(device)
        load_s = time.perf_counter() - t0
        saved_equal, max_diff = compare(want, snapshot(model2, opt2))
        # the train checkpoint (moeflow's format) converted to DCP without a model, loaded on the device
        ckpt = latest_checkpoint(run / "checkpoints")
        moeflow_to_dcp(ckpt, out / "converted")
        model3 = scrambled()
        load_dcp(out / "converted", model3)
        converted_equal, converted_diff = compare(trained, snapshot(model3))
        n_opt = sum(1 for k in want if k.startswith("optim."))
        return {"backend": "nccl" if cuda else "gloo", "device": str(device), "checkpoint_step": info["step"],
                "tensors": len(want), "optimizer_tensors": n_opt, "saved_equal": saved_equal,
                "max_abs_diff": max_diff, "converted_equal": converted_equal, "converted_max_abs_diff": converted_diff,
                "save_s": save_s, "load_s": load_s, "dcp_dir": str(out)}
    finally:
        shutdown_distributed()


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


WORKERS = {"hf": worker_hf, "profile": worker_profile, "dcp": worker_dcp}


# --------------------------------------------------------------------------- command line


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Stages: " + ", ".join(s.name for s in STAGES) + " (see the module docstring).")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (default: bf16, NCCL, compiled Triton kernels) or cpu (with --tiny: fp32, gloo, the "
                        "Triton interpreter)")
    p.add_argument("--tiny", action="store_true",
                   help="tiny shapes (the smoke run; with --device cuda a quick GPU pass)")
    p.add_argument("--smoke", action="store_true", help="the CPU smoke run: --device cpu --tiny")
    p.add_argument("--json", type=Path, default=None,
                   help="the report (default: bench/results/gpu_check.json on CUDA at full size, else "
                        "report.json in --out-dir)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="logs, traces, the training run and per-stage JSON (default: runs/gpu_check, "
                        "runs/gpu_check_tiny on CUDA with --tiny, runs/gpu_check_smoke)")
    p.add_argument("--stages", default=None, help="comma-separated subset of the stages, in their order (default: all)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run; a stage gets min(its timeout, what is left less 20 s for "
                        "each later stage) (default: 540 on CUDA, 420 for the smoke run)")
    p.add_argument("--jobs", type=int, choices=[1, 2], default=None,
                   help="2: the stages that use the training run and the others at once, in two chains "
                        "(default: 1 on CUDA, where timings and GPU memory need the machine to themselves; 2 "
                        "for the smoke run)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats in the benchmark stages (default: per stage)")
    p.add_argument("--worker", choices=sorted(WORKERS), default=None,
                   help="(internal) run one stage's in-process part and write its JSON to --result")
    p.add_argument("--result", type=Path, default=None, help="(internal, with --worker)")
    p.add_argument("--run-dir", type=Path, default=None, help="(internal, with --worker dcp) the training run")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.tiny = "cpu", True
    if args.device == "cpu" and not args.tiny:
        p.error("--device cpu runs the tiny shapes only: add --tiny (or use --smoke)")
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.budget is not None and args.budget <= 0:
        p.error(f"--budget must be > 0, got {args.budget}")
    if args.worker is not None and args.result is None:
        p.error("--worker needs --result")
    names = [s.name for s in STAGES]
    if args.stages is not None:
        chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in names]
        if unknown or not chosen:
            p.error(f"--stages: unknown {unknown or args.stages!r}; stages are {', '.join(names)}")
        args.stages = chosen
    if args.out_dir is None:
        suffix = "_smoke" if args.device == "cpu" else ("_tiny" if args.tiny else "")
        args.out_dir = REPO / "runs" / f"gpu_check{suffix}"
    if args.json is None:
        full = args.device == "cuda" and not args.tiny
        args.json = REPO / "bench" / "results" / "gpu_check.json" if full else args.out_dir / "report.json"
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.worker is not None:
        result = WORKERS[args.worker](args)
        if int(os.environ.get("RANK", "0")) == 0:
            args.result.parent.mkdir(parents=True, exist_ok=True)
            args.result.write_text(json.dumps(result, indent=1, default=str))
        return 0

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA GPU is visible; the CPU smoke run is --smoke", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.out_dir / "logs", ignore_errors=True)
    stages = [s for s in STAGES if args.stages is None or s.name in args.stages]
    ctx = Context(device=args.device, tiny=args.tiny, out=args.out_dir.resolve(), env=child_env(args.device),
                  repeats=args.repeats, selected=tuple(s.name for s in stages))
    budget = args.budget or (420.0 if args.device == "cpu" else 540.0)
    device_name = _device_name(args.device)
    versions = _versions()
    header = (f"moeflow GPU acceptance run ({ctx.mode}): {device_name}, {ctx.dtype}, torch {versions['torch']}, "
              f"triton {versions['triton']}, transformers {versions['transformers']}")
    print(header, flush=True)
    t0 = time.monotonic()
    jobs = args.jobs or (2 if args.device == "cpu" else 1)
    results = run_stages(stages, ctx, budget, jobs=jobs, progress=lambda line: print(line, flush=True))
    total = time.monotonic() - t0
    report = {
        "format": FORMAT, "mode": ctx.mode, "device": args.device, "device_name": device_name, "dtype": ctx.dtype,
        "versions": versions, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "budget_s": budget, "jobs": jobs, "total_s": round(total, 1), "out_dir": str(ctx.out),
        "ok": all(r["status"] != "FAILED" for r in results), "stages": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")
    for table in ctx.printed:
        print("\n" + table)
    print(f"\n{header}; {total:.0f} s of a {budget:.0f} s budget")
    print(summary_table(results))
    print(f"report: {args.json}; logs and traces: {ctx.out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
