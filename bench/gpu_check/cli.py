"""The GPU check's command line: the stages in their order (``STAGES``), the in-process
workers (``WORKERS``), the flags and ``main`` (``python -m bench.gpu_check``; the package's
docstring says what each stage does)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time
from pathlib import Path

from bench.common import REPO
from bench.gpu_check.decode_bw import stage_decode_bw
from bench.gpu_check.families import stage_families
from bench.gpu_check.fp8 import stage_fp8
from bench.gpu_check.generation import stage_decode, stage_generate
from bench.gpu_check.gpu_tests import stage_gpu_tests
from bench.gpu_check.hf_layer import stage_hf_layer, worker_hf
from bench.gpu_check.infer import stage_infer
from bench.gpu_check.kernels import stage_kernels
from bench.gpu_check.overlap import stage_overlap
from bench.gpu_check.profiling import stage_profile, worker_profile
from bench.gpu_check.runner import (FORMAT, Context, Stage, child_env, device_name, run_stages, summary_table,
                                    versions)
from bench.gpu_check.serve import stage_serve
from bench.gpu_check.training import stage_dcp, stage_resume, stage_train, worker_dcp

__all__ = ["STAGES", "WORKERS", "DESCRIPTION", "main"]

DESCRIPTION = "The GPU acceptance run: one command that shows what moeflow does on a CUDA machine."

# (name, run, timeout on CUDA at full shapes, timeout at tiny shapes, chain)
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
    Stage("decode-bw", stage_decode_bw, 300, 200),
    Stage("fp8", stage_fp8, 90, 90),
    Stage("overlap", stage_overlap, 75, 90),
    Stage("profile", stage_profile, 40, 90),
    # before families (which takes what the others leave); beside other stages it runs a reduced
    # run or is skipped, alone the full levels (the stage's docstring)
    Stage("serve", stage_serve, 520, 90),
    # last: on CUDA it takes what the others left (alone, nearly the whole budget: the stage's
    # docstring). In the training run's chain though it does not read the run: with the smoke's
    # two jobs that chain is the shorter one
    Stage("families", stage_families, 520, 120, "run"),
]

WORKERS = {"hf": worker_hf, "profile": worker_profile, "dcp": worker_dcp}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=DESCRIPTION,
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
    name = device_name(args.device)
    found = versions()
    header = (f"moeflow GPU acceptance run ({ctx.mode}): {name}, {ctx.dtype}, torch {found['torch']}, "
              f"triton {found['triton']}, transformers {found['transformers']}")
    print(header, flush=True)
    t0 = time.monotonic()
    jobs = args.jobs or (2 if args.device == "cpu" else 1)
    results = run_stages(stages, ctx, budget, jobs=jobs, progress=lambda line: print(line, flush=True))
    total = time.monotonic() - t0
    report = {
        "format": FORMAT, "mode": ctx.mode, "device": args.device, "device_name": name, "dtype": ctx.dtype,
        "versions": found, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
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

