"""torchrun's agent as moeflow's one-machine launcher starts it (``run_torchrun``).

``python -m moeflow.parallel.launch.agent [--parent-pid PID] ARGS`` is ``python -m torch.distributed.run
ARGS`` with these differences:

- A failed job reads as one line per cause instead of a page: the agent's own log lines
  (torch.distributed.elastic's warnings and errors about stopping the other ranks) are limited to
  critical ones, and when the ranks fail the agent exits with the first failed rank's status (128
  + the signal for a rank killed by one) instead of raising torchrun's ``ChildFailedError`` with
  its traceback and summary table; stopped by a signal itself, it exits 128 + that signal.
- Nothing outlives the launcher. The agent arms SIGTERM for the death of its parent, process
  ``PID`` (``die_with_parent``; default: the process that started it), so a launcher killed even
  with SIGKILL takes the job with it: on SIGTERM torchrun stops its ranks (SIGTERM to each
  rank's process group, SIGKILL after its ``--shutdown-timeout``) and exits. SIGTERM rather
  than SIGKILL so that torchrun's shutdown runs and reaches the ranks' own children too; the
  ranks arm SIGKILL for the agent's death (``die_with_agent``, with this agent's pid from
  ``AGENT_PID``), which covers an agent that dies without that shutdown.

The ranks' own output (a moeflow rank prints its error as one line) is untouched. Users of
``torchrun`` itself are not affected by this module; their ranks, too, go with their agent
(``die_with_agent``), which is what one wants of a rank whose agent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from moeflow.parallel.launch.heartbeat import EXIT_STALLED
from moeflow.parallel.launch.torchrun import AGENT_PID, die_with_parent

__all__ = ["main"]

_PARENT = "--parent-pid="


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv`` (after a leading ``--parent-pid=PID``, if any); 0, or the status
    of the first rank that failed, or 128 + the signal that stopped the agent."""
    parent, argv = _parent_pid(argv)
    die_with_parent(parent, signal.SIGTERM)
    os.environ[AGENT_PID] = str(os.getpid())  # torchrun passes its environment on to the ranks
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))  # not torch.distributed.run.main: its @record re-raises with a report
    except ChildFailedError as err:
        failure = _cause(err)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as err:  # torchrun stopped the ranks first
        return 128 + int(err.sigval)
    return 0


def _cause(err: ChildFailedError):  # type: ignore[no-untyped-def]
    """The failure whose status the agent exits with: a rank that gave up on a stalled peer
    (``EXIT_STALLED``) when there is one, else the first to fail. A watcher on the stalled
    rank's machine kills it (``heartbeat.report_stall``), and torchrun can see both exits in
    one check, with the killed rank's SIGKILL first: the status should say what happened."""
    stalled = [f for f in err.failures.values() if f.exitcode == EXIT_STALLED]
    return min(stalled, key=lambda f: f.timestamp) if stalled else err.get_first_failure()[1]


def _parent_pid(argv: list[str]) -> tuple[int, list[str]]:
    """``--parent-pid=PID`` off the front of ``argv`` (the launcher's pid, which
    ``run_torchrun`` passes; without it, the process that started this one)."""
    if not argv or not argv[0].startswith(_PARENT):
        return os.getppid(), argv
    value = argv[0][len(_PARENT):]
    try:
        pid = int(value)
    except ValueError:
        raise ValueError(f"--parent-pid must be a process id, got {value!r}") from None
    if pid < 1:
        raise ValueError(f"--parent-pid must be a process id >= 1, got {pid}")
    return pid, argv[1:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
