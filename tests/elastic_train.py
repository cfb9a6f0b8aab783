"""Elastic-resume harness for the tests (run under torchrun): trains the small MoE model of the
multi-rank tests in test_checkpoint, checkpoints every step, resumes from the latest checkpoint
when started again, and can SIGKILL one rank on the first attempt to exercise torchrun's restart
policy."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_checkpoint import STEPS, _setup, _train  # noqa: E402

from moeflow.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from moeflow.parallel import init_distributed  # noqa: E402
from moeflow.parallel.comm import process_position, sync  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--kill-rank-at-step", type=int, default=None, help="first attempt only: rank 1 dies here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    init_distributed(timeout_s=20)
    rank, world = process_position()
    model, opt = _setup(rank, world)
    start, losses = 0, []
    latest = latest_checkpoint(args.root / "ck")
    if latest is not None:
        info = load_checkpoint(latest, model, opt)
        start, losses = info["extra"]["next_step"], info["extra"]["losses"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, 2 * STEPS):
        if attempt == 0 and rank == 1 and step == args.kill_rank_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        losses += _train(model, opt, rank, world, range(step, step + 1))
        save_checkpoint(args.root / "ck", step + 1, model, opt, extra={"next_step": step + 1, "losses": losses}, keep=2)
    if rank == 0:
        (args.root / "losses.json").write_text(json.dumps({"losses": losses, "attempt": attempt}))
    sync()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
