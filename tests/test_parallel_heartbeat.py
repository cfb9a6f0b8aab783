"""Stall detection (``moeflow.parallel.launch.heartbeat``): a stopped rank is named within seconds
instead of leaving the job waiting for the collective timeout, and the job ends at the report.

Two real jobs under torchrun (``distributed``) and one ``moeflow train --nproc 2`` (``e2e``): a
stopped rank is named and the job ends within seconds of the report (the watcher kills the
stopped rank, which torchrun would wait 30 s for), healthy ranks leave quietly. The verdicts on
a fake clock (``unit``): when a stopped rank is reported (``timeout_s`` after its last beat, even
when the watcher read that beat late), what is not a stall (the whole job stopped and
continued), a store that stops answering, and the message (the time since the last beat, the
timeout that was set). And whom the watcher kills (``unit``, on real child processes): a
stopped process of this machine whose pid and start time match what it published; not one
whose start time differs (its pid taken by another process), on another machine, or exited."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moeflow.parallel.launch.heartbeat import EXIT_STALLED, Heartbeat, Stall, _Watch, report_stall
from moeflow.parallel.launch.processes import RankProcess, _stat, claim_kill, this_machine
from moeflow.parallel.launch.torchrun import free_port

from helpers import TORCHRUN_ENV, rank_pids

_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import torch.distributed as dist
    from moeflow.parallel import init_distributed
    from moeflow.parallel.launch.heartbeat import Heartbeat

    init_distributed(timeout_s=120)
    with Heartbeat(interval_s=0.5, timeout_s=4.0):
        if dist.get_rank() == 1 and sys.argv[1] == "stop":
            with open(sys.argv[2], "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)  # stopped, not dead: its socket stays open
        for _ in range(20):
            dist.barrier()
            time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()
""")


def _torchrun(tmp_path, mode: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run the job; its result and (``mode="stop"``) the seconds from rank 1's stop to its end."""
    script, stopped_at = tmp_path / "job.py", tmp_path / "stopped_at"
    script.write_text(_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(script), mode, str(stopped_at)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return done, time.time() - float(stopped_at.read_text()) if stopped_at.exists() else float("nan")


@pytest.mark.distributed
def test_a_stopped_rank_is_named_and_the_job_ends(tmp_path):
    done, seconds = _torchrun(tmp_path, "stop")
    assert done.returncode != 0
    assert "rank 1 has not sent a heartbeat" in done.stderr
    assert "rank 1 (pid " in done.stderr and "on this machine, stopped) is killed with SIGKILL" in done.stderr
    assert f"exitcode  : {EXIT_STALLED}" in done.stderr  # rank 0 gave up on rank 1 ...
    assert seconds < 4.0 + 15.0, seconds  # ... 4 s after its last beat, and the job ended then (about
    # 6 s measured): not 30 s later (torchrun's wait for a stopped rank it sent SIGTERM), nor at the
    # 120 s collective timeout


@pytest.mark.distributed
def test_healthy_ranks_finish_and_leave_quietly(tmp_path):
    # margin: beats every 0.5 s against a 4 s timeout, so only a beat thread held off for 8
    # intervals in a row (a machine stalled for 4 s) could make a healthy job report a stall
    done, _ = _torchrun(tmp_path, "go")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heartbeat" not in done.stderr


@pytest.mark.e2e
def test_moeflow_train_ends_at_the_report_of_a_stopped_rank(tmp_path):
    """``moeflow train --nproc 2 --stall-timeout 5``, rank 1 stopped with SIGSTOP once a step is
    done: the launcher exits within 5 + 15 s of the stop (about 6-7 s measured on the 2-core
    VM; 36 s before the watcher killed the stopped rank), and no rank is left."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    flags = ["--steps", "100000", "--batch-size", "4", "--seq-len", "16", "--warmup", "1", "--eval-every", "0",
             "--eval-batches", "1", "--checkpoint-every", "1", "--no-progress", "--no-plot", "--sample-tokens", "0",
             "--stall-timeout", "5", "--out", str(out)]
    ranks: dict[int, tuple[int, int]] = {}  # rank -> (pid, start time): a later process with its pid is not it

    def alive() -> list[int]:
        return [pid for pid, started in ranks.values() if (_stat(pid) or ("", None))[1] == started]

    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "moeflow", "train", "--nproc", "2", *flags], env=TORCHRUN_ENV,
                                stdout=sink, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120.0
            while not (out / "history.json").exists():  # rank 0 writes it after a step
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
            ranks = {r: (pid, _stat(pid)[1]) for r, pid in rank_pids(proc.pid).items()}
            assert sorted(ranks) == [0, 1], ranks
            os.kill(ranks[1][0], signal.SIGSTOP)
            stopped_at = time.monotonic()
            proc.wait(timeout=60)
            seconds = time.monotonic() - stopped_at
            left = alive()
        finally:
            proc.kill()
            proc.wait()
            for pid in alive():  # whatever failed above, no rank outlives the test
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it exited meanwhile
                    pass
    text = log.read_text()
    assert left == [], f"ranks still running after the launcher exited: {left}"
    assert proc.returncode != 0 and "rank 1 has not sent a heartbeat for" in text, text[-3000:]
    assert "on this machine, stopped) is killed with SIGKILL" in text, text[-3000:]
    assert seconds < 5.0 + 15.0, f"the job ended {seconds:.1f} s after the stop\n{text[-3000:]}"


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
    peer = RankProcess(1, 4242, 12345, "boot/pid:[1]", "node-b")
    store.data["moeflow/heartbeat/k/1/process"] = peer.encode()
    for t in range(3):  # the peer beats at 0.5, 1.5, 2.5 and stops
        now[0] = float(t)
        hb.poll()
        hb.judge()
        store.data["moeflow/heartbeat/k/1"] = f"{t + 1} {t + 0.5 + SHIFT!r}"
    assert store.data["moeflow/heartbeat/k/0"] == "3 2.0"
    assert RankProcess.decode(0, store.data["moeflow/heartbeat/k/0/process"]) == RankProcess.this(0)  # published once
    store.fail = True
    now[0] = 3.0
    hb.poll()  # raises nothing
    store.fail = False
    for t in range(4, 12):
        now[0] = float(t)
        hb.poll()
        hb.judge()
    assert len(stalls) == 1 and stalls[0].rank == 1 and stalls[0].processes == (peer,)
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
    assert "(stall timeout 30 s; stopped or hung), nor have ranks 2, 3; this rank gives up" in Stall(
        1, 31.0, 30.0, others=(2, 3)).message()


@pytest.mark.unit
def test_every_peer_stalled_at_the_verdict_is_named():
    """Ranks 1 and 2 stop together, rank 3 beats on: the verdict names 1 and lists 2, not 3."""
    watch = _Watch([1, 2, 3], timeout_s=T, interval_s=I, now=0.0)
    for k in range(60):
        last = {1: min(k, 10), 2: min(k, 10), 3: k}  # each rank's latest beat: the k-th, at k + 0.5
        watch.observe({r: f"{n} {n + 0.5!r}" for r, n in last.items()}, float(k), k + 0.01)
        stall = watch.judge(k + 0.01)
        if stall is not None:
            break
    assert stall.rank == 1 and stall.others == (2,) and stall.ranks == (1, 2) and 30.0 < stall.seconds <= 32.0


# ----------------------------------------------------------------------------- whom the watcher kills


@pytest.fixture
def sleeper():
    """``start(stopped=True)``: a child process that sleeps (stopped with SIGSTOP, like a stalled
    rank) and its ``RankProcess``; every one is killed and reaped at the end."""
    started = []

    def start(stopped: bool = True) -> tuple[subprocess.Popen, RankProcess]:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        started.append(child)
        if stopped:
            os.kill(child.pid, signal.SIGSTOP)
        return child, RankProcess(1, child.pid, _stat(child.pid)[1], this_machine(), "here")

    yield start
    for child in started:
        child.kill()
        child.wait()


def _state(pid: int) -> str | None:
    deadline = time.monotonic() + 5.0
    while (now := _stat(pid)) is not None and now[0] != "T" and time.monotonic() < deadline:
        time.sleep(0.01)  # SIGSTOP takes effect asynchronously
    return None if now is None else now[0]


@pytest.mark.unit
def test_a_stopped_rank_of_this_machine_is_killed_after_the_report(sleeper):
    child, process = sleeper()
    assert _state(child.pid) == "T"

    class Out(io.StringIO):  # the report is out before the kill (torchrun may stop this rank once it sees the kill)
        def write(self, text: str) -> int:
            assert _stat(child.pid) == ("T", process.started)
            return super().write(text)

    out = Out()
    assert report_stall(Stall(1, 5.1, 5.0, processes=(process,)), out=out) == [child.pid]
    assert child.wait(timeout=5) == -signal.SIGKILL  # a stopped process dies at once on SIGKILL
    assert out.getvalue() == (
        "moeflow: rank 1 has not sent a heartbeat for 5.1 s (stall timeout 5 s; stopped or hung); this rank gives up "
        f"so that torchrun can stop the job or restart it; rank 1 (pid {child.pid} on this machine, stopped) is killed "
        "with SIGKILL: torchrun need not wait for it\n")


@pytest.mark.unit
def test_a_process_that_is_not_the_published_one_is_left_alone(sleeper):
    """Its start time differs (the rank exited, another process got its pid), it runs on
    another machine (its pid means nothing here), it has exited, or the rank published none."""
    child, process = sleeper()
    _state(child.pid)
    reused = RankProcess(2, child.pid, process.started + 1, process.machine, "here")
    elsewhere = RankProcess(3, child.pid, process.started, "other-boot/pid:[1]", "node-b")
    gone, exited = sleeper(stopped=False)
    gone.kill()
    gone.wait()
    exited = RankProcess(4, gone.pid, exited.started, exited.machine, "here")
    out = io.StringIO()
    stall = Stall(2, 5.1, 5.0, others=(3, 4, 5), processes=(reused, elsewhere, exited))
    assert report_stall(stall, out=out) == []
    assert child.poll() is None and _stat(child.pid) == ("T", process.started)  # still there, still stopped
    # after the verdict ("...; stopped or hung), nor have ranks 3, 4, 5; this rank gives up ..."):
    assert out.getvalue().split("; ")[3:] == [
        f"rank 2's process (pid {child.pid}) has exited",
        f"rank 3 runs on node-b (pid {child.pid}), not on this machine: left to torchrun's agent there",
        f"rank 4's process (pid {gone.pid}) has exited",
        "rank 5 did not publish its process: left to torchrun\n"]
    # the start time is read again at the kill: a fake /proc that says another process has the pid
    kill, what = claim_kill(process, process.machine, stat=lambda pid: ("S", process.started + 7))
    assert kill is None and what == f"rank 1's process (pid {child.pid}) has exited" and child.poll() is None


@pytest.mark.unit
def test_proc_stat_is_read_past_a_name_with_spaces_and_parentheses(tmp_path):
    fields = ["T", "1", "2", "3"] + ["0"] * 15 + ["987654"] + ["0"] * 30  # state is field 3, start time 22
    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "stat").write_text(f"41 (a) b (c)) {' '.join(fields)}\n")
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (zombie) Z {' '.join(fields[1:])}\n")
    assert _stat(41, tmp_path) == ("T", 987654)
    assert _stat(42, tmp_path) is None and _stat(43, tmp_path) is None  # exited (not reaped yet), gone
    assert _stat(os.getpid())[0] in "RS" and this_machine() is not None


@pytest.mark.unit
def test_a_published_process_round_trips_and_bad_ones_are_refused():
    me = RankProcess.this(3)
    assert me is not None and me.pid == os.getpid() and me.machine == this_machine()
    assert RankProcess.decode(3, me.encode()) == me
    for text in ("", "garbage", "1 2 m", "x 2 m h", "0 2 m h", "1 2 m h extra"):
        assert RankProcess.decode(1, text) is None, text
    with pytest.raises(ValueError, match="RankProcess.pid must be positive, got 0"):
        RankProcess(1, 0, 5, "m", "h")
    with pytest.raises(TypeError, match="RankProcess.started must be an int, got str"):
        RankProcess(1, 5, "5", "m", "h")
    with pytest.raises(ValueError, match="RankProcess.host must be a non-empty string without spaces"):
        RankProcess(1, 5, 5, "m", "a b")
    with pytest.raises(TypeError, match="report_stall takes a Stall, got str"):
        report_stall("rank 1 stalled")
