"""Model and optimizer state as flat, world-size-independent tensor dictionaries.

Keys:
- ``param/<name>``: a dense (replicated) parameter or buffer, ``buffer/<name>`` for buffers;
- ``param/<name>@<g>``: global expert ``g`` of an expert parameter ``<name>`` (whose leading
  dimension is the experts held by this process);
- ``optim/<name>/<key>`` and ``optim/<name>/<key>@<g>``: the optimizer state of that parameter
  (tensors shaped like the parameter are split per expert like it; others, such as Adam's
  ``step``, are kept whole).

So a checkpoint written by any number of ranks holds every expert exactly once, under its
global index, and any layout of ranks can pick out the experts it holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moeflow.experts import GroupedExperts
from moeflow.layer.moe import MoE
from moeflow.storage.store import StoredExperts

__all__ = ["expert_slices", "model_tensors", "optimizer_tensors", "split_key", "vocab_shards"]


def expert_slices(model: nn.Module) -> dict[str, tuple[list[int], list[bool], int]]:
    """Name -> ``(global expert of each local slot, whether that slot is saved, global E)`` for
    the stacked ``[slots, ...]`` parameters of every ``GroupedExperts`` inside a ``moeflow.MoE``
    (``MoE.expert_slots``: a replicated expert is saved from its first replica only)."""
    out: dict[str, tuple[list[int], list[bool], int]] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoE) and isinstance(module.experts, StoredExperts):
            raise ValueError(
                f"MoE layer {prefix or '<model>'} keeps its experts in an ExpertStore (moeflow.storage): "
                "a moeflow checkpoint would lack them; save model.state_dict() (it includes the stored "
                "experts) or load the experts back into memory first"
            )
        if isinstance(module, MoE) and isinstance(module.experts, GroupedExperts):
            ids, saved = module.expert_slots()
            for name, _ in module.experts.named_parameters():
                full = f"{prefix}.experts.{name}" if prefix else f"experts.{name}"
                out[full] = (ids, saved, module.config.num_experts)
    return out


def vocab_shards(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    """``(key, shard)`` of every vocabulary-parallel parameter and its optimizer state shaped like
    it, in the same order on every rank: the checkpoint stores them gathered under ``key``."""
    out = []
    for name, p in model.named_parameters():
        if getattr(p, "moeflow_vocab_shard", False):
            out.append((f"param/{name}", p.detach()))
            state = optimizer.state.get(p, {}) if optimizer is not None else {}
            for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape):
                out.append((f"optim/{name}/{key}", state[key].detach()))
    return out


def split_key(key: str) -> tuple[str, int | None]:
    """``'param/x@3'`` -> ``('param/x', 3)``; no expert suffix -> ``(key, None)``."""
    if "@" in key:
        base, g = key.rsplit("@", 1)
        return base, int(g)
    return key, None


def _expand(prefix: str, name: str, tensor: torch.Tensor, layout: tuple[list[int], list[bool], int]) -> Iterator[tuple[str, torch.Tensor]]:
    ids, saved, _ = layout
    for i, (g, keep) in enumerate(zip(ids, saved)):
        if keep:
            yield f"{prefix}/{name}@{g}", tensor[i]


def model_tensors(model: nn.Module, *, include_dense: bool) -> dict[str, torch.Tensor]:
    """This process's share of the model: its experts, plus dense tensors if ``include_dense``."""
    layouts = expert_slices(model)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name in layouts:
            out.update(_expand("param", name, p.detach(), layouts[name]))
        elif getattr(p, "moeflow_expert", False):
            raise TypeError(
                f"cannot checkpoint expert parameter {name!r}: only GroupedExperts (stacked [e, ...] "
                "weights) have a world-size-independent layout"
            )
        elif getattr(p, "moeflow_vocab_shard", False):
            continue  # saved gathered (``vocab_tensors``)
        elif include_dense:
            out[f"param/{name}"] = p.detach()
    if include_dense:
        for name, b in model.named_buffers():
            out[f"buffer/{name}"] = b.detach()
    return out


def optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, include_dense: bool
) -> tuple[dict[str, torch.Tensor], dict]:
    """Optimizer state as tensors keyed like ``model_tensors`` and the JSON-able rest
    (param groups' hyper-parameters and which parameters they hold, non-tensor state)."""
    layouts = expert_slices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for p, state in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            raise ValueError("the optimizer holds a parameter that is not in the model")
        is_expert = name in layouts
        for key, value in state.items():
            if getattr(p, "moeflow_vocab_shard", False) and isinstance(value, torch.Tensor) and value.shape == p.shape:
                continue  # saved gathered (``vocab_tensors``)
            if isinstance(value, torch.Tensor) and is_expert and value.shape == p.shape:
                tensors.update(_expand("optim", f"{name}/{key}", value.detach(), layouts[name]))
            elif not include_dense:
                continue  # whole-tensor state (e.g. Adam's step) is the same on every rank: rank 0 keeps it
            elif isinstance(value, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = value.detach()
            else:
                scalars.setdefault(name, {})[key] = value
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in group["params"]], "hyper": _jsonable(hyper)})
    return tensors, {"param_groups": groups, "scalars": _jsonable(scalars)}


def _jsonable(obj: object) -> object:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint index: {obj!r}")
