"""Stall detection (``moeflow.parallel.heartbeat``): a stopped rank is named within seconds
instead of leaving the job waiting for the collective timeout.

Two real jobs under torchrun (``distributed``), and the verdicts on a fake clock (``unit``): when
a stopped rank is reported (``timeout_s`` after its last beat, even when the watcher read that
beat late), what is not a stall (the whole job stopped and continued), a store that stops
answering, and the message (the time since the last beat, the timeout that was set)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from moeflow.parallel.heartbeat import EXIT_STALLED, Heartbeat, Stall, _Watch
from moeflow.parallel.launch import free_port

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


@pytest.mark.distributed
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    done, seconds = _torchrun(tmp_path, "stop")
    assert done.returncode != 0
    assert "rank 1 has not sent a heartbeat" in done.stderr
    assert f"exitcode  : {EXIT_STALLED}" in done.stderr  # rank 0 gave up on rank 1 ...
    assert seconds < 100  # ... in seconds (+ torchrun's 30 s grace before it kills the stopped
    # rank), not after the 120 s collective timeout


@pytest.mark.distributed
def test_healthy_ranks_finish_and_leave_quietly(tmp_path):
    done, _ = _torchrun(tmp_path, "go")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heartbeat" not in done.stderr


@pytest.mark.unit
@pytest.mark.parametrize("kw, needle", [(dict(interval_s=0), "interval_s"), (dict(timeout_s=-1), "timeout_s"),
                                        (dict(interval_s=1.0, timeout_s=1.5), "at least twice")])
def test_bad_settings_name_the_argument(kw, needle):
    with pytest.raises(ValueError, match=needle):
        Heartbeat(rank=0, world=2, **kw)
    with pytest.raises(TypeError, match="on_stall must be callable"):
        Heartbeat(rank=0, world=2, on_stall="exit")


# ----------------------------------------------------------------------------- verdicts on a fake clock

T, I = 30.0, 1.0  # timeout_s, interval_s
SHIFT = 1000.0  # the peer's clock runs this far ahead of the watcher's: clocks need not agree


def _beat_at(beats: list[float], t: float) -> str:
    """The peer's beat in the store at time ``t`` (watcher's clock) when it beat at ``beats``."""
    done = [b for b in beats if b <= t]
    return f"{len(done)} {done[-1] + SHIFT!r}" if done else ""


def _drive(watch: _Watch, beats: list[float], polls: list[tuple[float, float]], ticks: list[float] = ()) -> tuple[float, Stall] | None:
    """Run the watch over peer 1's ``beats``, the polls ``(started, finished)`` (each reads the
    store as it is at ``finished``, then is judged) and the extra judge ``ticks``; the first
    verdict and its time, or None."""
    events = sorted([(f, "poll", s) for s, f in polls] + [(t, "tick", t) for t in ticks])
    for when, kind, started in events:
        if kind == "poll":
            watch.observe({1: _beat_at(beats, when)}, started, when)
        stall = watch.judge(when)
        if stall is not None:
            return when, stall
    return None


def _every(start: float, stop: float, step: float = I, took: float = 0.01) -> list[tuple[float, float]]:
    return [(start + k * step, start + k * step + took) for k in range(int((stop - start) / step) + 1)]


@pytest.mark.unit
def test_a_stopped_peer_is_reported_timeout_after_its_last_beat():
    beats = [0.3 + 0.97 * k for k in range(11)]  # a little faster than the polls: their phases drift
    verdict = _drive(_Watch([1], timeout_s=T, interval_s=I, now=0.0), beats, _every(0.0, 100.0))
    assert verdict is not None
    when, stall = verdict
    assert stall.rank == 1 and stall.timeout_s == T
    assert T < when - beats[-1] <= T + 2 * I  # reported timeout_s after the last beat (to a poll and a read)
    assert when - beats[-1] - 2 * I <= stall.seconds <= when - beats[-1]  # the true time since it, give or take a read


@pytest.mark.unit
def test_a_beat_read_late_is_dated_when_it_was_written():
    """The watcher's poll is held up 25 s (a slow store) and then reads the peer's last beat,
    written just before the peer stopped: dated by that read, the timeout would start anew
    there and the report come at about 2 x 30 s after the stop, saying 30 s (the fault sweep's
    "fired 61 s after the stop"); dated by its stamp, it comes 30 s after that beat."""
    beats = [0.3 + k for k in range(10)]  # stops after 9.3
    polls = _every(0.0, 9.0) + [(10.0, 35.0)] + _every(36.0, 100.0)
    verdict = _drive(_Watch([1], timeout_s=T, interval_s=I, now=0.0), beats, polls, ticks=[11.0 + k for k in range(24)])
    assert verdict is not None
    when, stall = verdict
    assert stall.rank == 1 and when - beats[-1] <= T + 2 * I and stall.seconds > T


@pytest.mark.unit
def test_the_whole_job_stopped_and_continued_is_no_stall():
    """Every process stopped at 9.5 and continued at 70 (Ctrl-Z and fg, a paused VM): the first
    poll after it still reads the beat from before; the peer beats again within an interval."""
    beats = [0.3 + k for k in range(10)] + [70.2 + k for k in range(60)]
    polls = _every(0.0, 9.0) + _every(70.0, 129.0)
    assert _drive(_Watch([1], timeout_s=T, interval_s=I, now=0.0), beats, polls) is None
    # the peer alone stays stopped: reported once it had a fair chance to beat again, with the true time
    verdict = _drive(_Watch([1], timeout_s=T, interval_s=I, now=0.0), beats[:10], polls)
    assert verdict is not None
    when, stall = verdict
    assert 70.0 + 2 * I < when <= 70.0 + 4 * I and stall.rank == 1 and stall.seconds > 60.0


@pytest.mark.unit
def test_a_store_that_stops_answering_is_reported():
    """Polls stop returning at 9 (the process that serves the store is stopped: a TCPStore read
    then waits for it, whatever its timeout); the judge still ticks and names the store."""
    verdict = _drive(_Watch([1], timeout_s=T, interval_s=I, now=0.0), [0.3 + k for k in range(60)], _every(0.0, 9.0),
                     ticks=[10.0 + k for k in range(60)])
    assert verdict is not None
    when, stall = verdict
    assert stall.rank is None and when == 40.0 and stall.seconds == pytest.approx(40.0 - 9.01)


@pytest.mark.unit
def test_a_peer_that_left_is_not_watched_and_one_that_never_beat_is():
    watch = _Watch([1, 2], timeout_s=T, interval_s=I, now=0.0)
    for k in range(60):
        watch.observe({1: "done" if k > 3 else f"{k + 1} {k + 0.5!r}", 2: ""}, float(k), k + 0.01)
        stall = watch.judge(k + 0.01)
        if stall is not None:
            break
    assert watch.peers() == [2] and stall == Stall(2, pytest.approx(31.01), T, "MASTER_ADDR:MASTER_PORT")


@pytest.mark.unit
def test_poll_and_judge_through_a_fake_store_and_clock():
    """``Heartbeat.poll`` writes ``"COUNT STAMP"``, reads the peer; a store that raises is a
    missed poll, not a dead watcher; a stall is reported once, with its message."""

    class Store:
        def __init__(self):
            self.data, self.fail = {}, False

        def _check(self):
            if self.fail:
                raise RuntimeError("connection reset")

        def set(self, key, value):
            self._check()
            self.data[key] = value

        def check(self, keys):
            self._check()
            return all(k in self.data for k in keys)

        def get(self, key):
            self._check()
            return self.data[key].encode()

    now, store, stalls = [0.0], Store(), []
    hb = Heartbeat(interval_s=I, timeout_s=4.0, rank=0, world=2, key="k", store=store, clock=lambda: now[0],
                   on_stall=stalls.append)
    hb._open()
    for t in range(3):  # the peer beats at 0.5, 1.5, 2.5 and stops
        now[0] = float(t)
        hb.poll()
        hb.judge()
        store.data["moeflow/heartbeat/k/1"] = f"{t + 1} {t + 0.5 + SHIFT!r}"
    assert store.data["moeflow/heartbeat/k/0"] == "3 2.0"
    store.fail = True
    now[0] = 3.0
    hb.poll()  # raises nothing
    store.fail = False
    for t in range(4, 12):
        now[0] = float(t)
        hb.poll()
        hb.judge()
    assert len(stalls) == 1 and stalls[0].rank == 1
    message = stalls[0].message()
    assert message.startswith("moeflow: rank 1 has not sent a heartbeat for ") and "(stall timeout 4 s;" in message
    assert 4.0 < stalls[0].seconds <= 4.0 + 2 * I


@pytest.mark.unit
def test_the_message_states_the_time_and_the_timeout():
    assert Stall(1, 31.04, 30.0).message() == (
        "moeflow: rank 1 has not sent a heartbeat for 31.0 s (stall timeout 30 s; stopped or hung); this rank gives up "
        "so that torchrun can stop the job or restart it")
    assert "the job's key-value store at 127.0.0.1:29500 has not answered for 30.5 s (stall timeout 30 s;" in Stall(
        None, 30.5, 30.0, "127.0.0.1:29500").message()
