"""The single-process dispatcher and the dispatcher protocol (legend: moeflow.types).

Dispatch moves token rows to expert rows by index (gather), combine moves them back and sums
the k contributions of each token (scatter-add): O(T*K*D) work and memory, never a one-hot
``[T, E, C]`` tensor. Parallel dispatchers (all-to-all, hierarchical, pipelined) implement the
same protocol, so the layer does not branch on parallelism.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from moeflow.config import DispatchConfig
from moeflow.dispatch.capacity import resolve_capacity
from moeflow.dispatch.slots import assign_slots
from moeflow.kernels.gather import gather_rows
from moeflow.types import DispatchPlan, RoutingResult

__all__ = ["Dispatcher", "LocalDispatcher", "combine_weights", "renormalize_kept", "sum_token_rows"]


@runtime_checkable
class Dispatcher(Protocol):
    """Moves routed tokens to the experts this process holds, and back.

    ``dispatch`` returns the expert input in one of two layouts:
    ``[e, C, D]`` (capacity mode, ``plan.capacity == C``; rows past ``counts_E[e]`` in slice
    ``e`` are zero padding whose output is ignored) or ``[R, D]`` grouped by expert with
    ``plan.counts_E`` rows each and ``R == counts_E.sum()`` (dropless). ``combine`` returns ``y_TD``. Nothing is kept on ``self`` between the
    two calls: the plan carries it.
    """

    num_experts: int
    # True when dispatch/combine are collectives that every rank must enter, even with T = 0
    collective: bool
    # global index of the first expert whose weights this process holds
    expert_offset: int

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float
    ) -> tuple[torch.Tensor, DispatchPlan]: ...

    def combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live in this process.

    Both directions are row gathers along the plan's one-to-K mapping
    (``moeflow.kernels.gather_rows``), whose backward is a gather as well: no scatter-add, no
    one-hot, and no host synchronisation.
    """

    collective = False
    expert_offset = 0  # global index of the first expert held here

    def __init__(self, *, num_experts: int, config: DispatchConfig | None = None) -> None:
        self.num_experts = num_experts
        self.config = config if config is not None else DispatchConfig()

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float
    ) -> tuple[torch.Tensor, DispatchPlan]:
        T, D = x_TD.shape
        E, K = self.num_experts, routing.top_k
        A = T * K
        device = x_TD.device
        cap = resolve_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E)
        policy = None if cap.row_cap is None else self.config.drop_policy
        slots = assign_slots(routing.ids_TK, routing.weights_TK, num_experts=E, drop_policy=policy, counts_E=routing.counts_E)
        order_S, expert_S, pos_S = slots.order_A, slots.expert_A, slots.pos_A  # S: sorted by expert
        kept_S = None if cap.row_cap is None else pos_S < cap.row_cap

        if cap.layout_capacity is not None:
            C = cap.layout_capacity
            # each kept assignment goes to row e*C + pos; dropped ones to a trash row E*C
            dest_S = torch.where(kept_S, expert_S * C + pos_S, E * C)  # type: ignore[arg-type]
            assign_M = torch.zeros(E * C + 1, dtype=torch.long, device=device).index_copy_(0, dest_S, order_S)[: E * C]
            row_valid_M = torch.zeros(E * C + 1, dtype=torch.bool, device=device).index_copy_(0, dest_S, kept_S)[: E * C]
            row_S = torch.where(kept_S, dest_S, 0)  # type: ignore[arg-type]
        else:
            row_S = torch.arange(A, device=device)
            if kept_S is not None:
                # capped dropless: the number of kept rows decides the expert input size, so it
                # is read on the host here (the one host sync of the local dispatcher). Dropped
                # assignments move behind every kept row and are cut off.
                moved = torch.sort(torch.where(kept_S, expert_S, E), stable=True).indices
                order_S, kept_S = order_S[moved], kept_S[moved]
                rows_kept = int(kept_S.sum())
                row_S = torch.where(kept_S, row_S, 0)
                assign_M = order_S[:rows_kept]
            else:
                assign_M = order_S
            row_valid_M = None
        row_A = torch.empty_like(order_S).scatter_(0, order_S, row_S)
        kept_A = None if kept_S is None else torch.empty_like(kept_S).scatter_(0, order_S, kept_S)

        weights_TK = combine_weights(routing.weights_TK, kept_A, x_TD.dtype, self.config.renormalize_after_drop)
        counts_E = slots.counts_E if cap.row_cap is None else slots.counts_E.clamp(max=cap.row_cap)

        token_M = torch.div(assign_M, K, rounding_mode="floor")
        rows_MD = gather_rows(
            x_TD, token_M, row_valid_M, row_A.view(T, K), None if kept_A is None else kept_A.view(T, K)
        )
        if self.config.weight_at == "dispatch":
            rows_MD = rows_MD * weights_TK.reshape(-1)[assign_M].unsqueeze(1)
        expert_in = rows_MD if cap.layout_capacity is None else rows_MD.view(E, cap.layout_capacity, D)
        plan = DispatchPlan(
            assign_M=assign_M,
            row_valid_M=row_valid_M,
            row_A=row_A,
            kept_A=kept_A,
            weights_TK=weights_TK,
            counts_E=counts_E,
            capacity=cap.layout_capacity,
            num_tokens=T,
            weight_at=self.config.weight_at,
        )
        return expert_in, plan

    def combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        D = expert_out.shape[-1]
        T, K = plan.num_tokens, plan.top_k
        rows_AD = gather_rows(
            expert_out.reshape(-1, D),
            plan.row_A,
            plan.kept_A,
            plan.assign_M.view(-1, 1),
            None if plan.row_valid_M is None else plan.row_valid_M.view(-1, 1),
        )
        return sum_token_rows(rows_AD.view(T, K, D), plan.weights_TK, plan.weight_at)


def sum_token_rows(rows_TKD: torch.Tensor, weights_TK: torch.Tensor, weight_at: str) -> torch.Tensor:
    """``y_TD = sum_k w_TK * rows_TKD`` (or the plain sum when the weights were applied at
    dispatch), as one ``[T,1,K] x [T,K,D]`` bmm."""
    if weight_at == "dispatch":
        return rows_TKD.sum(dim=1)
    if rows_TKD.shape[1] == 1:
        return rows_TKD[:, 0] * weights_TK
    return torch.bmm(weights_TK.unsqueeze(1), rows_TKD).squeeze(1)


def combine_weights(
    weights_TK: torch.Tensor, kept_A: torch.Tensor | None, dtype: torch.dtype, renormalize: bool
) -> torch.Tensor:
    """The router weights in the input dtype, renormalised over the kept assignments when asked
    (``kept_A`` in flat ``t*K + k`` order; None when nothing can be dropped)."""
    weights_TK = weights_TK.to(dtype)
    if kept_A is None or not renormalize:
        return weights_TK
    return renormalize_kept(weights_TK, kept_A.view(weights_TK.shape))


def renormalize_kept(weights_TK: torch.Tensor, kept_TK: torch.Tensor) -> torch.Tensor:
    """Rescale each token's kept weights so they sum to the total of all its k weights
    (tokens with nothing kept keep zero weight)."""
    kept_w_TK = weights_TK * kept_TK
    kept_sum_T1 = kept_w_TK.sum(dim=1, keepdim=True)
    has_kept = kept_sum_T1 > 0
    scale_T1 = torch.where(has_kept, weights_TK.sum(dim=1, keepdim=True) / torch.where(has_kept, kept_sum_T1, 1), 0)
    return weights_TK * scale_T1
