"""Stall detection for a job of ranks: a rank that stops (SIGSTOP, a hung host, a debugger)
is named within a bounded time instead of leaving the others waiting for the collective timeout.

Every rank runs a daemon thread that writes a beat into the job's key-value store (the c10d
store torchrun's rendezvous provides, reached at ``MASTER_ADDR:MASTER_PORT``) every
``interval_s`` and reads every other rank's. A rank whose beat has not changed for
``timeout_s`` is reported on stderr (``rank R has not sent a heartbeat for S s``) and the watching
rank exits with status ``EXIT_STALLED``, so torchrun tears the worker group down and, with
``--max-restarts``, restarts it. A beat is a counter, so clocks need not agree across hosts.
torchrun's store outlives restarts, so every attempt beats under keys of its own: a random
prefix that rank 0 draws and broadcasts (torchrun's restart count cannot serve: it is kept per
node and can differ between nodes).

It detects a *stopped* process (its beat thread stops too); a rank that is alive but stuck (a
collective that never matches) keeps beating and is left to the collective timeout
(``init_distributed(timeout_s=...)``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import torch.distributed as dist

from moeflow.parallel.launch import job_store

__all__ = ["Heartbeat", "EXIT_STALLED"]

EXIT_STALLED = 75  # the exit status of a rank that gave up on a stalled peer
_DONE = "done"  # a rank's last beat: it left the watched block


class Heartbeat:
    """Context manager: beat and watch the other ranks while the block runs.

    ``rank``/``world``: this rank and the job size (default: the initialised default group's);
    ``key``: a prefix that is new for every attempt of the job (default: a random one that rank
    0 draws and broadcasts to the default group on entering, so a restarted group never reads
    its predecessor's beats). ``on_stall(rank, seconds)`` replaces the default report-and-exit
    (tests use it)."""

    def __init__(self, *, interval_s: float = 1.0, timeout_s: float = 30.0, rank: int | None = None,
                 world: int | None = None, key: str | None = None, on_stall=None) -> None:  # type: ignore[no-untyped-def]
        for name, value in (("interval_s", interval_s), ("timeout_s", timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if timeout_s < 2 * interval_s:
            raise ValueError(f"timeout_s={timeout_s} must be at least twice interval_s={interval_s}")
        self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
        self.rank = dist.get_rank() if rank is None else rank
        self.world = dist.get_world_size() if world is None else world
        self.key = None if key is None else f"moeflow/heartbeat/{key}"
        self.on_stall = on_stall if on_stall is not None else _report_and_exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None

    def __enter__(self) -> Heartbeat:
        if self.key is None:  # one collective: every rank of the attempt beats under rank 0's prefix
            drawn = [uuid.uuid4().hex if self.rank == 0 else None]
            dist.broadcast_object_list(drawn, src=0)
            self.key = f"moeflow/heartbeat/{drawn[0]}"
        self._store = job_store(self.timeout_s)
        self._thread = threading.Thread(target=self._run, args=(self._store,), name="moeflow-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s)
        if self._store is not None:  # a rank that left the block is not watched any more
            self._store.set(f"{self.key}/{self.rank}", _DONE)

    def _run(self, store: dist.TCPStore) -> None:
        beat = 0
        seen = {r: ("", time.monotonic()) for r in range(self.world) if r != self.rank}  # rank -> (beat, when it changed)
        while not self._stop.wait(self.interval_s if beat else 0.0):
            beat += 1
            store.set(f"{self.key}/{self.rank}", str(beat))
            now = time.monotonic()
            for r, (last, since) in list(seen.items()):
                key = f"{self.key}/{r}"
                value = store.get(key).decode() if store.check([key]) else ""
                if value == _DONE:
                    del seen[r]
                elif value != last:
                    seen[r] = (value, now)
                elif now - since > self.timeout_s and not self._stop.is_set():
                    self.on_stall(r, now - since)
                    return


def _report_and_exit(rank: int, seconds: float) -> None:
    print(f"moeflow: rank {rank} has not sent a heartbeat for {seconds:.0f} s (stopped or hung); this rank "
          f"gives up so that torchrun can stop the job or restart it", file=sys.stderr, flush=True)
    os._exit(EXIT_STALLED)
