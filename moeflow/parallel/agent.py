"""torchrun's agent as moeflow's one-machine launcher starts it (``run_torchrun``).

``python -m moeflow.parallel.agent ARGS`` is ``python -m torch.distributed.run ARGS`` with two
differences, so that a failed job reads as one line per cause instead of a page: the agent's own
log lines (torch.distributed.elastic's warnings and errors about stopping the other ranks) are
limited to critical ones, and when the ranks fail the agent exits with the first failed rank's
status (128 + the signal for a rank killed by one) instead of raising torchrun's
``ChildFailedError`` with its traceback and summary table. The ranks' own output (a moeflow rank
prints its error as one line) is untouched. Users of ``torchrun`` itself are not affected.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; 0, or the status of the first rank that failed."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))  # not torch.distributed.run.main: its @record re-raises with a report
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
