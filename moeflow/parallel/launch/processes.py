"""Which process a rank is, and killing a stalled one safely (``moeflow.parallel.launch.heartbeat``).

A rank publishes its process once (``RankProcess``: pid, start time from ``/proc/PID/stat``,
the machine as boot id and pid namespace, the hostname). A watcher that judged it stalled kills
it only when it runs on the watcher's machine and its pid *and* start time still match what it
published, checked through a pidfd that the kill then goes through (``claim_kill``), so a
process that took the pid later is never hit.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RankProcess", "claim_kill", "this_machine"]

_PROC = Path("/proc")
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep", "T": "stopped",
           "t": "stopped by a debugger"}  # /proc/PID/stat's state letters, for the report


@dataclass(frozen=True)
class RankProcess:
    """Which process rank ``rank`` is, as it publishes itself in the job's store: ``pid``;
    ``started``, its start time (clock ticks after boot, field 22 of ``/proc/PID/stat``), which
    tells it from a later process that got the same pid; ``machine``, what tells this process
    table from any other (the kernel's boot id and the pid namespace: containers on one machine
    share the boot id, not the namespace); ``host``, its hostname, for messages."""

    rank: int
    pid: int
    started: int
    machine: str
    host: str

    def __post_init__(self) -> None:
        for name in ("rank", "pid", "started"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"RankProcess.{name} must be an int, got {type(value).__name__}")
            if value < (1 if name == "pid" else 0):
                raise ValueError(f"RankProcess.{name} must be {'positive' if name == 'pid' else '>= 0'}, got {value}")
        for name in ("machine", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or value.split() != [value]:
                raise ValueError(f"RankProcess.{name} must be a non-empty string without spaces, got {value!r}")

    @classmethod
    def this(cls, rank: int) -> RankProcess | None:
        """This process as rank ``rank``; None without a ``/proc`` of its own pid namespace (not Linux)."""
        machine, stat = this_machine(), _stat(os.getpid())
        if machine is None or stat is None:
            return None
        return cls(rank, os.getpid(), stat[1], machine, (socket.gethostname().split() or ["?"])[0])

    def encode(self) -> str:
        return f"{self.pid} {self.started} {self.machine} {self.host}"

    @classmethod
    def decode(cls, rank: int, text: str) -> RankProcess | None:
        """The process ``encode`` wrote as ``text`` for ``rank``; None for anything else (a rank
        that could not tell which process it is publishes ``""``)."""
        parts = text.split()
        try:
            return cls(rank, int(parts[0]), int(parts[1]), parts[2], parts[3]) if len(parts) == 4 else None
        except ValueError:
            return None


def _stat(pid: int, proc: Path = _PROC) -> tuple[str, int] | None:
    """Process ``pid``'s state letter and start time (fields 3 and 22 of ``/proc/PID/stat``), or
    None when there is no such process or it has exited (a zombie, not yet reaped)."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "PID (COMM) ", COMM may hold spaces and ")"
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[19]))


def this_machine(proc: Path = _PROC) -> str | None:
    """This process table's identity (``RankProcess.machine``): ``BOOT_ID/pid:[INODE]``; None
    without ``/proc``, or with one that is not of this process's pid namespace."""
    try:
        if os.readlink(proc / "self") != str(os.getpid()):
            return None
        return f"{(proc / 'sys/kernel/random/boot_id').read_text().strip()}/{os.readlink(proc / 'self/ns/pid')}"
    except OSError:
        return None


def claim_kill(process: RankProcess, machine: str | None,
           stat: Callable[[int], tuple[str, int] | None] = _stat) -> tuple[Callable[[], int] | None, str]:
    """Whether ``report_stall`` may kill ``process`` (``machine``: this one's, ``this_machine()``;
    ``stat``: ``_stat``, which tests replace): the kill, which returns the pid (None: leave
    it), and what the report says of it."""
    rank, pid = process.rank, process.pid
    if machine is None or process.machine != machine:
        return None, (f"rank {rank} runs on {process.host} (pid {pid}), not on this machine: left to torchrun's "
                      "agent there")
    try:  # a pidfd pins the process: the one checked below is the one the signal reaches
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        fd = None
    except (AttributeError, OSError):  # no pidfd_open (not Linux, or before 5.3)
        fd = -1
    now = stat(pid) if fd is not None else None
    if now is None or now[1] != process.started:  # gone, or the pid is another process's now
        _close(fd)
        return None, f"rank {rank}'s process (pid {pid}) has exited"
    try:
        _signal(fd, pid, 0)  # may this process signal it?
    except PermissionError:
        _close(fd)
        return None, f"rank {rank} (pid {pid}) is another user's process: left to torchrun"
    except ProcessLookupError:
        _close(fd)
        return None, f"rank {rank}'s process (pid {pid}) has exited"

    def kill() -> int:
        try:
            _signal(fd, pid, signal.SIGKILL)
        except ProcessLookupError:  # it exited meanwhile
            pass
        finally:
            _close(fd)
        return pid

    state = _STATES.get(now[0], f"state {now[0]}")
    return kill, (f"rank {rank} (pid {pid} on this machine, {state}) is killed with SIGKILL: torchrun need not wait "
                  "for it")


def _signal(fd: int, pid: int, sig: int) -> None:
    """Send ``sig`` through the pidfd ``fd``, or (``fd == -1``: none) to ``pid``."""
    if fd >= 0:
        signal.pidfd_send_signal(fd, sig)
    else:
        os.kill(pid, sig)


def _close(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        os.close(fd)
