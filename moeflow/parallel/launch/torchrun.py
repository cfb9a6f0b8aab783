"""torchrun: the job this process is a rank of, its stores, and launching one on this machine.

- ``torchrun_job()`` reads the shape of the job from torchrun's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ...); ``None`` outside torchrun.
- ``job_store()`` is a client of the key-value store torchrun's agents keep at
  ``MASTER_ADDR:MASTER_PORT``. With torchrun's default (the rendezvous shares its store with the
  workers, ``TORCHELASTIC_USE_AGENT_STORE=True``) it outlives every restart of the job, so an
  attempt can read what an earlier one wrote (``moeflow train`` records there which run the job
  claimed). It also keeps the keys of the earlier attempts' process groups, so a restarted rank
  can read a dead rank's address from it and fail or hang in ``init_process_group`` (torch
  2.5+, pytorch/pytorch#135712, seen here with gloo on every restart). ``attempt_store()``
  avoids that: rank 0 hosts a new store for each attempt and announces it in the job's store;
  ``moeflow.parallel.init_distributed`` builds the process group on it.
- ``run_torchrun`` starts a module on N local ranks (the CLI's ``--nproc`` commands).
- ``die_with_parent`` / ``die_with_agent``: no process of a job outlives what started it. The
  launcher starts torchrun's agent (``moeflow.parallel.launch.agent``), which starts the ranks, each in
  a session of its own; a launcher killed with SIGKILL used to leave the agent and every rank
  running as orphans, still training and writing checkpoints (and on a GPU machine holding its
  memory). Now the agent gets SIGTERM when the launcher dies (torchrun's own shutdown then stops
  its ranks) and a rank gets SIGKILL when its agent dies (an agent killed outright shuts nothing
  down).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["AGENT_PID", "TorchrunJob", "attempt_store", "die_with_agent", "die_with_parent", "free_port", "job_store",
           "run_torchrun", "torchrun_job"]

_REQUIRED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_ANNOUNCE = "moeflow/attempt-store"  # in the job's store: "PORT TOKEN" of this attempt's store
_TOKEN = "moeflow/attempt-token"  # in the attempt's store: the TOKEN rank 0 announced
# Set by moeflow's agent for the ranks it starts (torchrun passes its environment on): its pid,
# so that a rank can tell whether the agent died before the rank armed its death signal. Not a
# switch: a rank of any torchrun agent goes with it; this only closes that race.
AGENT_PID = "MOEFLOW_AGENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_PARENT_S = 0.5  # where prctl is missing: how often the fallback thread looks at the parent


@dataclass(frozen=True)
class TorchrunJob:
    """This process's place in a torchrun job (read from torchrun's environment).

    ``local_world`` is the number of ranks on this node (``LOCAL_WORLD_SIZE``); torchrun numbers
    the ranks node by node, so node ``n`` holds ranks ``[n*L, (n+1)*L)`` when the nodes are
    equal. ``restart_count`` counts the restarts of this node's workers (torchrun keeps it per
    node: after a failure on another node it can differ between nodes)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    restart_count: int
    run_id: str | None

    @property
    def spans_nodes(self) -> bool:
        """Whether the job has ranks on other nodes than this one."""
        return self.world > self.local_world


def torchrun_job(environ: Mapping[str, str] | None = None) -> TorchrunJob | None:
    """The torchrun job this process is a rank of, or ``None`` when it is not one (torchrun
    sets ``LOCAL_WORLD_SIZE`` and ``TORCHELASTIC_RUN_ID`` for every rank it starts; neither is
    set). Raises ``ValueError`` naming the variable when the environment is incomplete or
    inconsistent."""
    env = os.environ if environ is None else environ
    marks = [k for k in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE") if k in env]
    if not marks:
        return None
    missing = [k for k in _REQUIRED if k not in env]
    if missing:
        raise ValueError(f"this process looks like a torchrun rank ({', '.join(marks)} set) but the environment "
                         f"lacks {missing}; start it with torchrun")

    def number(name: str, default: str | None = None) -> int:
        value = env.get(name, default)
        try:
            return int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"{name}={value!r} in the environment is not an integer") from None

    job = TorchrunJob(rank=number("RANK"), world=number("WORLD_SIZE"), local_rank=number("LOCAL_RANK"),
                      local_world=number("LOCAL_WORLD_SIZE"),
                      restart_count=number("TORCHELASTIC_RESTART_COUNT", "0"), run_id=env.get("TORCHELASTIC_RUN_ID"))
    if not (0 <= job.rank < job.world and 0 <= job.local_rank < job.local_world <= job.world):
        raise ValueError(f"inconsistent torchrun environment: RANK={job.rank}, WORLD_SIZE={job.world}, "
                         f"LOCAL_RANK={job.local_rank}, LOCAL_WORLD_SIZE={job.local_world}")
    return job


def job_store(timeout_s: float) -> dist.TCPStore:
    """A client of the job's key-value store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's);
    operations wait at most ``timeout_s``."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def attempt_store(rank: int, timeout_s: float) -> dist.TCPStore:
    """A key-value store for this attempt of the job only (see the module docstring).

    Rank 0 hosts a new store on a free port of its node (``MASTER_ADDR``: torchrun places rank 0
    on the node that hosts the job's store), writes a random token into it and announces
    ``"PORT TOKEN"`` in the job's store. Every other rank reads the announcement, connects and
    takes the store only once it holds that token: an announcement left by an earlier attempt
    points at a store that died with that attempt's rank 0 (refused, or another store now on the
    port, without the token), so the rank reads again until this attempt's rank 0 has written
    its own. Raises ``TimeoutError`` after ``timeout_s``."""
    host, timeout = os.environ["MASTER_ADDR"], datetime.timedelta(seconds=timeout_s)
    shared = job_store(timeout_s)
    if rank == 0:
        token = uuid.uuid4().hex
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        store.set(_TOKEN, token)
        shared.set(_ANNOUNCE, f"{store.port} {token}")
        return store
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        port, token = shared.get(_ANNOUNCE).decode().split()
        if _listening(host, int(port)):  # else: the store of an attempt that is over
            try:
                store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=2))
                if store.check([_TOKEN]) and store.get(_TOKEN).decode() == token:
                    store.set_timeout(timeout)
                    return store
            except RuntimeError:  # it went away, or it is not a store
                pass
        time.sleep(0.05)
    raise TimeoutError(f"rank {rank}: rank 0 announced no store for this attempt within {timeout_s:.0f} s "
                       f"(job store {host}:{os.environ['MASTER_PORT']})")


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port`` (a plain connect: a dead store's
    port is refused at once, where a store client would retry until its timeout)."""
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> str:
    """Have this process get ``sig`` as soon as its parent, process ``parent_pid``, dies; returns
    how: ``"prctl"`` or ``"poll"``. (Why: see the module docstring.)

    Linux: ``prctl(PR_SET_PDEATHSIG, sig)`` (through ctypes), the kernel's own notice, which
    even a stopped process gets when ``sig`` is SIGKILL. Two catches, handled so:

    - The race. A parent that died before this call has left this process to another parent
      (init or a subreaper), and the signal would wait for *that* one's death. Hence the
      expected parent comes in as an argument, not from ``os.getppid()`` here: after setting
      the signal, ``os.getppid()`` is compared with it, and if they differ this process sends
      itself ``sig`` at once, as the kernel would have.
    - The kernel fires it when the parent *thread* that started this process exits, not the
      parent process. The parent must start it from a thread that outlives it: ``run_torchrun``
      waits for the agent in the thread that started it, and torchrun starts its ranks from its
      main thread.

    The setting is not inherited by this process's children (each arms its own). Where there
    is no ``prctl`` (not Linux, or the call fails), a daemon thread compares ``os.getppid()``
    with ``parent_pid`` every 0.5 s and sends ``sig`` when they differ (a reparented process:
    its parent died). Raises ``ValueError``/``TypeError`` naming a bad argument."""
    if isinstance(parent_pid, bool) or not isinstance(parent_pid, int):
        raise TypeError(f"parent_pid must be an int, got {type(parent_pid).__name__}")
    if parent_pid < 1:
        raise ValueError(f"parent_pid must be a process id >= 1, got {parent_pid}")
    if isinstance(sig, bool) or not isinstance(sig, int):
        raise TypeError(f"sig must be a signal number, got {type(sig).__name__}")
    if sig not in set(signal.valid_signals()):
        raise ValueError(f"sig must be a valid signal number, got {sig}")
    how = "prctl" if _set_pdeathsig(int(sig)) else "poll"
    if how == "poll":
        threading.Thread(target=_watch_parent, args=(parent_pid, int(sig)), name="moeflow-parent-watch",
                         daemon=True).start()
    if os.getppid() != parent_pid:  # it died before the signal was armed: what the kernel would have done
        os.kill(os.getpid(), sig)
    return how


def die_with_agent(job: TorchrunJob) -> str | None:
    """A rank of a torchrun job (``job``) goes when its torchrun agent goes: SIGKILL (the agent
    that would have stopped it is gone, so nothing is left to wait for; a rank that is stopped
    or hung dies too). ``None`` (nothing armed) for a process no torchrun agent started (no
    ``TORCHELASTIC_RUN_ID``: a launcher of its own, whose lifetime is its business).

    The agent is this process's parent: torchrun starts its ranks itself. moeflow's agent
    passes its pid (``AGENT_PID``), which closes the race of ``die_with_parent``; under
    ``torchrun`` itself the parent at this call is taken (a rank whose agent died earlier still
    fails on its own, at the latest when it cannot reach the agent's store). The variable is
    taken out of this process's environment, so its own children never inherit a stale pid."""
    if job.run_id is None:
        return None
    told = os.environ.pop(AGENT_PID, None)
    try:
        agent = int(told) if told is not None else os.getppid()
    except ValueError:
        raise ValueError(f"{AGENT_PID}={told!r} in the environment is not a process id") from None
    return die_with_parent(agent, signal.SIGKILL)


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``; False where it is not available or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), ctypes.c_ulong(0), ctypes.c_ulong(0),
                          ctypes.c_ulong(0)) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, sig: int) -> None:
    """The fallback of ``die_with_parent``: ``sig`` to this process once it has another parent."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_PARENT_S)
    os.kill(os.getpid(), sig)


def run_torchrun(
    module: str, args: list[str], *, nproc: int, threads: int, stream: bool = False, max_restarts: int = 0
) -> subprocess.CompletedProcess:
    """Run ``python -m module *args`` on ``nproc`` local ranks (torchrun, rendezvous on
    127.0.0.1) with ``threads`` OpenMP threads each; returns the finished process (output
    captured, or passed through to this process's stdout/stderr with ``stream=True``).
    ``max_restarts``: torchrun restarts the ranks that often after a failure. The job gets a
    rendezvous id of its own (``--rdzv-id``, the ranks' ``TORCHELASTIC_RUN_ID``; torchrun's
    default is ``"none"`` for every job), by which its restarts know what it started. torchrun
    runs through ``moeflow.parallel.launch.agent`` (no traceback of its own when a rank fails), which is
    told this process's pid: it, and through it every rank, dies when this process dies
    (``die_with_parent``; this call waits for the agent in the thread that started it, as the
    parent-death signal needs). Raises ``RuntimeError`` (with the tail of the captured output)
    if it fails."""
    cmd = [
        sys.executable, "-m", "moeflow.parallel.launch.agent", f"--parent-pid={os.getpid()}", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--rdzv-id={uuid.uuid4().hex}", "-m", module, *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, env=env, capture_output=not stream, text=True)
    if done.returncode != 0 and stream:
        raise RuntimeError(f"torchrun {module} failed (exit {done.returncode}); its output is above")
    if done.returncode != 0:
        raise RuntimeError(f"torchrun {module} failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done
