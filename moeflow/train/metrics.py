"""Following a training run while it runs: progress on the console, and every step's metrics in
files that other tools read (rank 0 only; the other ranks log nothing).

- Console: a tqdm bar when ``progress`` is on and stderr is a terminal; otherwise (a log file, a
  pipe, a job scheduler, or ``progress=False``) one plain line every ``every`` steps, so that a
  redirected run is readable and a ``tail -f`` follows it (a ``\\r`` bar would be one long line).
  The validation loss is printed the moment it is known, the one before training too.
- ``out_dir/metrics.jsonl``: one JSON object per line. A step's record::

      {"step": 12, "loss": 3.21, "lr": 0.0012, "grad_norm": 0.83, "aux_loss": 0.0104,
       "tokens_per_s": 4312.0, "time_s": 5.9, "max_load": 1.52}

  ``step`` counts finished optimizer steps (1 = after the first); ``loss`` is the task loss
  (cross-entropy, mean over the global batch) and ``aux_loss`` the routers' balance losses, both
  before the step's update; ``grad_norm`` the global norm before clipping; ``tokens_per_s`` this
  step's throughput and ``time_s`` the seconds since the run (or this resumption) started.
  ``max_load`` (the busiest expert's share of its layer's assignments over the even share
  ``1/E``, mean over the MoE layers; 1.0 = balanced) is in the records of the steps where the
  load is gathered (every ``every`` steps, over the steps since the previous). A validation
  gives its own record ``{"step": s, "val_loss": v}`` (step 0: before training). A skipped
  (non-finite) step has no record. A resumed run first cuts the file back to its checkpoint's
  step, so the file always describes one trajectory; a new run starts it afresh.
- TensorBoard (``tensorboard=True``; needs the ``tensorboard`` package, ``moeflow[tensorboard]``):
  the same scalars under ``out_dir/tensorboard``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

__all__ = ["METRICS_FILE", "RunLog", "read_metrics", "tensorboard_missing"]

METRICS_FILE = "metrics.jsonl"


def tensorboard_missing() -> str | None:
    """Why ``tensorboard=True`` cannot work here (None: it can): checked before any work."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - needs the tensorboard package
    except ImportError:
        return "TensorBoard logging needs the tensorboard package: pip install 'moeflow[tensorboard]'"
    return None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (none when it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cut_back(path: Path, step: int) -> None:
    """Keep the records up to ``step`` (a resumed run continues from its checkpoint there)."""
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


class RunLog:
    """Rank 0's log of one run: ``step`` per optimizer step, ``validation`` per evaluation,
    ``write`` for a message, ``close`` at the end (also when the run stops early)."""

    def __init__(self, out_dir: Path, *, start: int, total: int, every: int, progress: bool,
                 tensorboard: bool) -> None:
        self.total, self.every = total, every
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / METRICS_FILE
        if start:
            _cut_back(path, start)
        self._file = path.open("a" if start else "w", buffering=1)  # line-buffered: readable while it runs
        self._bar = None
        if progress and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=start, desc="train", unit="step", mininterval=1.0,
                             dynamic_ncols=True)
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start + 1 if start else None)

    def write(self, text: str) -> None:
        """A message on the console, above the bar when there is one."""
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def _record(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step":
                    self._tb.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", value, record["step"])

    def validation(self, step: int, loss: float) -> None:
        """The validation loss after ``step`` steps (0: before training), printed now."""
        self._record({"step": step, "val_loss": loss})
        when = "before training" if step == 0 else f"step {step}"
        self.write(f"{when}: validation loss {loss:.4f} nats/token (perplexity {math.exp(min(loss, 700)):.2f})")

    def step(self, record: dict) -> None:
        """One finished step's record (see the module docstring); prints a line at the log
        points (the records carrying ``max_load``) when there is no bar."""
        self._record(record)
        if self._bar is not None:
            if "max_load" in record:
                self._bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}",
                                      tok_s=f"{record['window_tokens_per_s']:,.0f}",
                                      max_load=f"{record['max_load']:.2f}x", refresh=False)
            self._bar.update(1)
        elif "max_load" in record:
            self.write(f"step {record['step']}/{self.total}: loss {record['loss']:.4f}, lr {record['lr']:.2e}, "
                       f"{record['window_tokens_per_s']:,.0f} tokens/s, max_load {record['max_load']:.2f}x")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._file.close()
