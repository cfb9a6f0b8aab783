"""The home tier's layout: each MoE layer's expert weights where they live between uses, and the
page-padded sizes the fast tier is budgeted in.

Legend: moeflow.types (``E`` experts). Every expert tensor of a layer is ``[E, ...]``; a ring
slot holds all of a layer's tensors, a cache slot one row ``[e]`` of each. Tensors carved out of
a slot start on a page (4096 bytes), so disk reads into them can use ``O_DIRECT``; that padding
is why a slot is larger than the bytes it holds, and why budgets are sized with ``slot_bytes``.

The home tensors are host copies (pinned when the fast device is CUDA) or, for the disk tier,
meta tensors standing for the ``DiskFile``'s tensors (under the keys ``disk_key`` names): shape
and dtype without data, so nothing reads the file except ``DiskFile.read`` (checked, into an
owned buffer; see ``moeflow.storage.disk`` for why no memory map). Each layer keeps a tiny stand-in
``GroupedExperts`` of its config (the math, not the data; see ``stand_in``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.disk import DiskFile
from moeflow.storage.tiers import PAGE, pin, tensor_bytes

__all__ = ["HomeLayer", "slot_bytes", "padded", "disk_key", "expert_tensors", "home_layers"]


@dataclass
class HomeLayer:
    """One MoE layer's experts in the home tier.

    Attributes:
        names: the expert tensors' names (``w_in``, ``w_out``, ...), in parameter order.
        home: name -> ``[E, ...]`` host tensor (pinned on CUDA), or for the disk tier a meta
            tensor of that shape and dtype (the data is read with ``DiskFile.read``).
        template: the stand-in ``GroupedExperts`` the store computes with (see ``stand_in``).
        num_experts: ``E``.
        expert_nbytes: unpadded bytes of one expert (all its tensors): what one cache load moves.
    """

    names: tuple[str, ...]
    home: dict[str, torch.Tensor]
    template: GroupedExperts
    num_experts: int
    expert_nbytes: int


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a whole page: the room a tensor takes in a slot."""
    return (nbytes + PAGE - 1) // PAGE * PAGE


def slot_bytes(experts: GroupedExperts, *, single: bool = False) -> int:
    """Fast-tier bytes one layer's experts take in a ring slot (``single``: one expert in a
    cache slot): each tensor rounded up to a 4096-byte page. Size budgets with it, e.g.
    ``fast_memory = 2 * slot_bytes(layer.experts)`` for a two-slot ring."""
    n = experts.num_experts
    return sum(padded(tensor_bytes(p) // (n if single else 1)) for p in experts.parameters())


def disk_key(layer: int, name: str) -> str:
    """The disk file's key of layer ``layer``'s expert tensor ``name``."""
    return f"layers.{layer}.{name}"


def stand_in(module: GroupedExperts) -> GroupedExperts:
    """A stand-in ``GroupedExperts`` with ``module``'s config and ``dim`` but one expert of
    hidden width 1: the store always calls it through ``functional_call`` with the real
    weights in place of its parameters, and its forward reads nothing else from itself but
    ``config`` and ``dim``. Tiny host tensors; built without touching the meta device (whose
    ``normal_`` imports the compiler stack, seconds on first use)."""
    dtype = next(module.parameters()).dtype
    return GroupedExperts(num_experts=1, dim=module.dim, hidden=1, config=module.config, dtype=dtype)


def expert_tensors(experts: Sequence[GroupedExperts]) -> list[dict[str, torch.Tensor]]:
    """Per layer, name -> its detached expert tensor; all of one dtype (a slot is one buffer
    carved into views, and the optimizer steps them alike)."""
    named = [{n: p.detach() for n, p in m.named_parameters()} for m in experts]
    dtypes = {t.dtype for d in named for t in d.values()}
    if len(dtypes) != 1:
        raise ValueError(f"all expert weights must share one dtype, got {sorted(map(str, dtypes))}")
    return named


def home_layers(experts: Sequence[GroupedExperts], named: list[dict[str, torch.Tensor]], disk: DiskFile | None,
                device: torch.device) -> list[HomeLayer]:
    """The home tier of each layer: meta tensors standing for ``disk``'s tensors (written from
    ``named`` under ``disk_key``) when given, else host copies of ``named``, pinned when
    ``device`` is CUDA."""
    layers = []
    for i, (module, tensors) in enumerate(zip(experts, named)):
        if disk is not None:
            home = {n: disk.spec(disk_key(i, n)) for n in tensors}
        else:
            home = {n: pin(t, device) for n, t in tensors.items()}
        expert_nbytes = sum(tensor_bytes(t) // module.num_experts for t in tensors.values())
        layers.append(HomeLayer(tuple(tensors), home, stand_in(module), module.num_experts, expert_nbytes))
    return layers
