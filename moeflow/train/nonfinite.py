"""A training step whose loss or gradient is not finite (nan, inf): stop, or skip the step.

The loops (``moeflow.train.lm``, ``moeflow.train.vision``) test the step's loss and global
gradient norm *before* the optimizer step, so the weights never take a non-finite update; a
run stops with ``NonFiniteLossError`` (the last checkpoint written is the last good one, and
no checkpoint is written after), or, when the user allowed it (``skip_nonfinite``), drops the
step: no optimizer step, no router-bias update, the gradients zeroed, the step recorded. Under
expert parallelism both numbers are all-reduced before the test, so every rank decides alike
without a collective of its own. ``check_parameters_finite`` guards every save: a finite loss
can still be followed by an update that overflows the weights (a huge learning rate).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from moeflow.checkpoint import PendingSave, latest_checkpoint
from moeflow.parallel.comm import ProcessGroup, all_reduce_sum
from moeflow.train.lm_checkpoint import write_history
from moeflow.train.lm_config import LMTrainConfig

__all__ = ["NonFiniteLossError", "step_is_finite", "check_parameters_finite", "nonfinite_step", "check_weights"]


class NonFiniteLossError(RuntimeError):
    """Training stopped: a step's loss or gradient, or the weights, became non-finite."""


def step_is_finite(loss: float, grad_norm: float) -> bool:
    """Whether a step may update the weights (both numbers the same on every rank)."""
    return math.isfinite(loss) and math.isfinite(grad_norm)


def check_parameters_finite(model: nn.Module, step: int, group: ProcessGroup | None = None) -> None:
    """Raise ``NonFiniteLossError`` (on every rank of ``group`` alike) when any parameter of
    ``model`` holds nan or inf after ``step``: such weights must never become a checkpoint."""
    with torch.no_grad():
        bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p).all())]
        ref = next(model.parameters())
        count = all_reduce_sum(torch.tensor(float(len(bad)), dtype=torch.float64, device=ref.device), group)
        if float(count) > 0:
            where = f" (e.g. {bad[0]})" if bad else " (on another rank)"
            raise NonFiniteLossError(f"the weights became non-finite in step {step}{where}; no checkpoint was written "
                                     "for it (lower --lr, or raise --warmup)")


def nonfinite_step(cfg: LMTrainConfig, history: dict, step: int, loss: float, grad_norm: float,
                   pending: PendingSave | None, rank: int, bar) -> None:  # type: ignore[no-untyped-def]
    """``train_lm``: step ``step``'s loss or gradient norm is not finite. Record it in
    ``history["skipped"]`` (as strings: history.json stays strict JSON) and return (the caller
    skips the step) while ``cfg.skip_nonfinite`` allows; else finish the background save in
    flight (``pending``: it holds the last good weights), write the history (rank 0) and raise
    ``NonFiniteLossError`` naming the step and the last good checkpoint, on every rank alike."""
    skipped = history.setdefault("skipped", [])
    skipped.append([step, str(loss), str(grad_norm)])
    if len(skipped) <= cfg.skip_nonfinite:
        if bar is not None:
            bar.write(f"step {step}: loss {loss}, gradient norm {grad_norm}: step skipped "
                      f"({len(skipped)} of --skip-nonfinite {cfg.skip_nonfinite})")
        return
    if pending is not None:
        pending.finish()
    if bar is not None:
        bar.close()
    if rank == 0:
        write_history(cfg.out_dir, history)
    latest = latest_checkpoint(cfg.out_dir / "checkpoints")
    kept = (f"the latest checkpoint, {latest}, is the last good one (continue from it with --resume and a lower --lr)"
            if latest is not None else "no checkpoint was written (--checkpoint-every N keeps good ones)")
    allowed = (f" after skipping {cfg.skip_nonfinite} such step(s)" if cfg.skip_nonfinite
               else " (--skip-nonfinite N skips up to N such steps instead)")
    raise NonFiniteLossError(f"training stopped at step {step}: the loss is {loss} and the gradient norm {grad_norm}"
                             f"{allowed}; the weights were not updated; {kept}")


def check_weights(model: nn.Module, step: int, group: ProcessGroup | None, pending: PendingSave | None) -> None:
    """``train_lm``, before a save: weights with nan/inf stop the run
    (``check_parameters_finite``), once the background save in flight is complete."""
    try:
        check_parameters_finite(model, step, group)
    except NonFiniteLossError:
        if pending is not None:
            pending.finish()
        raise
