"""No process of a job outlives what started it (``moeflow.parallel.launch.torchrun.die_with_parent``,
``die_with_agent``): a process armed against its parent goes when the parent is killed with
SIGKILL, through ``prctl`` and through the polling fallback; one whose parent died before it
armed (the race) goes at once; bad arguments are refused by name. The whole chain (launcher,
agent, ranks) is tested in ``tests/test_train_launch.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moeflow.parallel.launch.torchrun import AGENT_PID, TorchrunJob, die_with_agent, die_with_parent

# the armed process: prints "PID HOW" once armed, then waits to be killed
_ARMED = textwrap.dedent("""
    import os, signal, sys, time
    import moeflow.parallel.launch.torchrun as launch
    if sys.argv[1] == "poll":  # as on a system without prctl
        launch._set_pdeathsig = lambda sig: False
    how = launch.die_with_parent(int(sys.argv[2]), signal.SIGKILL)
    print(os.getpid(), how, flush=True)
    time.sleep(120)
""")
# its parent: starts it from the main thread, then waits (until the test kills it)
_PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())])
    time.sleep(120)
""")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["prctl", "poll"])
def test_a_process_goes_when_its_parent_is_killed(how):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _ARMED, how], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        line = parent.stdout.readline().split()  # the child inherits the pipe: its line
        assert len(line) == 2 and line[1] == how, line
        child = int(line[0])
        assert _running(child)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20.0
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _running(child), f"the child {child} outlived its parent ({how})"
    finally:
        parent.kill()
        parent.wait()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.distributed
def test_a_process_whose_parent_died_before_it_armed_goes_at_once():
    """The race: told a parent it no longer has (here: itself, which is never its parent), it
    sends itself the signal instead of waiting for the death of whoever adopted it."""
    code = ("import os, signal; from moeflow.parallel.launch.torchrun import die_with_parent; "
            "die_with_parent(os.getpid(), signal.SIGKILL); print('still here')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL and "still here" not in done.stdout, done.stderr[-2000:]


@pytest.mark.unit
@pytest.mark.parametrize(("kw", "error", "needle"), [
    (dict(parent_pid=0), ValueError, "parent_pid must be a process id >= 1, got 0"),
    (dict(parent_pid="12"), TypeError, "parent_pid must be an int, got str"),
    (dict(parent_pid=True), TypeError, "parent_pid must be an int, got bool"),
    (dict(parent_pid=1, sig=10_000), ValueError, "sig must be a valid signal number, got 10000"),
    (dict(parent_pid=1, sig=9.0), TypeError, "sig must be a signal number, got float"),
])
def test_bad_arguments_are_refused_by_name(kw, error, needle):
    with pytest.raises(error, match=needle):  # refused before anything is armed
        die_with_parent(**kw)


@pytest.mark.unit
def test_die_with_agent_arms_only_ranks_of_a_torchrun_agent(monkeypatch):
    job = dict(rank=0, world=2, local_rank=0, local_world=2, restart_count=0)
    assert die_with_agent(TorchrunJob(**job, run_id=None)) is None  # no agent started it: nothing armed
    monkeypatch.setenv(AGENT_PID, "not-a-pid")
    with pytest.raises(ValueError, match=f"{AGENT_PID}='not-a-pid' in the environment is not a process id"):
        die_with_agent(TorchrunJob(**job, run_id="abc"))
    assert AGENT_PID not in os.environ  # taken out: children never inherit a stale pid


@pytest.mark.unit
def test_the_agent_exits_with_the_stall_status_when_a_rank_gave_up_on_a_stalled_peer():
    """A watcher kills its stalled peer on the same machine; torchrun may list the killed rank's
    SIGKILL first, but the job's status is the watcher's EXIT_STALLED. Without one, the first."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from moeflow.parallel.launch.agent import _cause
    from moeflow.parallel.launch.heartbeat import EXIT_STALLED

    killed = ProcessFailure(local_rank=0, pid=10, exitcode=-9, error_file="/nonexistent")
    watcher = ProcessFailure(local_rank=1, pid=11, exitcode=EXIT_STALLED, error_file="/nonexistent")
    assert _cause(ChildFailedError("train", {0: killed, 1: watcher})) is watcher
    other = ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file="/nonexistent")
    failures = {0: killed, 1: other}
    assert _cause(ChildFailedError("train", failures)) is ChildFailedError("train", failures).get_first_failure()[1]
