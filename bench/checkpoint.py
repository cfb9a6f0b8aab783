"""Benchmark: how long a checkpoint save stops training, synchronous against asynchronous.

One process trains the demo model (the ``tiny`` preset, byte vocabulary, AdamW) for ``steps``
steps three ways, interleaved ``repeats`` times: without saves, with ``save_checkpoint`` every
``every`` steps, and with ``save_checkpoint_async`` every ``every`` steps (its pending save
finished by the next save, as a training loop does). Two figures per save:

- *blocked*: how long the save stops the training loop: the save call, plus (asynchronous) the
  next optimizer step's wait for staging;
- *slowdown*: the extra time of a run with saves over the run without, divided by its number of
  saves; for the asynchronous save it also counts what the background write takes from the
  training when both share the same cores (on this 2-core CPU they do; on a GPU node the
  training leaves the cores to the writer).

Medians over the repeats; run with ``python -m bench.checkpoint``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moeflow.checkpoint import save_checkpoint, save_checkpoint_async
from moeflow.models import MoEGPT, gpt_config

__all__ = ["run", "main"]


def _train(model: MoEGPT, opt: torch.optim.Optimizer, steps: int, batch: int, seq: int, mode: str, every: int,
           root: Path, gen: torch.Generator) -> tuple[float, int, list[float]]:
    """Seconds for ``steps`` steps with saves in ``mode`` ("none", "sync", "async"), the number
    of saves, and the time each save call took."""
    pending = None
    saves, calls = 0, []
    t0 = time.perf_counter()
    for step in range(steps):
        x = torch.randint(0, model.config.vocab_size, (batch, seq), generator=gen)
        out = model(x)
        logits = out[0] if isinstance(out, tuple) else out
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if mode != "none" and (step + 1) % every == 0:
            c0 = time.perf_counter()
            if mode == "sync":
                save_checkpoint(root, step + 1, model, opt, keep=2)
            else:
                if pending is not None:
                    calls[-1] += pending.waited_s  # the previous save's wait in opt.step, now complete
                pending = save_checkpoint_async(root, step + 1, model, opt, keep=2)
            calls.append(time.perf_counter() - c0)
            saves += 1
    if pending is not None:
        pending.finish()  # the last write belongs to this run's time
        calls[-1] += pending.waited_s
    return time.perf_counter() - t0, saves, calls


def run(*, steps: int = 24, every: int = 4, batch: int = 16, seq: int = 128, repeats: int = 5, threads: int = 2) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MoEGPT(gpt_config("tiny", vocab_size=256, max_seq_len=seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    _train(model, opt, 2, batch, seq, "none", every, Path(tempfile.mkdtemp()), gen)  # warm-up
    times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
    calls: dict[str, list[float]] = {"sync": [], "async": []}
    saves = steps // every
    for _ in range(repeats):
        for mode in times:
            root = Path(tempfile.mkdtemp(prefix=f"moeflow-ckpt-bench-{mode}-"))
            try:
                seconds, n, call_s = _train(model, opt, steps, batch, seq, mode, every, root, gen)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            times[mode].append(seconds)
            calls.get(mode, []).extend(call_s)
            assert mode == "none" or n == saves
    med = {m: statistics.median(t) for m, t in times.items()}
    stall = {m: (med[m] - med["none"]) / saves for m in ("sync", "async")}
    params = sum(p.numel() for p in model.parameters())
    return {
        "benchmark": "checkpoint_stall",
        "config": dict(steps=steps, every=every, batch=batch, seq=seq, repeats=repeats, threads=threads,
                       model="tiny preset, vocab 256", parameters=params, dtype="float32"),
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d")},
        "run_s": times, "median_run_s": med, "saves_per_run": saves,
        "blocked_per_save_ms": {m: statistics.median(c) * 1e3 for m, c in calls.items()},
        "slowdown_per_save_ms": {m: s * 1e3 for m, s in stall.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("steps", "every", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.every > args.steps:
        p.error(f"--every {args.every} exceeds --steps {args.steps}: no save would run")
    out = run(steps=args.steps, every=args.every, repeats=args.repeats, threads=args.threads)
    print(f"median run of {args.steps} steps: " + ", ".join(f"{m} {s:.3f} s" for m, s in out["median_run_s"].items()))
    blocked, slow = out["blocked_per_save_ms"], out["slowdown_per_save_ms"]
    print(f"training blocked per save (median): sync {blocked['sync']:.1f} ms, async {blocked['async']:.1f} ms "
          f"({blocked['async'] / blocked['sync']:.1%} of sync)")
    print(f"run slowdown per save: sync {slow['sync']:.1f} ms, async {slow['async']:.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
