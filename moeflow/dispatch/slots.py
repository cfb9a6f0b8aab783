"""Slot assignment by sorting (legend: moeflow.types).

Each of the ``A = T*K`` assignments gets a position inside its expert: a stable sort by expert
id of the assignments listed in priority order, then ``position = rank - first_rank_of_expert``
(the same result as Tutel's cumsum-minus-one over a one-hot, without the ``[A, E]`` one-hot).
Flat assignment index ``a = t*K + k`` throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.kernels.counts import count_ids

__all__ = ["SlotAssignment", "priority_order", "assign_slots"]


@dataclass(frozen=True)
class SlotAssignment:
    """``order_A``: flat assignment indices in expert-major, priority-minor order;
    ``expert_A``: their expert ids; ``pos_A``: position inside the expert (0-based);
    ``counts_E``: assignments per expert before any drop."""

    order_A: torch.Tensor
    expert_A: torch.Tensor
    pos_A: torch.Tensor
    counts_E: torch.Tensor


def priority_order(weights_TK: torch.Tensor, drop_policy: str) -> torch.Tensor:
    """Flat assignment indices, highest priority first, for ``drop_policy``.

    ``"position"``: choice-major, then token order (GShard/Tutel).
    ``"score"``: descending router weight, ties by flat index.
    ``"bpr"``: choice-major, tokens by descending best weight, ties by token index (V-MoE).
    """
    T, K = weights_TK.shape
    w_TK = weights_TK.detach()
    index_TK = torch.arange(T * K, device=w_TK.device).view(T, K)
    if drop_policy == "position":
        return index_TK.t().reshape(-1)
    if drop_policy == "score":
        return torch.sort(-w_TK.reshape(-1), stable=True).indices
    if drop_policy == "bpr":
        token_order_T = torch.sort(-w_TK.amax(dim=1), stable=True).indices
        return index_TK[token_order_T].t().reshape(-1)
    raise ValueError(f"unknown drop_policy {drop_policy!r}")


def assign_slots(
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    num_experts: int,
    drop_policy: str | None,
    counts_E: torch.Tensor | None = None,
) -> SlotAssignment:
    """Group assignments by expert; inside an expert, order by ``drop_policy`` priority.

    ``drop_policy=None`` (nothing can be dropped) keeps token order inside each expert and skips
    the priority sort. ``counts_E`` (assignments per expert) is counted from ``ids_TK`` unless
    given.
    """
    ids_A = ids_TK.reshape(-1)
    A = ids_A.numel()
    if drop_policy is None:
        expert_A, order_A = torch.sort(ids_A, stable=True)
    else:
        prio_A = priority_order(weights_TK, drop_policy)
        expert_A, idx = torch.sort(ids_A[prio_A], stable=True)
        order_A = prio_A[idx]
    counts_E = count_ids(ids_A, num_experts) if counts_E is None else counts_E
    start_E = torch.cumsum(counts_E, 0) - counts_E
    pos_A = torch.arange(A, device=ids_A.device) - start_E[expert_A]
    return SlotAssignment(order_A=order_A, expert_A=expert_A, pos_A=pos_A, counts_E=counts_E)
