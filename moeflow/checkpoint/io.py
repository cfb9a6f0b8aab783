"""Writing checkpoints: crash-safe, world-size-independent, in safetensors.

The directory layout and ``index.json`` are described in ``moeflow.checkpoint.format``, which
also holds everything that reads a checkpoint back; loading into a model is
``moeflow.checkpoint.load``. Both are re-exported here, so ``moeflow.checkpoint.io`` still names
the whole surface.

Writes go to ``<root>/.tmp-step-...``; every file is fsynced, the directory is renamed into
place and the root fsynced, and ``index.json`` is written into it last (itself through a
temporary name), so a crash at any point leaves the previous checkpoints complete and loadable
and the new one without an index, which is never loaded. Before it writes anything, a save
removes such remains (``partial_checkpoints``: every ``.tmp-step-*``, every ``step-*`` without
an index) and refuses to replace a complete checkpoint of the same step. One writer per root.
The last ``keep`` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from moeflow.checkpoint.format import (  # noqa: F401  (all re-exported: they were defined here)
    _STEP_DIR,
    FORMAT,
    CheckpointError,
    _Reader,
    _sha256,
    _step_dirs,
    complete_checkpoints,
    describe_checkpoint,
    latest_checkpoint,
    partial_checkpoints,
    read_index,
)
from moeflow.checkpoint.load import (  # noqa: F401  (all re-exported: they were defined here)
    _gather_experts,
    _load_into,
    _load_optimizer,
    _vocab_rows,
    load_checkpoint,
)
from moeflow.checkpoint.state import expert_slices, model_tensors, optimizer_tensors, split_key, vocab_shards
from moeflow.parallel.comm import ProcessGroup, gather_objects, process_position, sync
from moeflow.parallel.vocab import gather_vocab_weight

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "complete_checkpoints",
    "latest_checkpoint",
    "partial_checkpoints",
    "read_index",
    "describe_checkpoint",
    "reshard_checkpoint",
    "FORMAT",
]


# ------------------------------------------------------------------ low-level writing
# (``save_file``, ``_finalize`` and ``_write_index`` are looked up in this module when a save
# runs: the crash tests replace them here to kill a save mid-file, before the rename and between
# the rename and the index.)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies that belong to the save (the model may change the moment the save returns)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}


def _write_tensors(path: Path, owned: dict[str, torch.Tensor]) -> dict:
    """Write one safetensors file durably; return its index entry."""
    save_file(owned, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {
        "file": path.name,
        "sha256": _sha256(path),
        "bytes": path.stat().st_size,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in owned.items()},
    }


def _begin(root: Path, final: Path, tmp: Path) -> None:
    """Make room for writing checkpoint ``final`` into ``tmp`` (rank 0, before any rank writes).

    A complete checkpoint of the same step is refused here, before anything is written or
    removed. The remains of interrupted saves under ``root`` (this step's and any other's) are
    removed: they are never loaded, and a ``step-*`` directory without an index would otherwise
    block the rename of this save."""
    if (final / "index.json").exists():
        raise CheckpointError(f"{final} already exists (a complete checkpoint); refusing to overwrite it")
    root.mkdir(parents=True, exist_ok=True)
    for partial in partial_checkpoints(root):
        shutil.rmtree(partial)
    tmp.mkdir()


def _write_index(path: Path, index: dict) -> None:
    """Write ``path/index.json`` durably and atomically (through a temporary name): the moment a
    checkpoint directory becomes complete."""
    part = path / ".index.json.tmp"
    with open(part, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path / "index.json")
    _fsync_dir(path)


def _finalize(tmp: Path, final: Path, index: dict, keep: int) -> None:
    """Publish ``tmp`` as ``final``: rename it into place, write ``index.json`` into it last,
    then delete all but the newest ``keep`` complete checkpoints beside it."""
    _fsync_dir(tmp)
    if final.exists():
        raise CheckpointError(f"{final} appeared during the save; refusing to overwrite it")
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    _write_index(final, index)
    complete = complete_checkpoints(final.parent)
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old)


# ------------------------------------------------------------------ save


def save_checkpoint(
    root: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict | None = None,
    group: ProcessGroup | None = None,
    keep: int = 3,
) -> Path:
    """Save ``model`` (and ``optimizer``) as checkpoint ``step`` under ``root``; every rank of
    ``group`` calls it (the root must be visible to all of them). Returns the checkpoint dir.

    ``extra`` is JSON-able user state saved in the index (e.g. the data position). Each rank's
    CPU (and CUDA) RNG state is saved too and restored by ``load_checkpoint`` on the same rank.
    A complete checkpoint ``step`` already under ``root`` raises ``CheckpointError`` on every
    rank before anything is written; the remains of interrupted saves are removed first.
    ``save_checkpoint_async`` (``moeflow.checkpoint.background``) writes the files beside the
    caller's next steps instead.
    """
    _wait_pending(Path(root))
    return _write(_snapshot(root, step, model, optimizer, extra=extra, group=group, keep=keep, stage=True), group)


_PENDING: dict[Path, Any] = {}  # root -> its save in flight (a ``background.PendingSave``): one writer per root


def _wait_pending(root: Path) -> None:
    """Let the save in flight under ``root`` finish first (its error surfaces here, unless its
    ``wait()`` already raised it)."""
    pending = _PENDING.pop(root.resolve(), None)
    if pending is not None:
        pending.finish()


@dataclass(frozen=True)
class _Snapshot:
    """A save's state and where it goes: everything ``_write`` needs, so that the write needs
    neither the model nor a collective of the caller's group. ``tensors`` are host copies,
    except the ``later`` keys (parameters and optimizer state, with ``stage=False``), which
    still share the live tensors' memory until ``_write`` copies them."""

    tmp: Path
    final: Path
    rank: int
    world: int
    tensors: dict[str, torch.Tensor]
    later: frozenset[str]
    index: dict  # (rank 0) the index without its "files"
    keep: int


def _snapshot(root: str | os.PathLike, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
              extra: dict | None, group: ProcessGroup | None, keep: int, stage: bool) -> _Snapshot:
    """The synchronous part of a save: rank 0's verdict on ``root`` (shared with every rank,
    so a refusal raises everywhere), the collectives that assemble this rank's tensors, and
    host copies of them (``stage=False``: of all but the parameters and optimizer state, which
    only an optimizer step changes; buffers and RNG states are copied now)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    rank, world = process_position(group)
    root = Path(root)
    final, tmp = _step_dirs(root, step)
    problem = None
    if rank == 0:
        try:
            _begin(root, final, tmp)
        except CheckpointError as err:
            problem = str(err)
        except OSError as err:
            problem = f"{root}: cannot prepare the save of step {step}: {err}"
    # every rank learns rank 0's verdict (a refusal raises everywhere instead of leaving the
    # other ranks waiting for files that never come); this is also the barrier before writing
    problem = gather_objects(problem, group)[0]
    if problem is not None:
        raise CheckpointError(problem)

    tensors = model_tensors(model, include_dense=rank == 0)
    optim_meta = None
    if optimizer is not None:
        optim_tensors, optim_meta = optimizer_tensors(model, optimizer, include_dense=rank == 0)
        tensors.update(optim_tensors)
    for key, shard in vocab_shards(model, optimizer):  # every rank joins each gather; rank 0 writes
        full = gather_vocab_weight(shard, group)
        if rank == 0:
            tensors[key] = full
    tensors[f"rng/rank{rank}/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors[f"rng/rank{rank}/cuda"] = torch.cuda.get_rng_state()
    index = {}
    if rank == 0:
        experts = {name: layout.num_experts for name, layout in expert_slices(model).items()}
        index = {"format": FORMAT, "step": step, "world_size": world, "experts": experts,
                 "optimizer": optim_meta, "extra": extra or {}}
    later = frozenset() if stage else frozenset(k for k in tensors if k.startswith(("param/", "optim/")))
    now = _owned({k: v for k, v in tensors.items() if k not in later})
    tensors = {k: now.get(k, v) for k, v in tensors.items()}  # (the file keeps this order)
    return _Snapshot(tmp=tmp, final=final, rank=rank, world=world, tensors=tensors, later=later, index=index,
                     keep=keep)


def _write(snapshot: _Snapshot, group: ProcessGroup | None, staged: Callable[[], None] | None = None) -> Path:
    """Write this rank's file; rank 0 indexes every rank's and publishes the checkpoint. The
    ``later`` tensors are copied first, then ``staged()`` says the live state may change. A
    rank whose write failed still takes part in the gather, so every rank learns of it and
    raises."""
    try:
        try:
            later = _owned({k: snapshot.tensors[k] for k in snapshot.later})
        finally:
            if staged is not None:
                staged()
        tensors = {k: later.get(k, v) for k, v in snapshot.tensors.items()}
        info: dict = _write_tensors(snapshot.tmp / f"rank{snapshot.rank:05d}-of-{snapshot.world:05d}.safetensors",
                                    tensors)
    except Exception as err:  # noqa: BLE001 - every rank must reach the gather below
        info = {"error": f"rank {snapshot.rank}: {type(err).__name__}: {err}"}
    infos = gather_objects(info, group)
    if len(infos) != snapshot.world:  # the process group is gone (the job is failing): never publish a part
        raise CheckpointError(f"the save of {snapshot.final} heard from {len(infos)} of its {snapshot.world} ranks (the "
                              "process group was shut down while it ran); not published, the previous checkpoint "
                              "stays the latest")
    failed = [i["error"] for i in infos if "error" in i]
    if failed:
        raise CheckpointError(f"the save of {snapshot.final} failed (the previous checkpoint stays the latest): "
                              + "; ".join(failed))
    if snapshot.rank == 0:
        _finalize(snapshot.tmp, snapshot.final, {**snapshot.index, "files": infos}, snapshot.keep)
    sync(group)
    return snapshot.final


# ------------------------------------------------------------------ resharding (offline)


def reshard_checkpoint(src: str | os.PathLike, dst_root: str | os.PathLike, world_size: int, *, keep: int = 3) -> Path:
    """Rewrite checkpoint ``src`` as if ``world_size`` ranks had saved it (1 = everything in one
    file), under ``dst_root`` with the same step. Exact: tensors are copied, not recomputed."""
    src = Path(src)
    index = read_index(src)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    for name, E in index["experts"].items():
        if E % world_size:
            raise ValueError(f"world_size={world_size} does not divide the {E} experts of {name}")
    reader = _Reader(src, index)
    files: list[dict[str, torch.Tensor]] = [{} for _ in range(world_size)]
    for key in reader.where:
        base, g = split_key(key)
        if g is not None:
            name = base.split("/", 1)[1]
            if base.startswith("optim/"):
                name = name.rsplit("/", 1)[0]
            files[g // (index["experts"][name] // world_size)][key] = reader.get(key)
        elif key.startswith("rng/"):
            r = int(key.split("/")[1].removeprefix("rank"))
            if r < world_size:
                files[r][key] = reader.get(key)
        else:
            files[0][key] = reader.get(key)
    dst_root = Path(dst_root)
    final, tmp = _step_dirs(dst_root, index["step"])
    _begin(dst_root, final, tmp)
    infos = [_write_tensors(tmp / f"rank{r:05d}-of-{world_size:05d}.safetensors", _owned(t)) for r, t in enumerate(files)]
    _finalize(tmp, final, {**index, "world_size": world_size, "files": infos}, keep)
    return final
