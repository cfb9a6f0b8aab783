"""Stall detection (``moeflow.parallel.heartbeat``): a stopped rank is named within seconds
instead of leaving the job waiting for the collective timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from moeflow.parallel.heartbeat import EXIT_STALLED, Heartbeat
from moeflow.parallel.launch import free_port

pytestmark = pytest.mark.distributed

_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed as dist
    from moeflow.parallel import init_distributed
    from moeflow.parallel.heartbeat import Heartbeat

    init_distributed(timeout_s=120)
    with Heartbeat(interval_s=0.5, timeout_s=4.0):
        if dist.get_rank() == 1 and sys.argv[1] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not dead: its socket stays open
        for _ in range(20):
            dist.barrier()
            time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
""")


def _torchrun(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "job.py"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), mode]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.monotonic() - t0


def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    done, seconds = _torchrun(tmp_path, "stop")
    assert done.returncode != 0
    assert "rank 1 has not sent a heartbeat" in done.stderr
    assert f"exitcode  : {EXIT_STALLED}" in done.stderr  # rank 0 gave up on rank 1 ...
    assert seconds < 100  # ... in seconds (+ torchrun's 30 s grace before it kills the stopped
    # rank), not after the 120 s collective timeout


def test_healthy_ranks_finish_and_leave_quietly(tmp_path):
    done, _ = _torchrun(tmp_path, "go")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heartbeat" not in done.stderr


@pytest.mark.parametrize("kw, needle", [(dict(interval_s=0), "interval_s"), (dict(timeout_s=-1), "timeout_s"),
                                        (dict(interval_s=1.0, timeout_s=1.5), "at least twice")])
def test_bad_settings_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Heartbeat(rank=0, world=2, **kw)
