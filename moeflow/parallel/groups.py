"""Process-group setup: torch.distributed from torchrun's environment, expert/data groups."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.parallel.comm import barrier
from moeflow.parallel.exchange.alltoall import Hierarchy
from moeflow.parallel.launch.torchrun import attempt_store

__all__ = ["init_distributed", "shutdown_distributed", "ParallelGroups", "make_groups"]


def init_distributed(backend: str | None = None, *, timeout_s: float | None = None) -> None:
    """Initialise the default process group from torchrun's environment variables.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise. Under NCCL the
    rank's device is ``cuda:LOCAL_RANK`` (set as the current device and bound to the group;
    ``RuntimeError`` when the machine has fewer GPUs). ``timeout_s`` bounds every collective (torch's default is
    30 minutes): with torchrun's restart policy, a short timeout turns a peer that died into a
    quick failure and a restart instead of a long hang. Does nothing if already initialised.

    Restart-safe: when torchrun's agents share their store with the workers (its default), the
    group is built on a store of this attempt only (``moeflow.parallel.launch.torchrun.attempt_store``),
    never on keys an earlier attempt left there.
    """
    if dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"init_distributed needs torchrun's environment; missing {missing}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs: dict[str, object] = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    if backend == "nccl":
        # one GPU per rank: the collectives' tensors (moeflow.parallel.comm.group_device), torch's
        # object collectives and the barrier all use this device; binding it (device_id) also
        # builds the NCCL communicator now instead of at the first collective
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but this machine has {torch.cuda.device_count()} CUDA device(s): "
                               "start at most one rank per GPU")
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun's store outlives the attempt
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = attempt_store(rank, 600.0 if timeout_s is None else timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, **kwargs)
    else:
        dist.init_process_group(backend=backend, **kwargs)


def shutdown_distributed() -> None:
    """Barrier, then destroy the default process group (a rank that leaves early would make
    the others' last collective fail); nothing if torch.distributed is not initialised."""
    if dist.is_initialized():
        try:
            barrier()
        finally:
            dist.destroy_process_group()


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's expert-parallel group (ranks that share one set of experts between them)
    and data-parallel group (ranks that hold the same experts, one per expert group)."""

    expert: dist.ProcessGroup
    data: dist.ProcessGroup
    expert_size: int
    data_size: int
    hierarchy: Hierarchy | None = None


def make_groups(expert_size: int, *, node_size: int | None = None) -> ParallelGroups:
    """Split the world into expert-parallel groups of ``expert_size`` consecutive ranks
    (experts spread inside) and data-parallel groups across them (ranks with the same position
    in each expert group). Every rank must call this (it creates groups).

    ``node_size`` (ranks per node; torchrun's ``LOCAL_WORLD_SIZE`` when it is ``"env"``) also
    builds the intra-/inter-node groups of the two-level exchange inside each expert group.
    """
    world = dist.get_world_size()
    if isinstance(expert_size, bool) or not isinstance(expert_size, int) or expert_size < 1 or world % expert_size:
        raise ValueError(f"expert_size must be a positive divisor of the world size {world}, got {expert_size!r}")
    if node_size == "env":
        if "LOCAL_WORLD_SIZE" not in os.environ:
            raise ValueError("node_size='env' needs torchrun's LOCAL_WORLD_SIZE in the environment")
        node_size = int(os.environ["LOCAL_WORLD_SIZE"])
    if node_size is not None and (
        isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1 or expert_size % node_size
    ):
        raise ValueError(f"node_size must be a positive divisor of expert_size={expert_size}, got {node_size!r}")
    rank = dist.get_rank()
    mine_expert = mine_data = None
    for start in range(0, world, expert_size):
        g = dist.new_group(list(range(start, start + expert_size)))
        if start <= rank < start + expert_size:
            mine_expert = g
    for offset in range(expert_size):
        g = dist.new_group(list(range(offset, world, expert_size)))
        if rank % expert_size == offset:
            mine_data = g
    hierarchy = None
    if node_size is not None:
        L = node_size
        intra = inter = None
        for start in range(0, world, expert_size):
            for node in range(expert_size // L):
                ranks = list(range(start + node * L, start + (node + 1) * L))
                g = dist.new_group(ranks)
                if rank in ranks:
                    intra = g
            for local in range(L):
                ranks = list(range(start + local, start + expert_size, L))
                g = dist.new_group(ranks)
                if rank in ranks:
                    inter = g
        assert intra is not None and inter is not None
        hierarchy = Hierarchy(intra=intra, inter=inter, node_size=L)
    assert mine_expert is not None and mine_data is not None
    return ParallelGroups(
        expert=mine_expert, data=mine_data, expert_size=expert_size, data_size=world // expert_size, hierarchy=hierarchy
    )
