"""Crash-safe, world-size-independent checkpoints in safetensors.

Layout of one checkpoint (``<root>/step-00000123/``)::

    index.json                       format, step, world size at save, experts per parameter,
                                     every file with its sha256 and its tensors (shape, dtype),
                                     optimizer hyper-parameters, user ``extra`` (data position, ...)
    rank00000-of-00004.safetensors   the experts rank 0 held (global keys ``...@<g>``), plus the
    rank00001-of-00004.safetensors   dense tensors (rank 0 only) and each rank's RNG state

Writes go to ``<root>/.tmp-step-...``; every file is fsynced, then ``index.json``, then the
directory is renamed into place and the root fsynced, so a crash at any point leaves the
previous checkpoints complete and loadable; a leftover ``.tmp-*`` is never loaded (and is
replaced by the next save of that step). The last ``keep`` checkpoints are kept.

Loading reads only JSON and safetensors (no pickle), verifies the sha256 of every file it
opens, and fails with a ``CheckpointError`` naming the file, key and mismatch: a missing
expert, another expert count, a shape or dtype change, a corrupted or truncated file. It never
fills anything with zeros.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from moeflow.checkpoint.state import ExpertLayout, expert_slices, model_tensors, optimizer_tensors, split_key, vocab_shards
from moeflow.parallel.comm import ProcessGroup, gather_objects, process_position, sync
from moeflow.parallel.vocab import gather_vocab_weight

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "partial_checkpoints",
    "read_index",
    "describe_checkpoint",
    "reshard_checkpoint",
    "FORMAT",
]

FORMAT = "moeflow-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked (the message names file and mismatch)."""


# ------------------------------------------------------------------ low-level writing


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write one safetensors file durably; return its index entry."""
    owned = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    save_file(owned, str(path))
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {
        "file": path.name,
        "sha256": _sha256(path),
        "bytes": path.stat().st_size,
        "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in owned.items()},
    }


def _finalize(tmp: Path, final: Path, index: dict, keep: int) -> None:
    index_path = tmp / "index.json"
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        raise CheckpointError(f"{final} already exists; refusing to overwrite a complete checkpoint")
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    complete = sorted(p for p in final.parent.iterdir() if _STEP_DIR.match(p.name) and (p / "index.json").exists())
    for old in complete[: max(len(complete) - keep, 0)]:
        shutil.rmtree(old)


def _step_dirs(root: Path, step: int) -> tuple[Path, Path]:
    return root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"


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
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be a positive int, got {keep!r}")
    rank, world = process_position(group)
    root = Path(root)
    final, tmp = _step_dirs(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # the remains of a save that crashed
            shutil.rmtree(tmp)
        tmp.mkdir()
    sync(group)

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
    info = _write_tensors(tmp / f"rank{rank:05d}-of-{world:05d}.safetensors", tensors)
    infos = gather_objects(info, group)

    if rank == 0:
        experts = {name: layout.num_experts for name, layout in expert_slices(model).items()}
        index = {
            "format": FORMAT,
            "step": step,
            "world_size": world,
            "experts": experts,
            "files": infos,
            "optimizer": optim_meta,
            "extra": extra or {},
        }
        _finalize(tmp, final, index, keep)
    sync(group)
    return final


# ------------------------------------------------------------------ read


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / "index.json").exists()]
    return max(complete, key=lambda p: p.name) if complete else None


def partial_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Leftovers of interrupted saves under ``root`` (never loaded)."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if p.name.startswith(".tmp-step-")) if root.is_dir() else []


def read_index(path: str | os.PathLike) -> dict:
    """The parsed ``index.json`` of a checkpoint directory (checked for format)."""
    path = Path(path)
    index_path = path / "index.json"
    if not index_path.exists():
        raise CheckpointError(f"{path}: no index.json (not a complete moeflow checkpoint)")
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path}: not valid JSON ({err})") from None
    if index.get("format") != FORMAT:
        raise CheckpointError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT!r}")
    return index


class _Reader:
    """Opens the checkpoint's files lazily, verifying each file's checksum once."""

    def __init__(self, path: Path, index: dict) -> None:
        self.path, self.index = path, index
        self.where: dict[str, dict] = {}
        for entry in index["files"]:
            for key in entry["tensors"]:
                self.where[key] = entry
        self.verified: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        entry = self.where[key]
        file = self.path / entry["file"]
        if entry["file"] not in self.verified:
            if not file.exists():
                raise CheckpointError(f"{file}: missing (listed in index.json)")
            size = file.stat().st_size
            if size != entry["bytes"]:
                raise CheckpointError(f"{file}: {size} bytes, index.json says {entry['bytes']} (truncated or replaced)")
            digest = _sha256(file)
            if digest != entry["sha256"]:
                raise CheckpointError(f"{file}: sha256 {digest[:12]}... does not match index.json ({entry['sha256'][:12]}...): corrupted")
            self.verified.add(entry["file"])
        try:
            with safe_open(str(file), framework="pt") as f:
                return f.get_tensor(key)
        except SafetensorError as err:
            raise CheckpointError(f"{file}: cannot read {key!r} ({err})") from None


def _load_into(target: torch.Tensor, value: torch.Tensor, key: str, file: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{file}: {key} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}")
    if value.dtype != target.dtype:
        raise CheckpointError(f"{file}: {key} has dtype {value.dtype}, the model expects {target.dtype}")
    with torch.no_grad():
        target.copy_(value)


def _vocab_rows(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a saved unsplit table when ``p`` is a vocabulary shard."""
    if not getattr(p, "moeflow_vocab_shard", False):
        return value
    start = p.moeflow_vocab_start  # type: ignore[attr-defined]
    return value[start : start + p.shape[0]]


def _gather_experts(reader: _Reader, base: str, layout: ExpertLayout, like: torch.Tensor) -> torch.Tensor:
    """The ``[slots, ...]`` tensor this rank holds, from the whole experts saved under
    ``base@<g>`` (cut to each slot's hidden slice for hidden-sharded layers)."""
    parts = []
    for i, g in enumerate(layout.ids):
        key = f"{base}@{g}"
        if not reader.has(key):
            raise CheckpointError(f"{reader.path}: expert {g} of {base.split('/', 1)[1]} is missing (key {key!r})")
        parts.append(layout.cut(i, reader.get(key)))
    return torch.stack(parts) if parts else like.new_empty(like.shape)


def load_checkpoint(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    group: ProcessGroup | None = None,
    restore_rng: bool = True,
) -> dict:
    """Load a checkpoint into ``model`` (and ``optimizer``), whatever world size wrote it.

    ``path`` is a checkpoint directory, or a root whose latest complete checkpoint is used.
    Each rank reads the experts it holds now (``MoE.expert_slots``: any placement). Returns
    ``{"step": ..., "extra": ..., "world_size": <at save>, "path": ...}``.
    """
    path = Path(path)
    if not (path / "index.json").exists():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: no complete checkpoint here")
        path = latest
    index = read_index(path)
    reader = _Reader(path, index)
    rank, _ = process_position(group)
    slices = expert_slices(model)

    for name, layout in slices.items():
        E = layout.num_experts
        saved = index["experts"].get(name)
        if saved is None:
            raise CheckpointError(f"{path}/index.json: no experts saved for {name}")
        if saved != E:
            raise CheckpointError(f"{path}/index.json: {name} was saved with {saved} experts, the model has {E}")
    expected = set()
    for name, p in model.named_parameters():
        if name in slices:
            ids = slices[name].ids
            value = _gather_experts(reader, f"param/{name}", slices[name], p)
            _load_into(p, value, f"param/{name}@{ids}", str(path))
            expected.update(f"param/{name}@{g}" for g in range(index["experts"][name]))
        else:
            key = f"param/{name}"
            if not reader.has(key):
                raise CheckpointError(f"{path}: parameter {name!r} is not in the checkpoint")
            _load_into(p, _vocab_rows(p, reader.get(key)), key, reader.where[key]["file"])
            expected.add(key)
    for name, b in model.named_buffers():
        key = f"buffer/{name}"
        if not reader.has(key):
            raise CheckpointError(f"{path}: buffer {name!r} is not in the checkpoint")
        _load_into(b, reader.get(key), key, reader.where[key]["file"])
        expected.add(key)
    unknown = sorted(k for k in reader.where if k.startswith(("param/", "buffer/")) and k not in expected)
    if unknown:
        raise CheckpointError(f"{path}: checkpoint has tensors the model does not: {unknown[:5]}{' ...' if len(unknown) > 5 else ''}")

    if optimizer is not None:
        _load_optimizer(reader, index, model, optimizer, slices)
    if restore_rng and reader.has(f"rng/rank{rank}/cpu"):
        torch.set_rng_state(reader.get(f"rng/rank{rank}/cpu"))
        if torch.cuda.is_available() and reader.has(f"rng/rank{rank}/cuda"):
            torch.cuda.set_rng_state(reader.get(f"rng/rank{rank}/cuda"))
    return {"step": index["step"], "extra": index["extra"], "world_size": index["world_size"], "path": str(path)}


def _load_optimizer(reader: _Reader, index: dict, model: nn.Module, optimizer: torch.optim.Optimizer, slices: dict) -> None:
    meta = index.get("optimizer")
    if meta is None:
        raise CheckpointError(f"{reader.path}: the checkpoint holds no optimizer state")
    names = {id(p): n for n, p in model.named_parameters()}
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{reader.path}: optimizer has {len(optimizer.param_groups)} param groups, checkpoint {len(saved_groups)}"
        )
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        mine = [names[id(p)] for p in group["params"]]
        if mine != saved["params"]:
            raise CheckpointError(f"{reader.path}: optimizer param group {i} holds other parameters than the checkpoint's")
        for k, v in saved["hyper"].items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
    by_param: dict[str, dict[str, list[tuple[int | None, str]]]] = {}
    for key in reader.where:
        if key.startswith("optim/"):
            base, g = split_key(key)
            _, rest = base.split("/", 1)
            name, state_key = rest.rsplit("/", 1)
            by_param.setdefault(name, {}).setdefault(state_key, []).append((g, key))
    scalars = meta.get("scalars", {})
    for name, p in model.named_parameters():
        entries = by_param.get(name, {})
        state: dict[str, object] = dict(scalars.get(name, {}))
        for state_key, keys in entries.items():
            if any(g is not None for g, _ in keys):
                state[state_key] = _gather_experts(reader, f"optim/{name}/{state_key}", slices[name], p).to(p.device)
            else:
                value = reader.get(keys[0][1])
                state[state_key] = (_vocab_rows(p, value) if value.dim() and value.shape[1:] == p.shape[1:] else value).to(p.device)
        if state:
            optimizer.state[p] = state


# ------------------------------------------------------------------ offline tools


def describe_checkpoint(path: str | os.PathLike) -> str:
    """Human-readable summary: step, world size, files, and every tensor group with its shape."""
    path = Path(path)
    index = read_index(path)
    lines = [f"{path}: step {index['step']}, written by {index['world_size']} rank(s), format {index['format']}"]
    for entry in index["files"]:
        lines.append(f"  {entry['file']}: {len(entry['tensors'])} tensors, {entry['bytes']} bytes, sha256 {entry['sha256'][:12]}")
    groups: dict[str, dict] = {}
    for entry in index["files"]:
        for key, meta in entry["tensors"].items():
            base, g = split_key(key)
            info = groups.setdefault(base, {"shape": meta["shape"], "dtype": meta["dtype"], "experts": 0})
            if g is not None:
                info["experts"] += 1
    lines.append("  tensors:")
    for base in sorted(groups):
        info = groups[base]
        per = f" x {info['experts']} experts" if info["experts"] else ""
        lines.append(f"    {base}: {info['dtype']} {tuple(info['shape'])}{per}")
    if index["experts"]:
        lines.append("  MoE expert parameters: " + ", ".join(f"{k} (E={v})" for k, v in sorted(index["experts"].items())))
    if index["extra"]:
        lines.append(f"  extra: {json.dumps(index['extra'])}")
    return "\n".join(lines)


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
    dst_root.mkdir(parents=True, exist_ok=True)
    final, tmp = _step_dirs(dst_root, index["step"])
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    infos = [_write_tensors(tmp / f"rank{r:05d}-of-{world_size:05d}.safetensors", t) for r, t in enumerate(files)]
    _finalize(tmp, final, {**index, "world_size": world_size, "files": infos}, keep)
    return final
