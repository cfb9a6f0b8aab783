"""What every stage of the GPU check shares: the stage record (``Stage``) and the run's
``Context``, subprocesses with a timeout and a log (``run_command``), the budgeted runner
(``run_stages``), the summary table and the report's format (``FORMAT``, ``REPORT_KEYS``,
``STAGE_KEYS``).

A stage is a function ``(ctx, seconds allowed) -> figures`` (a dict; its ``"summary"`` is the
line the summary table shows) that raises ``StageSkipped`` or ``StageFailed`` to say why it did
not give figures; it runs its work in subprocesses (``run_command``; ``run_worker`` for an
in-process part of this package, ``python -m bench.gpu_check --worker NAME``)."""

from __future__ import annotations

import dataclasses
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.common import REPO
from bench.common import child_env as checkout_env

__all__ = ["FORMAT", "REPORT_KEYS", "STAGE_KEYS", "STATUSES", "NO_CUDA", "StageSkipped", "StageFailed", "Stage",
           "Context", "child_env", "failure_reason", "run_command", "python", "torchrun", "run_worker", "run_stages",
           "summary_table", "versions", "device_name", "tail"]

# /2: the decode stage's figures were rebuilt (issue 46: like-with-like ratios, fp32 token
# equality, bf16 logits against fp32, the memory-bandwidth fraction, compiles counted); the
# report's and the stages' keys are those of /1
FORMAT = "moeflow-gpu-check/2"
REPORT_KEYS = ("format", "mode", "device", "device_name", "dtype", "versions", "date", "budget_s", "jobs", "total_s",
               "out_dir", "ok", "stages")
STAGE_KEYS = ("name", "status", "reason", "seconds", "timeout_s", "summary", "figures", "log")
STATUSES = ("ok", "FAILED", "skipped")
NO_CUDA = "no CUDA here"  # the words a stage skipped for want of a GPU says


class StageSkipped(Exception):
    """A stage that did not run, and why."""


class StageFailed(Exception):
    """A stage that ran and failed, and why (one line, or a few); ``figures``: what it measured
    all the same (kept in the report, as for a stage that passed)."""

    def __init__(self, message: str, figures: dict | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


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
    threads (a tiny decode step slowed down by two orders of magnitude)."""
    env = checkout_env()
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def tail(text: str, lines: int = 6) -> str:
    """The last ``lines`` non-blank lines of ``text``."""
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
    return cause[-1] if cause else tail(text)


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
        raise StageFailed(f"timed out after {timeout_s:.0f} s: {shlex.join(argv[:6])} ...; {tail(err or out, 3)}")
    if proc.returncode != 0:
        raise StageFailed(f"exit status {proc.returncode}: {failure_reason(err or out)}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def python(*args: str) -> list[str]:
    """``args`` run by this interpreter."""
    return [sys.executable, *args]


def torchrun(*args: str) -> list[str]:
    """``args`` under a 1-rank ``torchrun --standalone``."""
    return python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *args)


def run_worker(ctx: Context, stage: str, name: str, timeout_s: float) -> dict:
    """Run ``python -m bench.gpu_check --worker name`` in a subprocess, logged as ``stage``;
    returns the JSON it wrote."""
    result = ctx.out / f"{name}.json"
    result.unlink(missing_ok=True)
    args = ["-m", "bench.gpu_check", "--worker", name, "--result", str(result), "--device", ctx.device,
            "--out-dir", str(ctx.out), *(["--tiny"] if ctx.tiny else []),
            *(["--repeats", str(ctx.repeats)] if ctx.repeats else [])]
    run_command(ctx, stage, python(*args), timeout_s)
    return json.loads(result.read_text())


# --------------------------------------------------------------------------- the run


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
        except StageFailed as err:
            rec["status"], rec["reason"] = "FAILED", str(err)
            rec["figures"] = {k: v for k, v in err.figures.items() if k != "summary"}
        except Exception as err:  # noqa: BLE001 - every failure is recorded, the next stage runs
            rec["status"], rec["reason"] = "FAILED", f"{type(err).__name__}: {err}"
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


def versions() -> dict:
    """The versions of Python, torch, Triton and transformers (None: not installed)."""
    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name(device: str) -> str:
    """The GPU's name (``nvidia-smi``: no CUDA context in this process, the stages need the
    memory), or the CPU's."""
    if device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=10)
            if done.returncode == 0 and done.stdout.strip():
                return done.stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "CUDA device"
