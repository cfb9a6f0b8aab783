"""moeflow checkpoints to and from PyTorch distributed checkpoints (DCP), both ways, exact,
without building a model (``moeflow convert SRC --to-dcp DIR``, ``--from-dcp DIR DST``).

The DCP side has the layout of ``moeflow.parallel.dcp_state_dict`` (see there), so a converted
checkpoint loads into a model on any world size with ``dcp.load(dcp_state_dict(model, opt))``,
and a DCP checkpoint saved that way converts to moeflow's format:

- ``param/<n>``, ``buffer/<n>`` <-> ``model[n]`` (the ``"moeflow"`` JSON entry lists the buffers);
- the experts ``param/<n>@<g>`` <-> ``model[n]`` stacked to ``[E, ...]`` (its ``"experts"``);
- ``optim/<n>/<k>`` (``@<g>`` stacked likewise) and the index's non-tensor state <->
  ``optim["state"][n][k]``; its param groups <-> ``optim["param_groups"]`` (hyper-parameters
  with ``"params"``: the parameter names);
- what only a moeflow checkpoint records travels along: ``rng/<rank>/<device>`` <-> ``rng[...]``,
  and the step, ``extra``, the world size at save and the optimizer's type in the ``"moeflow"``
  JSON entry.

A DCP checkpoint from ``dcp_state_dict`` records no step: pass ``step=`` (``--step``). The moeflow
checkpoint is written as one file (``moeflow convert --world-size`` regroups it); all reading and
writing of DCP directories is ``moeflow.parallel.dcp.files``, of moeflow's ``moeflow.checkpoint``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moeflow.checkpoint.format import FORMAT as CHECKPOINT_FORMAT
from moeflow.checkpoint.format import CheckpointError, _Reader, checkpoint_dir, read_index
from moeflow.checkpoint.io import _begin, _finalize, _owned, _step_dirs, _write_tensors
from moeflow.checkpoint.state import _jsonable, split_key
from moeflow.parallel.dcp.state import FORMAT as DCP_FORMAT
from moeflow.parallel.dcp.files import read_dcp_dir, write_dcp_dir

__all__ = ["moeflow_to_dcp", "dcp_to_moeflow"]


def moeflow_to_dcp(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write moeflow checkpoint ``src`` (a checkpoint directory, or a root: its latest) as a DCP
    checkpoint directory ``dst``. Returns ``dst``."""
    src = checkpoint_dir(src)
    index = read_index(src)
    reader = _Reader(src, index)
    experts: dict[str, int] = index["experts"]
    model: dict[str, torch.Tensor] = {}
    optim_state: dict[str, dict] = {}
    rng: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}
    for key in reader.where:
        base, g = split_key(key)
        if g is not None:
            per_expert.setdefault(base, {})[g] = reader.get(key)
            continue
        kind, rest = base.split("/", 1)
        if kind == "rng":
            rng[rest] = reader.get(key)
        elif kind in ("param", "buffer"):
            model[rest] = reader.get(key)
        else:
            name, state_key = rest.rsplit("/", 1)
            optim_state.setdefault(name, {})[state_key] = reader.get(key)
    for base, by_expert in per_expert.items():
        kind, rest = base.split("/", 1)
        name = rest.rsplit("/", 1)[0] if kind == "optim" else rest
        E = experts[name]
        missing = sorted(set(range(E)) - set(by_expert))
        if missing:
            raise CheckpointError(f"{src}: experts {missing} of {base} are missing")
        whole = torch.stack([by_expert[g] for g in range(E)])
        if kind == "optim":
            optim_state.setdefault(name, {})[rest.rsplit("/", 1)[1]] = whole
        else:
            model[name] = whole
    buffers = sorted(key.split("/", 1)[1] for key in reader.where if key.startswith("buffer/"))
    meta = {"format": DCP_FORMAT, "experts": experts, "buffers": buffers, "step": index["step"],
            "extra": index["extra"], "world_size": index["world_size"]}
    optim = index["optimizer"]
    if optim is not None and "type" in optim:
        meta["optimizer_type"] = optim["type"]
    state: dict = {"model": model, "moeflow": json.dumps(meta, sort_keys=True)}
    if rng:
        state["rng"] = rng
    if optim is not None:
        for name, values in optim["scalars"].items():
            optim_state.setdefault(name, {}).update(values)
        groups = [{**group["hyper"], "params": group["params"]} for group in optim["param_groups"]]
        state["optim"] = {"state": optim_state, "param_groups": groups}
    return write_dcp_dir(dst, state)


def _is_ours(entry: object) -> bool:
    """Whether ``entry`` is a state ``dcp_state_dict`` wrote (its ``"moeflow"`` description)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("moeflow"), str):
        return False
    try:
        return json.loads(entry["moeflow"]).get("format") == DCP_FORMAT
    except (json.JSONDecodeError, AttributeError):
        return False


def _moeflow_part(saved: dict, src: object) -> dict:
    """The part of a DCP checkpoint that ``dcp_state_dict`` wrote: the whole of it, or the one
    top-level entry that holds it (``DCPState`` saved under a key, beside other state)."""
    if _is_ours(saved):
        return saved
    found = [key for key, value in saved.items() if _is_ours(value)]
    if not found:
        raise CheckpointError(f"{src}: holds no {DCP_FORMAT} state (no 'moeflow' description): save it from "
                              "moeflow.parallel.dcp_state_dict or DCPState, which record which tensors are experts")
    if len(found) > 1:
        raise CheckpointError(f"{src}: entries {found} each hold a {DCP_FORMAT} state; convert one model at a time")
    return saved[found[0]]


def _checked_meta(meta: dict, src: object) -> dict:
    """The ``"moeflow"`` description of a DCP checkpoint, checked before use (the checkpoint
    written from it is checked again, like any, when it is read)."""
    experts, buffers = meta.get("experts"), meta.get("buffers")
    if not isinstance(experts, dict) or any(isinstance(E, bool) or not isinstance(E, int) or E < 1
                                            for E in experts.values()):
        raise CheckpointError(f"{src}: its 'moeflow' description has experts={str(experts)[:60]!r}, expected "
                              "{parameter: expert count}")
    if not isinstance(buffers, list) or not all(isinstance(b, str) for b in buffers):
        raise CheckpointError(f"{src}: its 'moeflow' description has buffers={str(buffers)[:60]!r}, expected a list "
                              "of names")
    if not isinstance(meta.get("extra", {}), dict) or not isinstance(meta.get("optimizer_type", ""), str):
        raise CheckpointError(f"{src}: its 'moeflow' description has a malformed 'extra' or 'optimizer_type'")
    return meta


def dcp_to_moeflow(src: str | os.PathLike, dst_root: str | os.PathLike, *, step: int | None = None,
                   keep: int = 3) -> Path:
    """Write DCP checkpoint directory ``src`` (saved from ``dcp_state_dict`` or ``DCPState``, at
    the top or under one key, or by ``moeflow_to_dcp``) as a moeflow checkpoint under
    ``dst_root``. ``step`` names the checkpoint; by default the step ``src`` records
    (``moeflow_to_dcp`` records one). Returns the checkpoint directory."""
    state = _moeflow_part(read_dcp_dir(src), src)
    meta = _checked_meta(json.loads(state["moeflow"]), src)
    if step is None:
        step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int (the DCP checkpoint {src} records none), got {step!r}")
    experts, buffers = meta["experts"], set(meta["buffers"])
    model = state.get("model", {})
    tensors: dict[str, torch.Tensor] = {}

    def put(base: str, name: str, value: torch.Tensor) -> None:
        """``value`` under ``base``, split per expert when it is an expert tensor or shaped like one."""
        if name in experts and name in model and value.shape == model[name].shape:
            if value.shape[0] != experts[name]:
                raise CheckpointError(f"{src}: {base} has shape {tuple(value.shape)}, expected {experts[name]} experts")
            tensors.update({f"{base}@{g}": value[g] for g in range(experts[name])})
        else:
            tensors[base] = value

    for name, value in model.items():
        put(f"{'buffer' if name in buffers else 'param'}/{name}", name, value)
    for key, value in state.get("rng", {}).items():
        tensors[f"rng/{key}"] = value
    optimizer = None
    if "optim" in state:
        scalars: dict[str, dict] = {}
        for name, entries in state["optim"]["state"].items():
            for key, value in entries.items():
                if isinstance(value, torch.Tensor):
                    put(f"optim/{name}/{key}", name, value)
                else:
                    scalars.setdefault(name, {})[key] = value
        groups = [{"params": list(g["params"]), "hyper": _jsonable({k: v for k, v in g.items() if k != "params"})}
                  for g in state["optim"]["param_groups"]]
        optimizer = {"param_groups": groups, "scalars": _jsonable(scalars)}
        if "optimizer_type" in meta:
            optimizer["type"] = meta["optimizer_type"]
    dst_root = Path(dst_root)
    final, tmp = _step_dirs(dst_root, step)
    _begin(dst_root, final, tmp)
    info = _write_tensors(tmp / "rank00000-of-00001.safetensors", _owned(tensors))
    index = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": meta.get("world_size", 1),
             "experts": experts, "files": [info], "optimizer": optimizer, "extra": meta.get("extra", {})}
    _finalize(tmp, final, index, keep)
    return final
