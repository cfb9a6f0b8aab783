"""``tutel.system``: the session set-up Tutel's examples start with, on ``moeflow.parallel``.

``init_data_model_parallel(backend=...)`` starts torch.distributed when the process was launched
by ``torchrun`` (its environment variables are set) and otherwise runs as one process, as Tutel
does; it returns the session (ranks, groups, device, a rank-0 ``dist_print``) that
``get_local_session()`` returns later.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import time
from collections.abc import Callable

import torch

from moeflow.parallel.comm import process_position

__all__ = ["TutelSession", "init_data_model_parallel", "create_groups_from_world", "get_local_session",
           "record_time", "apply_rank_size_from_pattern"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_BACKENDS = ("nccl", "gloo", None)


@dataclasses.dataclass(frozen=True)
class TutelSession:
    """Tutel's ``DistributedProperties``: the world split into ``group_count`` data-parallel
    replicas of ``model_size`` consecutive ranks each (``model_group``: the ranks that share a
    model's experts; ``data_group``: the ranks holding the same experts). Groups are None with
    one process; ``global_group`` None means the default group."""

    global_size: int
    global_rank: int
    group_count: int
    data_rank: int
    model_size: int
    model_rank: int
    local_device: torch.device | None
    model_group: object | None
    data_group: object | None
    global_group: object | None
    is_distributed: bool
    is_cuda: bool
    dist_print: Callable[..., None]


_SESSIONS: dict[int, TutelSession] = {}
_STATE: dict[str, object] = {}


def _start(backend: str | None) -> None:
    from moeflow.parallel import init_distributed, shutdown_distributed

    if process_position()[1] > 1 or _STATE.get("started"):
        return
    if all(v in os.environ for v in _TORCHRUN_VARS):
        init_distributed(backend)
        atexit.register(shutdown_distributed)
    _STATE["started"] = True


def create_groups_from_world(group_count: int, include_init: str | None = None,
                             parent_group: object | None = None) -> TutelSession:
    """The session for ``group_count`` data-parallel replicas (``-s``: replicas of ``s`` ranks
    each, i.e. ``W / s`` of them); ``include_init`` names the backend and starts
    torch.distributed under ``torchrun``. Sessions are cached per ``group_count``."""
    if include_init not in _BACKENDS:
        raise ValueError(f"backend must be 'nccl', 'gloo' or None, got {include_init!r}")
    if include_init is not None:
        if _STATE.get("backend", include_init) != include_init:
            raise ValueError(f"backend={include_init!r}, but this process already runs {_STATE['backend']!r}")
        _STATE["backend"] = include_init
        _start(include_init)
    rank, world = process_position()
    if parent_group is not None and process_position(parent_group)[1] not in (1, world):  # type: ignore[arg-type]
        raise ValueError("create_groups_from_world: splitting groups out of a sub-group is not supported (as in Tutel)")
    if isinstance(group_count, bool) or not isinstance(group_count, int) or group_count == 0:
        raise ValueError(f"group_count must be a non-zero int, got {group_count!r}")
    if group_count in _SESSIONS:
        return _SESSIONS[group_count]
    count = world // -group_count if group_count < 0 else group_count
    if count < 1 or world % count:
        raise ValueError(f"group_count={group_count}: cannot split {world} processes into that many equal groups")
    model_size = world // count
    distributed = world > 1
    model_group = data_group = None
    if distributed:
        from moeflow.parallel import make_groups

        groups = make_groups(model_size)
        model_group, data_group = groups.expert, groups.data
    backend = _STATE.get("backend")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu") if backend == "gloo" else None

    def dist_print(*args: object) -> None:
        if rank == 0:
            print(*args)

    session = TutelSession(
        global_size=world, global_rank=rank, group_count=count, data_rank=rank // model_size, model_size=model_size,
        model_rank=rank % model_size, local_device=device, model_group=model_group, data_group=data_group,
        global_group=None, is_distributed=distributed, is_cuda=device is not None and device.type == "cuda",
        dist_print=dist_print,
    )
    _SESSIONS[group_count] = session
    return session


def init_data_model_parallel(group_count: int = 1, backend: str | None = "nccl") -> TutelSession:
    """Start the session (see the module docstring); ``backend`` ``'gloo'`` puts it on the CPU."""
    session = create_groups_from_world(group_count, include_init=backend)
    _STATE["default"] = session
    return session


def get_local_session() -> TutelSession:
    """The session of the last ``init_data_model_parallel``."""
    if "default" not in _STATE:
        raise RuntimeError("no session yet: call system.init_data_model_parallel() first")
    return _STATE["default"]  # type: ignore[return-value]


def record_time(is_cuda: bool | None = None) -> float:
    """``time.time()`` after waiting for the GPU (when the session, or ``is_cuda``, says CUDA)."""
    if is_cuda if is_cuda is not None else get_local_session().is_cuda:
        torch.cuda.synchronize()
    return time.time()


def apply_rank_size_from_pattern(filename: str, rank: int, size: int, create_dir: bool = True) -> str:
    """``filename`` with ``{rank}`` and ``{size}`` filled in (its directory created)."""
    name = re.sub(r"\{rank\}", str(rank), re.sub(r"\{size\}", str(size), filename))
    directory = os.path.dirname(name)
    if create_dir and directory:
        os.makedirs(directory, exist_ok=True)
    return name
