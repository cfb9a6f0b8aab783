"""Stall detection for a job of ranks: a rank that stops (SIGSTOP, a hung host, a debugger)
is named within a bounded time instead of leaving the others waiting for the collective timeout.

Every rank beats into the job's key-value store (the c10d store torchrun's rendezvous provides,
reached at ``MASTER_ADDR:MASTER_PORT``) every ``interval_s`` and reads every other rank's beat.
A rank whose last beat is more than ``timeout_s`` old is reported on stderr (``rank R has not
sent a heartbeat for S s (stall timeout T s ...)``, S the time since that beat) and the watching
rank exits with status ``EXIT_STALLED``, so torchrun tears the worker group down and, with
``--max-restarts``, restarts it. So is a store that stops answering for ``timeout_s`` (the
process that serves it is stopped or hung: every beat goes through it). torchrun's store
outlives restarts, so every attempt beats under keys of its own: a random prefix that rank 0
draws and broadcasts (torchrun's restart count cannot serve: it is kept per node and can differ
between nodes).

When the report comes. A beat is ``"COUNT STAMP"``: a counter and the beating rank's
``time.monotonic()``. Clocks need not agree across hosts, only tick alike: the watcher learns
each peer's clock offset as the smallest ``(when a beat was read) - STAMP`` over its recent
reads, so it dates a peer's last beat in its own clock never earlier than it happened and
close to it, even when it reads that beat late. Dating it by when it was read instead (as
this module did) made the report late by as much as the watcher fell behind: a beat written
just before the peer stopped and read only after a stall of the watcher's own started the
timeout anew from that read. What the watching side does is split in two threads, so that
neither blocks the verdict: one polls the store (a TCPStore ``check`` on a store whose
server is stopped waits until the server runs again, whatever the client's timeout, measured
with torch 2.13), the other judges every ``interval_s`` from what was last read (``_Watch``,
no store or clock of its own: tested with a fake clock). Time in which the watching process
itself did not run (the whole job stopped and continued, a paused VM) is no evidence against
a peer: after such a gap a peer is judged only on a read made long enough after it for the
peer to have beaten again.

The job ends at the report. On the watching rank's exit torchrun sends the other ranks SIGTERM
and waits 30 s before SIGKILL (fixed in its failure path: torch 2.13's
``LocalElasticAgent._stop_workers``; its ``--shutdown-timeout`` flag does not reach it), and a
stopped process does not act on SIGTERM: the job used to end 30 s after the report. So every
rank publishes its process once in the store, beside its beats, before its first beat
(``RankProcess``, ``moeflow.parallel.launch.processes``: pid, start time from ``/proc/PID/stat``,
the machine as boot id and pid namespace, the hostname), and the watcher, after printing the report, SIGKILLs each stalled
rank that runs on its own machine (``report_stall``): torchrun finds it exited and stops or
restarts the job at once. Only a process whose pid *and* start time still match what the rank
published is killed: checked in ``/proc`` just before the report, through a pidfd that the
kill then goes through, so a process that took the pid later is never hit. A stalled rank on
another machine is left to torchrun's agent there (which waits the 30 s), and so is a store
that went silent (whose server, torchrun's agent or rank 0, this rank cannot tell); the report
says which. A rank that is judged stalled but not stopped (beat thread starved for ``timeout_s``)
is killed too, where torchrun would have sent it SIGTERM first: the job was ending anyway.
When torchrun sees both exits in one check, its first failure is the lower local rank's
(137, SIGKILL, with rank 0 stopped); moeflow's agent (``moeflow train --nproc``) exits with
``EXIT_STALLED`` whenever a rank gave up on a stalled peer, so ``failed (exit 75)`` says what
happened either way.

It detects a *stopped* process (its beat thread stops too); a rank that is alive but stuck (a
collective that never matches) keeps beating and is left to the collective timeout
(``init_distributed(timeout_s=...)``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TextIO

import torch.distributed as dist

from moeflow.parallel.comm import broadcast_object
from moeflow.parallel.launch.processes import RankProcess, claim_kill, this_machine
from moeflow.parallel.launch.torchrun import job_store

__all__ = ["Heartbeat", "EXIT_STALLED", "Stall", "RankProcess", "report_stall"]

EXIT_STALLED = 75  # the exit status of a rank that gave up on a stalled peer
_DONE = "done"  # a rank's last beat: it left the watched block
_OFFSET_SAMPLES = 32  # reads of a peer's beats its clock offset is the minimum over (the clocks may drift apart)


@dataclass(frozen=True)
class Stall:
    """What the watcher found: ``rank`` sent no heartbeat for ``seconds`` (the time since its
    last beat, dated as the module docstring says), nor did the ranks ``others`` for the
    timeout, or (``rank is None``) the job's store at ``store`` answered no read for
    ``seconds``; ``timeout_s`` is the limit that was set. ``processes``: the processes the
    stalled ranks published (``RankProcess``; a rank that did not publish one is absent)."""

    rank: int | None
    seconds: float
    timeout_s: float
    store: str = "MASTER_ADDR:MASTER_PORT"
    others: tuple[int, ...] = ()
    processes: tuple[RankProcess, ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every stalled rank (none when it is the store that went silent)."""
        return () if self.rank is None else (self.rank, *self.others)

    def message(self) -> str:
        limit = f"stall timeout {self.timeout_s:g} s"
        if self.rank is None:
            what = (f"the job's key-value store at {self.store} has not answered for {self.seconds:.1f} s ({limit}; the "
                    "process that serves it, torchrun's agent or rank 0, is stopped or hung)")
        else:
            what = f"rank {self.rank} has not sent a heartbeat for {self.seconds:.1f} s ({limit}; stopped or hung)"
            if self.others:
                what += (f", nor has rank {self.others[0]}" if len(self.others) == 1 else
                         f", nor have ranks {', '.join(map(str, self.others))}")
        return f"moeflow: {what}; this rank gives up so that torchrun can stop the job or restart it"


class _Watch:
    """The watcher's verdicts, apart from any store or clock (times are passed in: this
    process's ``time.monotonic()``). ``observe`` takes one successful poll of the store (each
    peer's beat as read; a failed poll is not observed), ``judge(now)`` returns a ``Stall`` or
    ``None``.

    Per peer it keeps the last beat read and when that beat was written in this clock: its
    ``STAMP`` plus the peer's clock offset, the smallest ``finished - STAMP`` over the last
    ``_OFFSET_SAMPLES`` new beats (``finished``: when the poll that read it ended, so never
    before the beat; the smallest is the least delayed read). A peer that has not beaten yet
    counts from the start. A peer is stalled when the latest poll, begun at ``read_at``, still
    found a beat written more than ``timeout_s`` before ``read_at``: then it wrote nothing for
    that long (the verdict names the first such peer and lists the others). The store is
    stalled when no poll has succeeded for ``timeout_s``.

    Its own gaps: ``judge`` is called every ``interval_s``; a call more than ``2 * interval_s``
    after the previous one means this process did not run in between (stopped, paused,
    starved), and peers stopped along with it need a moment to beat again once it runs. So
    after a gap a peer is judged only on a poll begun ``2 * interval_s`` after the gap's end,
    and the store's silence counts from that end.
    """

    def __init__(self, peers: Iterable[int], *, timeout_s: float, interval_s: float, now: float,
                 store: str = "MASTER_ADDR:MASTER_PORT") -> None:
        self.timeout_s, self.grace_s, self.store = timeout_s, 2 * interval_s, store
        # rank -> (its last beat as read, its STAMP or None, when this watcher first read it)
        self.beats: dict[int, tuple[str, float | None, float]] = {r: ("", None, now) for r in peers}
        self.offsets: dict[int, collections.deque[float]] = {r: collections.deque(maxlen=_OFFSET_SAMPLES) for r in self.beats}
        self.read_at = now  # when the latest successful poll began
        self.answered = now  # when the latest successful poll ended
        self.ticked = now  # the latest judge call
        self.resumed = now  # the end of the latest gap in this process's own running (or the start)

    def peers(self) -> list[int]:
        """The ranks still watched (a rank that left the block is not)."""
        return list(self.beats)

    def observe(self, beats: Mapping[int, str], started: float, finished: float) -> None:
        """One successful poll, begun at ``started`` and ended at ``finished``: ``beats[r]`` is
        rank ``r``'s beat as read (``""``: none yet; ``"done"``: it left the block)."""
        for r, value in beats.items():
            if r not in self.beats:
                continue
            if value == _DONE:
                del self.beats[r], self.offsets[r]
            elif value != self.beats[r][0]:
                stamp = _stamp(value)
                if stamp is not None:
                    self.offsets[r].append(finished - stamp)
                self.beats[r] = (value, stamp, finished)
        self.read_at, self.answered = max(self.read_at, started), max(self.answered, finished)

    def last_beat(self, rank: int) -> float:
        """When rank ``rank`` last beat, in this clock: its stamp plus its offset; for a beat
        without a stamp (not ``"COUNT STAMP"``), when it was read (late, never early); the
        start if it has not beaten yet."""
        _, stamp, read = self.beats[rank]
        return read if stamp is None else stamp + min(self.offsets[rank])

    def judge(self, now: float) -> Stall | None:
        if now - self.ticked > self.grace_s:  # this process did not run for a while: a gap
            self.resumed = now
        self.ticked = now
        if self.read_at >= self.resumed + self.grace_s:
            stalled = [r for r in self.beats if self.read_at - self.last_beat(r) > self.timeout_s]
            if stalled:
                return Stall(stalled[0], now - self.last_beat(stalled[0]), self.timeout_s, self.store,
                             others=tuple(stalled[1:]))
        silent_since = max(self.answered, self.resumed)
        if now - silent_since > self.timeout_s:
            return Stall(None, now - self.answered, self.timeout_s, self.store)
        return None


def _stamp(value: str) -> float | None:
    """The ``STAMP`` of a beat ``"COUNT STAMP"`` (``None`` for anything else)."""
    parts = value.split()
    try:
        return float(parts[1]) if len(parts) == 2 else None
    except ValueError:
        return None


class Heartbeat:
    """Context manager: beat and watch the other ranks while the block runs.

    ``rank``/``world``: this rank and the job size (default: the initialised default group's);
    ``key``: a prefix that is new for every attempt of the job (default: a random one that rank
    0 draws and broadcasts to the default group on entering, so a restarted group never reads
    its predecessor's beats). ``on_stall(stall)`` (a ``Stall``) replaces the default:
    ``report_stall(stall)`` (the report; the stalled ranks of this machine killed) and exit with
    ``EXIT_STALLED``. ``store`` replaces the job's store (``job_store``; tests pass a fake one)
    and ``clock`` ``time.monotonic``."""

    def __init__(self, *, interval_s: float = 1.0, timeout_s: float = 30.0, rank: int | None = None,
                 world: int | None = None, key: str | None = None, on_stall: Callable[[Stall], object] | None = None,
                 store: object | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if timeout_s < 2 * interval_s:
            raise ValueError(f"timeout_s={timeout_s} must be at least twice interval_s={interval_s}")
        if on_stall is not None and not callable(on_stall):
            raise TypeError(f"on_stall must be callable, got {type(on_stall).__name__}")
        self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.key = None if key is None else f"moeflow/heartbeat/{key}"
        self.on_stall = on_stall if on_stall is not None else _report_and_exit
        self.clock = clock
        self._store = store
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._stalled = False
        self._poller: threading.Thread | None = None
        self._judging: threading.Thread | None = None
        self._watch: _Watch | None = None
        self._beat = 0
        self._me: RankProcess | None = None  # this process, published once (before the first beat)
        self._published = False
        self._processes: dict[int, RankProcess | None] = {}  # peer -> the process it published (None: none)

    def __enter__(self) -> Heartbeat:
        if self.key is None:  # one collective: every rank of the attempt beats under rank 0's prefix
            drawn = broadcast_object(uuid.uuid4().hex if self.rank == 0 else None, src=0)
            self.key = f"moeflow/heartbeat/{drawn}"
        self._open()
        self._poller = threading.Thread(target=self._poll_loop, name="moeflow-heartbeat", daemon=True)
        self._judging = threading.Thread(target=self._judge_loop, name="moeflow-heartbeat-judge", daemon=True)
        self._poller.start()
        self._judging.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in (self._poller, self._judging):
            if thread is not None:
                thread.join(timeout=2 * self.interval_s)
        # a rank that left the block is not watched any more; unless the poll is stuck in the
        # store (it does not answer: this write could wait as long, and nobody reads it anyway)
        if self._poller is not None and not self._poller.is_alive():
            self._store.set(f"{self.key}/{self.rank}", _DONE)

    def _open(self) -> None:
        """The store and the watch (``__enter__``, once the key is known; tests call it to drive
        ``poll`` and ``judge`` themselves, without the threads)."""
        if self.key is None:
            raise RuntimeError("Heartbeat._open needs the key: enter the block (or pass key=...)")
        if self._store is None:
            self._store = job_store(self.timeout_s)
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self._me = RankProcess.this(self.rank)
        self._watch = _Watch([r for r in range(self.world) if r != self.rank], timeout_s=self.timeout_s,
                             interval_s=self.interval_s, now=self.clock(), store=where)

    # ------------------------------------------------------------------ the two threads

    def poll(self) -> None:
        """One poll: write this rank's next beat, read the others' and hand them to the
        watch; then read the processes the peers published that are not known yet. A store
        that fails (refused, reset: its server is gone) is a missed poll; the judge counts the
        store's silence. Called by the polling thread every ``interval_s``."""
        self._beat += 1
        try:
            if not self._published:  # before the first beat: a peer that saw a beat finds it
                self._store.set(f"{self.key}/{self.rank}/process", "" if self._me is None else self._me.encode())
                self._published = True
            self._store.set(f"{self.key}/{self.rank}", f"{self._beat} {self.clock()!r}")
            started = self.clock()
            beats = {}
            with self._lock:
                peers = self._watch.peers()
            for r in peers:
                key = f"{self.key}/{r}"
                beats[r] = self._store.get(key).decode() if self._store.check([key]) else ""
            finished = self.clock()
        except (RuntimeError, OSError):  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            return
        with self._lock:
            self._watch.observe(beats, started, finished)
            unknown = [r for r in self._watch.peers() if r not in self._processes]
        found = {}
        try:
            for r in unknown:
                key = f"{self.key}/{r}/process"
                if self._store.check([key]):
                    found[r] = RankProcess.decode(r, self._store.get(key).decode())
        except (RuntimeError, OSError):
            pass  # read again at the next poll
        with self._lock:
            self._processes.update(found)

    def judge(self) -> None:
        """One verdict from what was last read; a stall is reported once (``on_stall``), unless
        the block is being left. Called by the judging thread every ``interval_s``."""
        with self._lock:
            if self._stalled or self._watch is None:
                return
            stall = self._watch.judge(self.clock())
            if stall is None or self._stop.is_set():
                return
            self._stalled = True
            found = (self._processes.get(r) for r in stall.ranks)
            stall = dataclasses.replace(stall, processes=tuple(p for p in found if p is not None))
        self.on_stall(stall)

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self.judge()  # at once on fresh evidence; the judging thread covers a poll stuck in the store
            self._stop.wait(self.interval_s)

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.judge()


def report_stall(stall: Stall, out: TextIO | None = None) -> list[int]:
    """Print ``stall``'s report on ``out`` (default: stderr), then SIGKILL each stalled rank
    that runs on this machine and still is the process it published; return their pids.

    A stalled rank is mostly a stopped one, and a stopped process does not act on the SIGTERM
    with which torchrun ends the other ranks when this one exits: torchrun would wait 30 s for
    it before its own SIGKILL. Killed here, it has exited when torchrun looks. The report says
    what becomes of each stalled rank: killed (with its state from ``/proc``, e.g. stopped),
    on another machine (left to torchrun's agent there, which waits as said), exited, not
    this user's, or not published. Only a process whose pid *and* start time still match
    what the rank published is killed, checked through a pidfd, which the signal then goes
    through, so no process that took the pid later can be hit (without pidfds, before Linux
    5.3: through the pid, checked just before)."""
    if not isinstance(stall, Stall):
        raise TypeError(f"report_stall takes a Stall, got {type(stall).__name__}")
    machine = this_machine()
    claims = [claim_kill(p, machine) for p in stall.processes]
    published = {p.rank for p in stall.processes}
    notes = [what for _, what in claims] + [f"rank {r} did not publish its process: left to torchrun"
                                            for r in stall.ranks if r not in published]
    print("; ".join([stall.message(), *notes]), file=sys.stderr if out is None else out, flush=True)
    return [kill() for kill, _ in claims if kill is not None]


def _report_and_exit(stall: Stall) -> None:
    report_stall(stall)
    os._exit(EXIT_STALLED)
