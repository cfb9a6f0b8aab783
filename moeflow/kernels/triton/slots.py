"""Slot assignment: the position of every (token, k) assignment inside its expert
(legend: moeflow.types, plus ``B`` blocks of assignments).

Tutel's rule, "cumsum minus one": walk the ``A = T*K`` assignments in priority order and give
each the number of earlier assignments to the same expert. Tutel materialises an ``[A, E]``
one-hot and a cumulative sum over it; here three small kernels do it in ``O(A + blocks*E)``
memory:

1. ``_block_hist_kernel``: each program takes ``BLOCK_A`` consecutive assignments (priority
   order) and writes their per-expert histogram ``hist_BE[b]``.
2. ``_scan_kernel``: exclusive scan of the histograms over blocks, per expert, 64 blocks a step:
   ``offs_BE[b, e] = sum_{b' < b} hist_BE[b', e]``; the last running sum is ``counts_E``.
3. ``_positions_kernel``: each block recomputes its one-hot, takes the in-block cumulative sum
   minus one, adds ``offs_BE[b]`` and writes ``pos_A`` in flat order ``a = t*K + k``.

Priority order: ``choice_major=True`` is GShard/Tutel's (all first choices in token order, then
all second choices, ...), what ``drop_policy="position"`` means in ``moeflow.dispatch``;
``choice_major=False`` is plain flat order (what the dropless dispatcher uses). With a capacity
``C``, assignment ``a`` is kept iff ``pos_A[a] < C`` (dropped by position).

Reference: ``assign_positions_reference`` below (Tutel's one-hot cumsum, verbatim), and
``moeflow.dispatch.assign_slots`` (a stable sort), which the tests also compare against.
No host synchronisation: every size is known from shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["assign_positions", "assign_positions_reference", "MAX_SLOT_EXPERTS"]

MAX_SLOT_EXPERTS = 4096  # one block's one-hot is [BLOCK_A, next_pow2(E)]


@triton.jit
def _flat_index(i, T, K, CHOICE_MAJOR: tl.constexpr):
    """Priority index ``i`` -> flat assignment ``a = t*K + k``."""
    if CHOICE_MAJOR:
        return (i % T) * K + i // T
    return i


@triton.jit
def _block_hist_kernel(ids_ptr, hist_ptr, A, T, K, E,
                       CHOICE_MAJOR: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    i = b * BLOCK_A + tl.arange(0, BLOCK_A)
    ok = i < A
    e_id = tl.load(ids_ptr + _flat_index(i, T, K, CHOICE_MAJOR), mask=ok, other=-1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    onehot = (e_id[:, None] == experts[None, :]).to(tl.int32)
    tl.store(hist_ptr + b * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit
def _scan_kernel(hist_ptr, offs_ptr, counts_ptr, NB, E, BLOCK_B: tl.constexpr, BLOCK_E: tl.constexpr):
    """Exclusive scan over blocks, ``BLOCK_B`` blocks per step (``tl.cumsum`` inside a step,
    a running total across steps), for ``BLOCK_E`` experts per program."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    ok = experts < E
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        m = (blocks < NB)[:, None] & ok[None, :]
        at = blocks[:, None] * E + experts[None, :]
        h = tl.load(hist_ptr + at, mask=m, other=0)
        tl.store(offs_ptr + at, tl.cumsum(h, axis=0) - h + running[None, :], mask=m)
        running += tl.sum(h, axis=0)
    tl.store(counts_ptr + experts, running.to(tl.int64), mask=ok)


@triton.jit
def _positions_kernel(ids_ptr, offs_ptr, pos_ptr, A, T, K, E,
                      CHOICE_MAJOR: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0)
    i = b * BLOCK_A + tl.arange(0, BLOCK_A)
    ok = i < A
    a = _flat_index(i, T, K, CHOICE_MAJOR)
    e_id = tl.load(ids_ptr + a, mask=ok, other=-1).to(tl.int32)
    experts = tl.arange(0, BLOCK_E)
    onehot = (e_id[:, None] == experts[None, :]).to(tl.int32)
    base = tl.load(offs_ptr + b * E + experts, mask=experts < E, other=0)
    # Tutel: cumsum over the one-hot, minus one, read at the chosen expert
    slot = tl.cumsum(onehot, axis=0) - 1 + base[None, :]
    pos = tl.sum(onehot * slot, axis=1)
    # an id outside [0, E) (a -1 sentinel, or E..BLOCK_E-1, which the one-hot has columns for)
    # is counted nowhere and gets position -1
    pos = tl.where((e_id >= 0) & (e_id < E), pos, -1)
    tl.store(pos_ptr + a, pos.to(tl.int64), mask=ok)


def _block_a(E: int) -> int:
    # the one-hot tile holds BLOCK_A * BLOCK_E int32 (a few live copies): keep it at 8K elements,
    # 32 per thread with 8 warps
    return max(16, min(256, 8192 // triton.next_power_of_2(E)))



@torch.library.custom_op("moeflow::assign_positions", mutates_args=())
def _positions_op(ids_TK: torch.Tensor, num_experts: int, choice_major: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_triton_tensors("assign_positions", ids_TK=ids_TK)
    T, K = ids_TK.shape
    A, E = T * K, num_experts
    device = ids_TK.device
    pos_A = torch.empty(A, dtype=torch.int64, device=device)
    counts_E = torch.zeros(E, dtype=torch.int64, device=device)
    if A > 0:
        ids_TK = ids_TK.contiguous()
        block_e = triton.next_power_of_2(E)
        block_a = _block_a(E)
        nb = triton.cdiv(A, block_a)
        hist_BE = torch.empty(nb, E, dtype=torch.int32, device=device)
        offs_BE = torch.empty(nb, E, dtype=torch.int32, device=device)
        warps = 8 if device.type == "cuda" else 4
        scan_e = min(block_e, 32)
        with device_guard(ids_TK):
            _block_hist_kernel[(nb,)](ids_TK, hist_BE, A, T, K, E,
                                      CHOICE_MAJOR=choice_major, BLOCK_A=block_a, BLOCK_E=block_e, num_warps=warps)
            _scan_kernel[(triton.cdiv(E, scan_e),)](hist_BE, offs_BE, counts_E, nb, E, BLOCK_B=64, BLOCK_E=scan_e)
            _positions_kernel[(nb,)](ids_TK, offs_BE, pos_A, A, T, K, E,
                                     CHOICE_MAJOR=choice_major, BLOCK_A=block_a, BLOCK_E=block_e, num_warps=warps)
    return pos_A, counts_E


@_positions_op.register_fake
def _(ids_TK, num_experts, choice_major):
    A = ids_TK.shape[0] * ids_TK.shape[1]
    return ids_TK.new_empty(A, dtype=torch.int64), ids_TK.new_empty(num_experts, dtype=torch.int64)


def assign_positions(
    ids_TK: torch.Tensor, num_experts: int, *, capacity: int | None = None, choice_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Position of each assignment inside its expert, per-expert counts, and the kept mask.

    Args:
        ids_TK: expert of each assignment (int32/int64 ``[T, K]``, values in ``[0, E)``).
            Out-of-range ids (e.g. a ``-1`` "no expert" sentinel) are not an error here, since
            checking would need a host sync: such an assignment is counted nowhere, gets
            position ``-1`` and is never kept. (``moeflow.dispatch.assign_slots``, the sort
            reference, fails on them instead: ``count_ids`` scatters out of bounds.)
        num_experts: ``E``.
        capacity: keep an assignment iff its position is below this (``None``: keep all).
        choice_major: priority order (module docstring).

    Returns:
        ``(pos_A, counts_E, kept_A)``: int64 ``[T*K]`` in flat order ``a = t*K + k``; int64
        ``[E]`` assignments per expert *before* drops; bool ``[T*K]`` or ``None`` without a
        capacity.
    """
    if ids_TK.dim() != 2:
        raise ValueError(f"assign_positions: ids_TK must be [T, K], got shape {tuple(ids_TK.shape)}")
    if ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"assign_positions: ids_TK must be int32 or int64, got {ids_TK.dtype}")
    if not 1 <= num_experts <= MAX_SLOT_EXPERTS:
        raise ValueError(f"assign_positions: num_experts must be in [1, {MAX_SLOT_EXPERTS}], got {num_experts}")
    if capacity is not None and capacity < 0:
        raise ValueError(f"assign_positions: capacity must be >= 0 or None, got {capacity}")
    pos_A, counts_E = _positions_op(ids_TK, num_experts, choice_major)
    kept_A = None if capacity is None else (pos_A >= 0) & (pos_A < capacity)
    return pos_A, counts_E, kept_A


def assign_positions_reference(
    ids_TK: torch.Tensor, num_experts: int, *, capacity: int | None = None, choice_major: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tutel's definition with the ``[A, E]`` one-hot (small inputs only)."""
    T, K = ids_TK.shape
    prio_ids = ids_TK.t().reshape(-1) if choice_major else ids_TK.reshape(-1)
    onehot_AE = torch.nn.functional.one_hot(prio_ids.long(), num_experts)
    pos_prio = ((torch.cumsum(onehot_AE, 0) - 1) * onehot_AE).sum(1)
    pos_A = pos_prio.view(K, T).t().reshape(-1) if choice_major else pos_prio
    counts_E = onehot_AE.sum(0)
    kept_A = None if capacity is None else pos_A < capacity
    return pos_A, counts_E, kept_A
