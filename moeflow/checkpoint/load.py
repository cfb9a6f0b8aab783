"""Loading a checkpoint into a model and its optimizer, whatever world size wrote it.

Each rank reads only the experts it holds now (``MoE.expert_slots``: any placement, replicas,
hidden slices), cut from the whole experts saved under ``...@<g>``, and the rows of a
vocabulary-split table it holds. Every tensor the model has must be in the checkpoint with
the same shape and dtype, and every model tensor the checkpoint has must be in the model: a
mismatch raises ``CheckpointError`` naming file, key and mismatch, and nothing is ever filled
with zeros. Files are read and verified through ``moeflow.checkpoint.format``.

The optimizer must be of the type that wrote the checkpoint (recorded since the type was, and
implied by the hyper-parameter names before), hold the same parameters in the same groups, and
every saved hyper-parameter must be one of its own with a value of the type it has now (a
number where it has a number, a bool where a bool, a list of as many where a tuple); a
hyper-parameter the checkpoint lacks (a flag newer torch versions added) keeps its value.

All of it is checked before the model or the optimizer is touched, so a refused checkpoint
leaves both as they were: a first pass runs the whole load on tensors of the ``meta`` device
built from ``index.json``'s shapes and dtypes (names, shapes, dtypes, expert slices, vocabulary
rows, the optimizer's state; no tensor data held), verifying each file it will read as it first
touches it (size, checksum, and its tensors' names, shapes and dtypes against ``index.json``);
only then are the tensors read and copied.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn

from moeflow.checkpoint.format import CheckpointError, _Reader, checkpoint_dir, read_index
from moeflow.checkpoint.state import ExpertLayout, expert_slices, optimizer_type, split_key
from moeflow.parallel.comm import ProcessGroup, process_position

__all__ = ["load_checkpoint"]


def _load_into(target: torch.Tensor, value: torch.Tensor, key: str, file: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise CheckpointError(f"{file}: {key} has shape {tuple(value.shape)}, the model expects {tuple(target.shape)}")
    if value.dtype != target.dtype:
        raise CheckpointError(f"{file}: {key} has dtype {value.dtype}, the model expects {target.dtype}")
    if value.is_meta:  # the checking pass (_MetaReader): nothing to copy
        return
    with torch.no_grad():
        target.copy_(value)


class _MetaReader:
    """``_Reader``'s face for the checking pass of ``load_checkpoint``: ``get`` is
    ``_Reader.meta`` (the file verified, a ``meta`` tensor of the listed shape and dtype)."""

    def __init__(self, reader: _Reader) -> None:
        self.path, self.where, self.has, self.get = reader.path, reader.where, reader.has, reader.meta


def _on(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` on ``p``'s device (a ``meta`` one of the checking pass stays there)."""
    return value if value.is_meta else value.to(p.device)


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
    path = checkpoint_dir(path)
    index = read_index(path)
    reader = _Reader(path, index)
    rank, _ = process_position(group)
    slices = expert_slices(model)
    hyper = _checked_hyper(reader, index, model, optimizer) if optimizer is not None else []
    # the checking pass: every check of the load below, on meta tensors (module docstring)
    dry = _MetaReader(reader)
    _load_model(dry, index, model, slices)  # type: ignore[arg-type]
    if optimizer is not None:
        _optimizer_states(dry, index, model, slices)  # type: ignore[arg-type]
    cpu, cuda = f"rng/rank{rank}/cpu", f"rng/rank{rank}/cuda"
    rng = [key for key in (cpu, cuda) if restore_rng and reader.has(key)]
    for key in rng:
        dry.get(key)

    _load_model(reader, index, model, slices)
    if optimizer is not None:
        _load_optimizer(reader, index, model, optimizer, slices, hyper)
    if cpu in rng:
        torch.set_rng_state(reader.get(cpu))
        if cuda in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(reader.get(cuda))
    return {"step": index["step"], "extra": index["extra"], "world_size": index["world_size"], "path": str(path)}


def _load_model(reader: _Reader, index: dict, model: nn.Module, slices: dict) -> None:
    """Every parameter and buffer of ``model`` from ``reader`` (a ``_MetaReader``: checked only)."""
    path = reader.path
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


def _fits(now: object, saved: object) -> bool:
    """Whether the JSON value ``saved`` may replace the hyper-parameter value ``now``."""
    if isinstance(now, bool) or now is None:
        return isinstance(saved, bool) or (now is None and (saved is None or isinstance(saved, (int, float, str))))
    if isinstance(now, (int, float)) or (isinstance(now, torch.Tensor) and now.numel() == 1):
        return isinstance(saved, (int, float)) and not isinstance(saved, bool) and math.isfinite(saved)
    if isinstance(now, (tuple, list)):
        return isinstance(saved, list) and len(saved) == len(now) and all(_fits(a, b) for a, b in zip(now, saved))
    return isinstance(now, str) and isinstance(saved, str)


def _checked_hyper(reader: _Reader, index: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's saved hyper-parameters, checked against ``optimizer`` (type, groups,
    parameters, names and value types) before anything is loaded."""
    where = f"{reader.path}/index.json"
    meta = index["optimizer"]
    if meta is None:
        raise CheckpointError(f"{reader.path}: the checkpoint holds no optimizer state")
    mine = optimizer_type(optimizer)
    if meta.get("type", mine) != mine:
        raise CheckpointError(f"{where}: optimizer.type is {meta['type']!r}, but it is loaded into a {mine}")
    names = {id(p): n for n, p in model.named_parameters()}
    saved_groups = meta["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{reader.path}: optimizer has {len(optimizer.param_groups)} param groups, checkpoint {len(saved_groups)}"
        )
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if [names.get(id(p)) for p in group["params"]] != saved["params"]:
            raise CheckpointError(f"{reader.path}: optimizer param group {i} holds other parameters than the checkpoint's")
        own = sorted(k for k in group if k != "params")
        for k, v in saved["hyper"].items():
            if k not in own:
                raise CheckpointError(f"{where}: optimizer.param_groups[{i}].hyper[{k!r}] is not a hyper-parameter of "
                                      f"{type(optimizer).__name__} (it has {own}): written by another optimizer?")
            if not _fits(group[k], v):
                raise CheckpointError(f"{where}: optimizer.param_groups[{i}].hyper[{k!r}]={v!r} does not fit "
                                      f"{type(optimizer).__name__}'s {k}={group[k]!r}")
    model_names = set(names.values())
    unknown = sorted(set(meta["scalars"]) - model_names) + sorted(
        k for k in reader.where if k.startswith("optim/") and split_key(k)[0][6:].rsplit("/", 1)[0] not in model_names)
    if unknown:
        raise CheckpointError(f"{reader.path}: optimizer state for parameters the model does not have: {unknown[:5]}")
    return [saved["hyper"] for saved in saved_groups]


def _load_optimizer(reader: _Reader, index: dict, model: nn.Module, optimizer: torch.optim.Optimizer, slices: dict,
                    hyper: list[dict]) -> None:
    """Read every state tensor first, then set the hyper-parameters (checked by
    ``_checked_hyper``) and the state: a damaged file leaves the optimizer as it was."""
    states = _optimizer_states(reader, index, model, slices)
    for group, saved in zip(optimizer.param_groups, hyper):
        for k, v in saved.items():
            now = group[k]
            group[k] = (tuple(v) if isinstance(now, tuple) else
                        torch.tensor(v, dtype=now.dtype, device=now.device) if isinstance(now, torch.Tensor) else v)
    for p, state in states.items():
        optimizer.state[p] = state


def _optimizer_states(reader: _Reader, index: dict, model: nn.Module, slices: dict
                      ) -> dict[nn.Parameter, dict[str, object]]:
    """Each parameter's optimizer state from ``reader``, on the parameter's device (from a
    ``_MetaReader``: checked, left on ``meta``)."""
    meta = index["optimizer"]
    by_param: dict[str, dict[str, list[tuple[int | None, str]]]] = {}
    for key in reader.where:
        if key.startswith("optim/"):
            base, g = split_key(key)
            _, rest = base.split("/", 1)
            name, state_key = rest.rsplit("/", 1)
            by_param.setdefault(name, {}).setdefault(state_key, []).append((g, key))
    scalars = meta["scalars"]
    states: dict[nn.Parameter, dict[str, object]] = {}
    for name, p in model.named_parameters():
        entries = by_param.get(name, {})
        state: dict[str, object] = dict(scalars.get(name, {}))
        for state_key, keys in entries.items():
            if any(g is not None for g, _ in keys):
                if name not in slices or any(g is None for g, _ in keys):
                    raise CheckpointError(f"{reader.path}: optimizer state {name}/{state_key} is split per expert, "
                                          f"but {name} is not an expert parameter of the model")
                value = _gather_experts(reader, f"optim/{name}/{state_key}", slices[name], p)
                if value.shape != p.shape:
                    raise CheckpointError(f"{reader.path}: optimizer state {name}/{state_key} has shape "
                                          f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")
                state[state_key] = _on(p, value)
            else:
                value = reader.get(keys[0][1])
                rows = value.dim() and value.shape[1:] == p.shape[1:]  # shaped like the parameter: its rows
                state[state_key] = _on(p, _vocab_rows(p, value) if rows else value)
        if state:
            states[p] = state
    return states
