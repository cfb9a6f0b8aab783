"""Stages train, resume and dcp, on one training run that later stages (generate, infer) read:

    train   ``python -m torch.distributed.run --standalone --nproc-per-node 1 -m moeflow train``
            (tiny preset, NCCL on CUDA, gloo on CPU): a checkpoint. Should it fail, a
            single-process ``moeflow train`` gives the later stages a checkpoint (the stage
            still reports FAILED, naming it)
    resume  the same run with ``--resume`` and more steps: continues from that checkpoint
    dcp     in a 1-rank process group under torchrun (``worker_dcp``): the trained model (one
            more optimizer step) saved with ``torch.distributed.checkpoint`` through
            ``moeflow.parallel.save_dcp``, loaded (``load_dcp``) into a scrambled copy and
            compared tensor by tensor (parameters, buffers, optimizer state); and the train
            checkpoint converted with ``moeflow.checkpoint.dcp.moeflow_to_dcp``, loaded the same way
            and compared
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

from bench.gpu_check.runner import Context, StageFailed, StageSkipped, python, run_command, torchrun

__all__ = ["stage_train", "stage_resume", "stage_dcp", "worker_dcp", "needs_run", "device_line"]


def _train_sizes(ctx: Context) -> dict:
    if ctx.tiny:
        return dict(steps=4, more=6, every=2, batch=4, seq=32, eval_batches=1)
    return dict(steps=30, more=40, every=10, batch=16, seq=128, eval_batches=2)


def _train_argv(ctx: Context, run: Path, steps: int, *extra: str, distributed: bool = True) -> list[str]:
    s = _train_sizes(ctx)
    args = ["-m", "moeflow", "train", "--device", ctx.device, "--preset", "tiny", "--steps", str(steps),
            "--checkpoint-every", str(s["every"]), "--batch-size", str(s["batch"]), "--seq-len", str(s["seq"]),
            "--eval-every", "0", "--eval-batches", str(s["eval_batches"]), "--sample-tokens", "0", "--no-plot",
            "--no-progress", "--out", str(run), *extra]
    return torchrun(*args) if distributed else python(*args)


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
            run_command(ctx, "train", _train_argv(ctx, single, steps, "--overwrite", distributed=False),
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
    figures = {"device": device_line(done.stdout + done.stderr), "steps": steps, "checkpoint_step": step,
               "train_loss": hist["train_loss"][-1], "val_before": v0,
               "val_after": v1, "tokens_per_s": hist.get("tokens_per_s"), "world_size": hist.get("world_size")}
    return {**figures, "summary": f"on {figures['device']}: {steps} steps, val loss {v0:.3f} -> {v1:.3f}, "
                                  f"{figures['tokens_per_s'] or 0:,.0f} tokens/s, checkpoint step {step}"}


def device_line(text: str) -> str | None:
    """What the ``device: ...`` line of a moeflow command says (its first line names the device)."""
    m = re.search(r"^device: (.+)$", text, re.M)
    return m[1].strip() if m else None


def needs_run(ctx: Context) -> Path:
    """The training run of the train stage; without the train stage in this invocation
    (``--stages generate``, say), the one an earlier invocation left in ``--out-dir``."""
    run = ctx.state.get("run")
    if run is None and "train" not in ctx.selected and _latest_step(ctx.out / "run") is not None:
        run = ctx.state["run"] = ctx.out / "run"
    if run is None:
        raise StageSkipped("needs the train stage's checkpoint (that stage did not run or failed)")
    return run


def stage_resume(ctx: Context, timeout_s: float) -> dict:
    run = needs_run(ctx)
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
    run = needs_run(ctx)
    path = ctx.out / "dcp.json"
    path.unlink(missing_ok=True)
    run_command(ctx, "dcp", torchrun("-m", "bench.gpu_check", "--worker", "dcp", "--result", str(path),
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

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

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
        sync()
        t0 = time.perf_counter()
        save_dcp(out / "saved", model, opt)
        save_s = time.perf_counter() - t0
        model2 = scrambled()
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        t0 = time.perf_counter()
        load_dcp(out / "saved", model2, opt2)
        sync()
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
