"""Why a plain ``model.state_dict()`` of an expert- or vocabulary-parallel model cannot be saved
with ``torch.distributed.checkpoint`` (DCP), and the guard that makes DCP say so.

Under expert parallelism every rank's ``layer.experts.w_in`` is its own ``[slots, D, F]`` part
of the experts, under the same key. DCP takes a plain tensor that several ranks hold under one
key for a replicated one: it writes one rank's copy and loads it on every rank, so the other
ranks' experts are silently replaced. ``model.state_dict()`` must stay the local tensors, though:
single-process code, ``torch.save`` per rank, ``moeflow.storage`` and ``load_state_dict`` read it.

So ``expert_parallel`` and the vocabulary-parallel modules register ``mark_rank_local`` as a
state-dict post-hook: it returns those entries as ``RankLocalTensor``, a tensor subclass that is
a plain tensor to everything (its values, every op, ``load_state_dict``; ``torch.save`` writes it
as a plain tensor and ``torch.load(weights_only=True)`` reads it back) except DCP. To DCP's
``save``, ``async_save`` and ``load`` it raises ``TypeError`` naming the key and the way that
works: ``moeflow.parallel.dcp_state_dict``. Tensors computed from it stay ``RankLocalTensor``
(``clone()``, ``async_save``'s staging copy), so the guard survives copies. ``state_dict(
keep_vars=True)`` returns the parameters themselves, which are never wrapped.
"""

from __future__ import annotations

import copy
from typing import NoReturn

import torch
from torch import nn

from moeflow.layer.moe import MoE
from moeflow.parallel.dcp.layout import holds_every_expert

__all__ = ["RankLocalTensor", "mark_rank_local"]

_ADVICE = ("torch.distributed.checkpoint would store every rank's part under this one key and load one rank's "
           "part on every rank. Save and load moeflow.parallel.dcp_state_dict(model, optimizer) instead (global "
           "shapes, each expert once; then moeflow.parallel.load_dcp_state_dict after dcp.load), or use "
           "moeflow.checkpoint.save_checkpoint")


class RankLocalTensor(torch.Tensor):
    """A plain tensor holding only this rank's part of an expert- or vocabulary-parallel
    parameter (``model.state_dict()`` of such a model); DCP refuses it (module docstring)."""

    moeflow_part: str  # what this rank holds, for the error (absent on tensors computed from it)

    def __reduce_ex__(self, proto):  # type: ignore[no-untyped-def,override]
        return _plain(self).__reduce_ex__(proto)  # written as a plain tensor

    def __deepcopy__(self, memo):  # type: ignore[no-untyped-def,override]
        out = _plain(self).__deepcopy__(memo).as_subclass(type(self))
        out.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return out

    def _refuse(self, fqn: str | None = None) -> NoReturn:
        part = getattr(self, "moeflow_part", "a part of an expert- or vocabulary-parallel parameter")
        what = f"{fqn!r} of model.state_dict()" if fqn else "a tensor of model.state_dict()"
        # TypeError: DCP turns a ValueError from the chunk list into "invalid checkpoint metadata"
        raise TypeError(f"{what} holds only this rank's part ({part}): {_ADVICE}")

    # DCP's checkpointable protocol, every entry refused
    def __create_write_items__(self, fqn: str, obj: object) -> NoReturn:
        self._refuse(fqn)

    def __create_chunk_list__(self) -> NoReturn:
        self._refuse()

    def __get_tensor_shard__(self, index: object) -> NoReturn:
        self._refuse(getattr(index, "fqn", None))


def _plain(t: torch.Tensor) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


def _rank_local_entries(module: nn.Module) -> dict[str, str]:
    """``{state-dict key under module: what this rank holds}`` of the rank-local tensors of an
    expert-parallel ``MoE`` layer or a vocabulary-parallel module; ``{}`` when it holds all."""
    if isinstance(module, MoE):
        if holds_every_expert(module):
            return {}
        slots, _ = module.expert_slots()
        n, parts = module.hidden_shards()
        E = module.config.num_experts
        held = f"experts {slots} of {E}" if n == 1 else f"hidden slices {parts} of {n} of experts {slots} of {E}"
        return {f"experts.{name}": held for name, _ in module.experts.named_parameters()}
    weight = module.weight
    rows, start = int(weight.moeflow_vocab_size), int(weight.moeflow_vocab_start)  # type: ignore[attr-defined]
    if weight.shape[0] == rows:
        return {}
    return {"weight": f"vocabulary rows [{start}, {start + weight.shape[0]}) of {rows}"}


def mark_rank_local(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook (``module.register_state_dict_post_hook``) of an expert-parallel
    ``MoE`` layer or a vocabulary-parallel module: its rank-local entries become
    ``RankLocalTensor`` (parameters themselves, from ``keep_vars=True``, are left alone)."""
    for key, part in _rank_local_entries(module).items():
        value = state_dict.get(prefix + key)
        if value is None or isinstance(value, nn.Parameter):
            continue
        marked = value.as_subclass(RankLocalTensor)
        marked.moeflow_part = part
        state_dict[prefix + key] = marked
