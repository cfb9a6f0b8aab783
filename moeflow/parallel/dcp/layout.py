"""Where this process's expert and vocabulary tensors sit in the global tensors a
``torch.distributed.checkpoint`` (DCP) checkpoint stores (legend: moeflow.types).

A stacked expert tensor ``[slots, ...]`` is stored as the global ``[E, ...]`` tensor of whole
experts, the tensor a single process holds: slot ``i`` holds expert ``slot_experts[i]``
(``MoE.expert_slots``, any placement) or one hidden slice of it (``MoE.hidden_shards``; the slice
layout is ``moeflow.experts.ffn.cut_hidden_slice``, read here, not restated). A vocabulary shard
``[v, D]`` is stored as the global ``[V, D]`` table, at its first row. Each becomes a
``ChunkedTensor`` whose chunks are views of the local tensor, so DCP writes and loads them in
place; on a process that holds everything, in order, the tensor stays as it is.

Which slot writes: an expert's first replica (``slot_primary``, as in moeflow's own
checkpoints); every hidden slice (each exists once: load-aware placement, the only source of
replicas, refuses hidden-sharded layers). Consecutive whole experts form one chunk, so plain
expert parallelism gives one chunk per tensor: the parameter itself.
"""

from __future__ import annotations

import functools

import torch

from moeflow.experts import GroupedExperts
from moeflow.experts.ffn import cut_hidden_slice, join_hidden_slices
from moeflow.layer.moe import MoE
from moeflow.parallel.dcp.tensor import ChunkedTensor

__all__ = ["check_expert_layer", "expert_view", "holds_every_expert", "vocab_view"]

# (local offsets, global offsets, sizes) of one box inside one expert
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def holds_every_expert(layer: MoE) -> bool:
    """Whether this process holds every whole expert of ``layer``, in order: its stacked tensors
    are then the global ones."""
    slots, _ = layer.expert_slots()
    return layer.hidden_shards()[0] == 1 and slots == list(range(layer.config.num_experts))


def check_expert_layer(prefix: str, layer: MoE) -> None:
    """Raise when ``layer``'s experts have no stacked, world-size-independent layout."""
    if not getattr(layer.experts, "resident", True):
        raise ValueError(f"MoE layer {prefix or '<model>'} keeps its experts outside the module (an ExpertStore of "
                         "moeflow.storage): load them back into memory before taking a DCP state dict")
    if not isinstance(layer.experts, GroupedExperts):
        raise TypeError(f"MoE layer {prefix or '<model>'} has {type(layer.experts).__name__} experts: only "
                        "GroupedExperts (stacked [slots, ...] weights) have a world-size-independent layout")


def _runs(profile: list[int]) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of the maximal runs of consecutive values."""
    runs: list[tuple[int, int, int]] = []
    for k, g in enumerate(profile):
        if runs and g == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((k, g, 1))
    return runs


@functools.lru_cache(maxsize=256)
def _slice_boxes(name: str, whole: tuple[int, ...], n: int, part: int, halves: int) -> tuple[Box, ...]:
    """The boxes of hidden slice ``part`` of ``n`` of one whole expert tensor ``name`` (shape
    ``whole``), found by cutting coordinate grids with ``cut_hidden_slice``. Dims whose size the
    slice keeps are kept as they are (its contract); the others are probed with the kept dims
    reduced to 1, so the probe is as small as one row or column."""
    local = cut_hidden_slice(name, torch.empty(whole, device="meta"), n, part, halves).shape
    if len(local) != len(whole):
        raise ValueError(f"a hidden slice of {name} changed the rank: {tuple(whole)} -> {tuple(local)}")
    probe = tuple(w if w != s else 1 for w, s in zip(whole, local))
    profiles = []
    for d, (w, s) in enumerate(zip(whole, local)):
        if w == s:
            profiles.append(list(range(w)))
            continue
        along = [w if i == d else 1 for i in range(len(whole))]
        # host-side layout arithmetic: which coordinates a slice keeps
        coords = cut_hidden_slice(name, torch.arange(w, device="cpu").view(along).expand(probe), n, part, halves)
        first = coords[tuple(slice(None) if i == d else 0 for i in range(len(whole)))]
        if not torch.equal(coords, first.view([-1 if i == d else 1 for i in range(len(whole))]).expand_as(coords)):
            raise ValueError(f"a hidden slice of {name} does not map dim {d} independently of the others")
        profiles.append(first.tolist())
    boxes: list[Box] = [((), (), ())]
    for profile in profiles:
        boxes = [(lo + (l,), go + (g,), sz + (k,)) for lo, go, sz in boxes for l, g, k in _runs(profile)]
    return tuple(boxes)


def _narrow(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box ``offsets``/``sizes`` of the dims after the first of ``t`` (a view)."""
    for d, (o, k) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d + 1, o, k)
    return t


def expert_view(layer: MoE, name: str, slots_t: torch.Tensor) -> torch.Tensor:
    """The global ``[E, ...]`` view of this process's ``[slots, ...]`` tensor of ``layer``'s
    ``GroupedExperts`` parameter ``name`` (or of optimizer state shaped like it): a
    ``ChunkedTensor``, or ``slots_t`` itself when it holds every whole expert in order."""
    if holds_every_expert(layer):
        return slots_t
    slot_experts, primary = layer.expert_slots()
    n, parts = layer.hidden_shards()
    E = layer.config.num_experts
    whole = tuple(slots_t.shape[1:])
    if n > 1:
        meta = torch.empty(whole, device="meta")
        whole = tuple(join_hidden_slices(name, [meta] * n, layer.experts.halves).shape)
    if n > 1:  # every slice: one chunk per box of it
        chunks = [((g, *go), _narrow(slots_t[i : i + 1], lo, sz), True)
                  for i, (g, part) in enumerate(zip(slot_experts, parts))
                  for lo, go, sz in _slice_boxes(name, whole, n, part, layer.experts.halves)]
    else:  # one chunk per run of consecutive experts that this process writes (or does not)
        chunks, i = [], 0
        while i < len(slot_experts):
            j = i + 1
            while j < len(slot_experts) and slot_experts[j] == slot_experts[j - 1] + 1 and primary[j] == primary[i]:
                j += 1
            chunks.append(((slot_experts[i],) + (0,) * len(whole), slots_t[i:j], primary[i]))
            i = j
    return ChunkedTensor((E, *whole), chunks, dtype=slots_t.dtype, device=slots_t.device)


def vocab_view(rows_t: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """The global ``[V, ...]`` view of this process's rows ``[start, start + v)`` of a
    vocabulary-split table (or of optimizer state shaped like it)."""
    if rows_t.shape[0] == vocab_size:
        return rows_t
    offsets = (start,) + (0,) * (rows_t.dim() - 1)
    return ChunkedTensor((vocab_size, *rows_t.shape[1:]), [(offsets, rows_t, True)], dtype=rows_t.dtype,
                         device=rows_t.device)
