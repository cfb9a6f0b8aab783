"""Entry point of one rank of ``moeflow train --nproc N`` (started by torchrun):
``python -m moeflow.train.worker CONFIG.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from moeflow.parallel import init_distributed, shutdown_distributed
from moeflow.parallel.heartbeat import Heartbeat
from moeflow.parallel.comm import process_position
from moeflow.train.lm import LMTrainConfig, train_lm


STALL_TIMEOUT_S = 30.0  # a rank whose heartbeat stops this long is reported and the job stopped


def main(argv: list[str]) -> int:
    cfg = LMTrainConfig.from_dict(json.loads(Path(argv[0]).read_text()))
    init_distributed(timeout_s=300)
    rank, _ = process_position()
    if rank != 0:  # one progress bar and one plot
        cfg = LMTrainConfig.from_dict({**cfg.to_dict(), "progress": False, "plot": False})
    try:
        with Heartbeat(timeout_s=STALL_TIMEOUT_S):  # a stopped rank is named in seconds, not after the collective timeout
            train_lm(cfg)
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
