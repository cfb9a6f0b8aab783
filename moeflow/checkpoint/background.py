"""Asynchronous checkpoints: the files are written beside the next training steps.

``save_checkpoint_async`` does the synchronous part of a save (rank 0's verdict on the root,
the collectives that assemble each rank's experts and vocabulary shards, host copies of the
buffers and RNG states) and returns. A background thread then copies the parameters and the
optimizer state to host memory (*staging*), writes, indexes and publishes the checkpoint
exactly as ``save_checkpoint`` does.

Parameters and optimizer state only change in an optimizer step, so staging runs beside the
next forward and backward: the optimizer passed in gets a one-shot pre-step hook that waits
for staging to finish (the only stall a save costs beyond its synchronous part). Without an
optimizer, everything is staged before the call returns. The ranks coordinate the completion
over a gloo group of their own (``moeflow.parallel.comm.side_group``), so the background
collectives never interleave with the training's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moeflow.checkpoint.io import _PENDING, _snapshot, _wait_pending, _write
from moeflow.parallel.comm import ProcessGroup, side_group

__all__ = ["save_checkpoint_async", "PendingSave"]


class PendingSave:
    """A checkpoint being written in the background (``save_checkpoint_async``)."""

    def __init__(self, path: Path, write: Callable[[Callable[[], None]], Path]) -> None:
        self.path = path  # where the checkpoint will be, once complete
        self._staged = threading.Event()
        self._future: Future[Path] = Future()
        self._hook: RemovableHandle | None = None  # the optimizer's wait for staging
        self.waited_s = 0.0  # time the caller spent in ``wait_staged`` (part of what the save cost it)
        self._error_seen = False  # wait() has raised the write's error to the caller

        def run() -> None:
            _lower_priority()
            try:
                self._future.set_result(write(self._staged.set))
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                self._staged.set()
                self._future.set_exception(err)

        self._thread = threading.Thread(target=run, name=f"moeflow-save-{path.name}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._future.done()

    def wait_staged(self) -> None:
        """Return once the saved state is in host memory: the live parameters and optimizer
        state may change from then on."""
        t0 = time.perf_counter()
        self._staged.wait()
        self.waited_s += time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> Path:
        """The checkpoint directory once it is complete; re-raises the write's error."""
        try:
            return self._future.result(timeout)
        except Exception:
            self._error_seen = self._future.done()
            raise

    def finish(self) -> Path | None:
        """Wait, then drop the optimizer hook (the next save of the root calls this). A failed
        write raises here unless ``wait()`` already raised it to the caller."""
        try:
            return self.wait()
        except Exception:
            if not self._error_seen:
                raise
            return None
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None


def save_checkpoint_async(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict | None = None,
    group: ProcessGroup | None = None,
    keep: int = 3,
) -> PendingSave:
    """``save_checkpoint`` whose writing runs in the background (see module docstring); same
    arguments, same checkpoint. Every rank of the whole job calls it (``group`` None or a group
    of every rank).

    Returns a ``PendingSave``: ``wait()`` gives the checkpoint directory or raises what the
    write raised (every rank raises if any rank's write failed). The next ``optimizer.step()``
    waits until the state is staged; change the parameters otherwise only after
    ``wait_staged()``. A later save under the same ``root`` (either kind) first waits for this
    one, so the saves of a root complete in order. Until the background write publishes the
    index, the previous checkpoint stays the latest: a crash loses this save, never an older one.
    """
    root = Path(root)
    _wait_pending(root)
    side = side_group(group)  # (made on first use: a collective of every rank, here, in step)
    snapshot = _snapshot(root, step, model, optimizer, extra=extra, group=group, keep=keep, stage=optimizer is None)
    pending = PendingSave(snapshot.final, lambda staged: _write(snapshot, side, staged))
    _PENDING[root.resolve()] = pending
    if optimizer is not None:  # (removed when the save is finished: removing a hook from inside it is not allowed)
        pending._hook = optimizer.register_step_pre_hook(lambda *_: pending.wait_staged())
    return pending


def _lower_priority() -> None:
    """Run the writing thread at the lowest CPU priority where the OS allows one per thread
    (Linux): it should take the cores' idle time, not the training's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # another OS: the thread keeps the process's priority
        pass
