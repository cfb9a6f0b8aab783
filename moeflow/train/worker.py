"""One rank of a ``moeflow train`` job under torchrun: ``torchrun ... -m moeflow train ARGS`` on
every node, or ``moeflow train --nproc N ARGS``, which starts exactly that on this machine.

Every rank calls ``run_rank(cfg, job)``, which

1. builds the process group (``init_distributed``, every collective bounded by
   ``cfg.collective_timeout_s``; restart-safe) and watches the other ranks' heartbeats for the
   whole run (``cfg.stall_timeout_s``);
2. finds the node size: torchrun's ``LOCAL_WORLD_SIZE``, when every node holds as many ranks
   (then ``exchange="auto"`` picks the two-level exchange as soon as the job spans nodes);
3. joins the run in ``out_dir`` (rank 0 decides, every rank hears the verdict). torchrun keeps
   one key-value store for all attempts of a job (its restarts after a failure, and new
   rendezvous rounds when nodes join or leave), and the attempt that claims ``out_dir`` records
   the run's id there. So an attempt that finds that record *continues* the run, from its
   latest complete checkpoint, as ``--resume`` would, while the first attempt follows the flags
   (``--resume``, ``--overwrite``) and, like one process, refuses another run's directory (an
   attempt after such a refusal refuses again: nothing was recorded);
4. trains (``train_lm`` with ``resume=True``: the directory is claimed by then) on the whole job.

With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torch's opt-out), the store lives and dies with
rank 0 of each attempt, so no attempt sees a record: pass ``--resume`` to continue on restarts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from moeflow.parallel import init_distributed, shutdown_distributed
from moeflow.parallel.comm import gather_objects
from moeflow.parallel.heartbeat import Heartbeat
from moeflow.parallel.launch import TorchrunJob, job_store
from moeflow.train.lm import train_lm
from moeflow.train.lm_checkpoint import RunState, claim_run, inspect_run, on_rank0
from moeflow.train.lm_config import LMTrainConfig

__all__ = ["run_rank"]

_RUN_KEY = "moeflow/train/run:"  # + the resolved out_dir, in torchrun's store: the run id this job claimed


def run_rank(cfg: LMTrainConfig, job: TorchrunJob,
             on_run: Callable[[RunState, bool], None] | None = None) -> dict | None:
    """Train as rank ``job.rank`` of the torchrun job (every rank calls it). ``on_run(state,
    continuing)`` is called on rank 0 once it knows what the run does (``continuing``: an
    earlier attempt of this job claimed ``out_dir``). Returns the history, or None when
    ``--resume`` found the run finished (nothing trained, no file touched). Refusals raise
    ``ValueError`` on every rank, before any training work."""
    init_distributed(timeout_s=cfg.collective_timeout_s)
    try:
        with Heartbeat(interval_s=min(1.0, cfg.stall_timeout_s / 4), timeout_s=cfg.stall_timeout_s):
            node_size = _node_size(cfg, job)
            state = on_rank0(lambda: _join(cfg, on_run), None)
            if state.finished:
                return None
            return train_lm(dataclasses.replace(cfg, resume=True, overwrite=False), node_size=node_size)
    finally:
        shutdown_distributed()


def _node_size(cfg: LMTrainConfig, job: TorchrunJob) -> int | None:
    """torchrun's ``LOCAL_WORLD_SIZE`` when it is the same on every node, else None (then only
    the flat exchange can run: ``exchange="two-level"`` is refused on every rank)."""
    sizes = gather_objects(job.local_world)
    if len(set(sizes)) == 1:
        return job.local_world
    if cfg.exchange == "two-level":
        by_size: dict[int, list[int]] = {}
        for rank, size in enumerate(sizes):
            by_size.setdefault(size, []).append(rank)  # type: ignore[arg-type]
        raise ValueError(f"exchange='two-level' needs the same number of ranks on every node; LOCAL_WORLD_SIZE by "
                         f"rank: {by_size}")
    return None


def _join(cfg: LMTrainConfig, on_run: Callable[[RunState, bool], None] | None) -> RunState:
    """Rank 0: continue the run an earlier attempt of this job claimed, or (first attempt)
    inspect and claim ``out_dir`` as the flags say and record the claim in the job's store."""
    store = job_store(cfg.collective_timeout_s)
    key = _RUN_KEY + str(Path(cfg.out_dir).resolve())
    claimed = store.get(key).decode() if store.check([key]) else None
    if claimed is not None:
        state = inspect_run(dataclasses.replace(cfg, resume=True, overwrite=False))
        if state.run_id != claimed:
            raise ValueError(f"out_dir={str(cfg.out_dir)!r} holds run {state.run_id!r}, not the run {claimed!r} this "
                             "torchrun job started there; it was replaced while the job ran")
    else:
        state = inspect_run(cfg)
        if not state.finished:
            claim_run(cfg, state)
            store.set(key, state.run_id)
    if on_run is not None:
        on_run(state, claimed is not None)
    return state
