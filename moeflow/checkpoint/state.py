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
from dataclasses import dataclass

import torch
from torch import nn

from moeflow.experts import GroupedExperts
from moeflow.experts.ffn import cut_hidden_slice
from moeflow.layer.moe import MoE
from moeflow.parallel.apply import gather_hidden_experts, gather_layer_objects

__all__ = ["ExpertLayout", "expert_slices", "model_tensors", "optimizer_tensors", "optimizer_type", "split_key", "vocab_shards"]


@dataclass(frozen=True)
class ExpertLayout:
    """How one stacked ``[slots, ...]`` expert parameter maps to global experts.

    ``ids``: the global expert of each local slot; ``saved``: whether this rank writes that
    slot's expert (a replicated expert is saved from its first replica only; a hidden-sharded one
    by the rank holding slice 0, after joining the slices); ``num_experts``: global E;
    ``shards``/``parts``: every expert split into ``shards`` hidden slices, slot ``i`` holding
    slice ``parts[i]`` (1 and zeros for whole experts); ``layer``/``kind``: the layer and
    parameter name (``"w_in"``, ``"w_out"``) the slices are joined and cut by."""

    ids: list[int]
    saved: list[bool]
    num_experts: int
    shards: int = 1
    parts: tuple[int, ...] = ()
    layer: MoE | None = None
    kind: str = ""

    def cut(self, slot: int, full: torch.Tensor) -> torch.Tensor:
        """The part of the whole expert tensor ``full`` that local slot ``slot`` holds."""
        if self.shards == 1:
            return full
        assert self.layer is not None
        return cut_hidden_slice(self.kind, full, self.shards, self.parts[slot], self.layer.experts.halves)


def expert_slices(model: nn.Module) -> dict[str, ExpertLayout]:
    """Name -> ``ExpertLayout`` for the stacked ``[slots, ...]`` parameters of every
    ``GroupedExperts`` inside a ``moeflow.MoE`` (``MoE.expert_slots``)."""
    out: dict[str, ExpertLayout] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoE) and not getattr(module.experts, "resident", True):
            raise ValueError(
                f"MoE layer {prefix or '<model>'} keeps its experts outside the module (an ExpertStore of moeflow.storage): "
                "a moeflow checkpoint would lack them; save model.state_dict() (it includes the stored "
                "experts) or load the experts back into memory first"
            )
        if isinstance(module, MoE) and isinstance(module.experts, GroupedExperts):
            ids, saved = module.expert_slots()
            n, parts = module.hidden_shards()
            for name, _ in module.experts.named_parameters():
                full = f"{prefix}.experts.{name}" if prefix else f"experts.{name}"
                out[full] = ExpertLayout(ids, saved, module.config.num_experts, n, tuple(parts),
                                         module if n > 1 else None, name)
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


def _expand(prefix: str, name: str, tensor: torch.Tensor, layout: ExpertLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, whole expert tensor)`` of every expert this rank saves. Hidden-sharded layers join
    their slices first: a collective, so every rank expands the same tensors in the same order."""
    if layout.shards > 1:
        assert layout.layer is not None
        for g, full in gather_hidden_experts(layout.layer, layout.kind, tensor).items():
            yield f"{prefix}/{name}@{g}", full
        return
    for i, (g, keep) in enumerate(zip(layout.ids, layout.saved)):
        if keep:
            yield f"{prefix}/{name}@{g}", tensor[i]


def model_tensors(model: nn.Module, *, include_dense: bool) -> dict[str, torch.Tensor]:
    """This process's share of the model: its experts, plus dense tensors if ``include_dense``.
    A parameter or buffer name holding ``@`` is refused: ``@`` marks the expert in a key
    (``param/<name>@<g>``), and ``index.json``'s check refuses such a key on load."""
    held = [name for name, _ in [*model.named_parameters(), *model.named_buffers()] if "@" in name]
    if held:
        raise ValueError(f"cannot checkpoint {held[0]!r}: '@' marks the expert in a checkpoint's keys "
                         "(param/<name>@<expert>), so the checkpoint could not be loaded; rename the module")
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
    (the optimizer's type, param groups' hyper-parameters and which parameters they hold,
    non-tensor state)."""
    layouts = expert_slices(model)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    if any(id(p) not in names for p in optimizer.state):
        raise ValueError("the optimizer holds a parameter that is not in the model")
    _check_sliced_state_agrees(model, optimizer, layouts)
    # in model order and sorted keys: joining hidden slices is a collective (same order everywhere)
    for name, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        is_expert = name in layouts
        for key in sorted(state):
            value = state[key]
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
    return tensors, {"type": optimizer_type(optimizer), "param_groups": groups, "scalars": _jsonable(scalars)}


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's class as the index records it (loading refuses another class)."""
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _check_sliced_state_agrees(model: nn.Module, optimizer: torch.optim.Optimizer, layouts: dict[str, ExpertLayout]) -> None:
    """Joining hidden slices is a collective per state tensor: make sure every rank of each
    hidden-sharded layer's group holds the same state entries first (one all-gather per layer),
    so that a difference raises on every rank instead of leaving them waiting on each other."""
    entries: dict[int, tuple[MoE, list[str]]] = {}
    for name, p in model.named_parameters():
        layout = layouts.get(name)
        if layout is None or layout.shards == 1:
            continue
        assert layout.layer is not None
        state = optimizer.state.get(p, {})
        mine = entries.setdefault(id(layout.layer), (layout.layer, []))[1]
        mine += [f"{name}/{k}" for k in sorted(state) if isinstance(state[k], torch.Tensor) and state[k].shape == p.shape]
    for layer, mine in entries.values():
        every = gather_layer_objects(layer, mine)
        if any(other != mine for other in every):
            raise ValueError("the optimizer state of hidden-sharded experts differs between ranks (every rank must "
                             "hold the same entries to join the slices): "
                             + "; ".join(f"rank {r}: {e}" for r, e in enumerate(every)))


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
