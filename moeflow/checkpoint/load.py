"""Loading a checkpoint into a model and its optimizer, whatever world size wrote it.

Each rank reads only the experts it holds now (``MoE.expert_slots``: any placement, replicas,
hidden slices), cut from the whole experts saved under ``...@<g>``, and the rows of a
vocabulary-split table it holds. Every tensor the model has must be in the checkpoint with
the same shape and dtype, and every model tensor the checkpoint has must be in the model: a
mismatch raises ``CheckpointError`` naming file, key and mismatch, and nothing is ever filled
with zeros. Files are read and verified through ``moeflow.checkpoint.format``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from moeflow.checkpoint.format import CheckpointError, _Reader, latest_checkpoint, read_index
from moeflow.checkpoint.state import ExpertLayout, expert_slices, split_key
from moeflow.parallel.comm import ProcessGroup, process_position

__all__ = ["load_checkpoint"]


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

