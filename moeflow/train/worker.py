"""One rank of a ``moeflow train`` job under torchrun: ``torchrun ... -m moeflow train ARGS`` on
every node, or ``moeflow train --nproc N ARGS``, which starts exactly that on this machine.

Every rank calls ``run_rank(cfg, job)``, which

0. arms its death with its torchrun agent (``die_with_agent``: SIGKILL when the agent dies, so
   a rank never trains on, writes checkpoints or holds a GPU as an orphan);
1. builds the process group (``init_distributed``, every collective bounded by
   ``cfg.collective_timeout_s``; restart-safe) and watches the other ranks' heartbeats for the
   whole run (``cfg.stall_timeout_s``);
2. finds the node size: torchrun's ``LOCAL_WORLD_SIZE``, when every node holds as many ranks
   (then ``exchange="auto"`` picks the two-level exchange as soon as the job spans nodes);
3. joins the run in ``out_dir`` (rank 0 decides, every rank hears the verdict). The attempt
   that claims ``out_dir`` records the claim twice: in ``run.json`` the job's rendezvous id
   (torchrun's ``--rdzv-id``, ``TORCHELASTIC_RUN_ID``), and the run's id in the key-value store
   torchrun shares with the workers, which by default outlives every attempt. A later attempt
   of the job (a restart after a failure, a new rendezvous round when nodes join or leave) that
   finds either record *continues* the run, from its latest complete checkpoint, as
   ``--resume`` would; the first attempt follows the flags (``--resume``, ``--overwrite``) and,
   like one process, refuses another run's directory (an attempt after such a refusal refuses
   again: nothing was recorded);
4. trains (``train_lm`` with ``resume=True``: the directory is claimed by then) on the whole job,
   on however many ranks this attempt has (the experts are placed for that number).

The record in ``run.json`` is what elastic jobs need: with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
(torch's opt-out, needed for a node to join a running job, see ``docs/guide/parallel.md``) the
store lives and dies with rank 0 of each attempt. It needs a rendezvous id of the job's own:
torchrun's default ``--rdzv-id`` is ``"none"`` for every job, so that one is not recorded (then
only the shared store tells a restart from a new job).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path

from moeflow.parallel import init_distributed, shutdown_distributed
from moeflow.parallel.comm import gather_objects
from moeflow.parallel.launch.heartbeat import Heartbeat
from moeflow.parallel.launch.torchrun import TorchrunJob, die_with_agent, job_store
from moeflow.train.lm import train_lm
from moeflow.train.lm_checkpoint import RunState, claim_run, claimed_by, inspect_run, on_rank0
from moeflow.train.lm_config import LMTrainConfig

__all__ = ["run_rank"]

_RUN_KEY = "moeflow/train/run:"  # + the resolved out_dir, in torchrun's store: the run id this job claimed
_ANONYMOUS = "none"  # torchrun's default --rdzv-id: shared by every job that sets none


def run_rank(cfg: LMTrainConfig, job: TorchrunJob,
             on_run: Callable[[RunState, bool], None] | None = None) -> dict | None:
    """Train as rank ``job.rank`` of the torchrun job (every rank calls it). ``on_run(state,
    continuing)`` is called on rank 0 once it knows what the run does (``continuing``: an
    earlier attempt of this job claimed ``out_dir``). Returns the history, or None when
    ``--resume`` found the run finished (nothing trained, no file touched). Refusals raise
    ``ValueError`` on every rank, before any training work."""
    die_with_agent(job)
    # the backend follows the ranks' device, not the machine: --device cpu on a GPU machine is gloo
    cuda = str(cfg.device).startswith("cuda")
    init_distributed("nccl" if cuda else "gloo", timeout_s=cfg.collective_timeout_s)
    try:
        with Heartbeat(interval_s=min(1.0, cfg.stall_timeout_s / 4), timeout_s=cfg.stall_timeout_s):
            node_size = _node_size(cfg, job)
            state = on_rank0(lambda: _join(cfg, job, on_run), None)
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


def _join(cfg: LMTrainConfig, job: TorchrunJob, on_run: Callable[[RunState, bool], None] | None) -> RunState:
    """Rank 0: continue the run an earlier attempt of this job claimed, or (first attempt)
    inspect and claim ``out_dir`` as the flags say and record the claim (``run.json``, the
    job's store)."""
    store = job_store(cfg.collective_timeout_s)
    key = _RUN_KEY + str(Path(cfg.out_dir).resolve())
    rdzv_id = job.run_id if job.run_id and job.run_id != _ANONYMOUS else None
    if rdzv_id is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        warnings.warn("torchrun gives each attempt a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) and this "
                      f"job has torchrun's default --rdzv-id {_ANONYMOUS!r}: a restart cannot tell the run this job "
                      f"starts in out_dir={str(cfg.out_dir)!r} from another's and will refuse it; give the job an "
                      "--rdzv-id of its own", RuntimeWarning, stacklevel=2)
    claimed = store.get(key).decode() if store.check([key]) else None
    if claimed is None and rdzv_id is not None:
        claimed = claimed_by(cfg.out_dir, rdzv_id)
    if claimed is not None:
        state = inspect_run(dataclasses.replace(cfg, resume=True, overwrite=False))
        if state.run_id != claimed:
            raise ValueError(f"out_dir={str(cfg.out_dir)!r} holds run {state.run_id!r}, not the run {claimed!r} this "
                             "torchrun job started there; it was replaced while the job ran")
    else:
        state = inspect_run(cfg)
        if not state.finished:
            claim_run(cfg, state, rdzv_id=rdzv_id)
            store.set(key, state.run_id)
    if on_run is not None:
        on_run(state, claimed is not None)
    return state
