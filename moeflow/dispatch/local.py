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
from moeflow.types import DispatchPlan, RoutingResult

__all__ = ["Dispatcher", "LocalDispatcher"]


@runtime_checkable
class Dispatcher(Protocol):
    """Moves routed tokens to the experts this process holds, and back.

    ``dispatch`` returns the expert input in one of two layouts:
    ``[e, C, D]`` (capacity mode, ``plan.capacity == C``) or ``[R, D]`` grouped by expert with
    ``plan.counts_E`` rows each (dropless; rows past ``counts_E.sum()`` are padding whose
    output is ignored). ``combine`` returns ``y_TD``. Nothing is kept on ``self`` between the
    two calls: the plan carries it.
    """

    num_experts: int

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float
    ) -> tuple[torch.Tensor, DispatchPlan]: ...

    def combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor: ...


class LocalDispatcher:
    """All experts live in this process."""

    def __init__(self, *, num_experts: int, config: DispatchConfig | None = None) -> None:
        self.num_experts = num_experts
        self.config = config if config is not None else DispatchConfig()

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float
    ) -> tuple[torch.Tensor, DispatchPlan]:
        T, D = x_TD.shape
        E = self.num_experts
        K = routing.top_k
        cap = resolve_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E)
        policy = None if cap.row_cap is None else self.config.drop_policy
        slots = assign_slots(routing.ids_TK, routing.weights_TK, num_experts=E, drop_policy=policy)
        order_A, expert_A, pos_A = slots.order_A, slots.expert_A, slots.pos_A
        weights_A = routing.weights_TK.reshape(-1)

        kept_A: torch.Tensor | None = None
        if cap.row_cap is not None:
            kept_A = pos_A < cap.row_cap
            if cap.layout_capacity is None:
                # capped dropless: move dropped assignments behind every kept row, so the kept
                # rows of each expert stay contiguous and the grouped GEMM ignores the tail
                moved_A = torch.sort(torch.where(kept_A, expert_A, E), stable=True).indices
                order_A, expert_A, kept_A = order_A[moved_A], expert_A[moved_A], kept_A[moved_A]
        token_A = torch.div(order_A, K, rounding_mode="floor")
        weight_A = weights_A[order_A].to(x_TD.dtype)
        if kept_A is not None and self.config.renormalize_after_drop:
            weight_A = _renormalize_kept(weight_A, kept_A, token_A, routing.weights_TK.to(x_TD.dtype))

        counts_E = slots.counts_E if cap.row_cap is None else slots.counts_E.clamp(max=cap.row_cap)
        rows_AD = x_TD.index_select(0, token_A)
        if self.config.weight_at == "dispatch":
            rows_AD = rows_AD * weight_A.unsqueeze(1)

        if cap.layout_capacity is None:
            row_A = torch.arange(order_A.numel(), device=x_TD.device)
            expert_in = rows_AD
        else:
            C = cap.layout_capacity
            row_A = torch.where(kept_A, expert_A * C + pos_A, E * C)  # type: ignore[arg-type]
            # one trash row past the end takes the dropped assignments, then is cut off
            buf = x_TD.new_zeros(E * C + 1, D).index_copy(0, row_A, rows_AD)
            expert_in = buf[: E * C].view(E, C, D)
        plan = DispatchPlan(
            token_A=token_A,
            weight_A=weight_A,
            kept_A=kept_A,
            row_A=row_A,
            counts_E=counts_E,
            capacity=cap.layout_capacity,
            num_tokens=T,
            weight_at=self.config.weight_at,
        )
        return expert_in, plan

    def combine(self, expert_out: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        D = expert_out.shape[-1]
        out_flat = expert_out.reshape(-1, D)
        if plan.capacity is None:
            rows_AD = out_flat  # grouped layout: row a of the output belongs to assignment a
        else:
            rows_AD = out_flat.index_select(0, plan.row_A.clamp(max=out_flat.shape[0] - 1))
        if plan.weight_at == "combine":
            rows_AD = rows_AD * plan.weight_A.unsqueeze(1)
        if plan.kept_A is not None:
            rows_AD = torch.where(plan.kept_A.unsqueeze(1), rows_AD, rows_AD.new_zeros(()))
        y_TD = out_flat.new_zeros(plan.num_tokens, D)
        return y_TD.index_add(0, plan.token_A, rows_AD)


def _renormalize_kept(
    weight_A: torch.Tensor, kept_A: torch.Tensor, token_A: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """Rescale each token's kept weights so they sum to the total of all its k weights."""
    T = weights_TK.shape[0]
    kept_sum_T = weights_TK.new_zeros(T).index_add(0, token_A, weight_A * kept_A)
    total_T = weights_TK.sum(dim=1)
    scale_T = torch.where(kept_sum_T > 0, total_T / torch.where(kept_sum_T > 0, kept_sum_T, 1), 0)
    return weight_A * scale_T[token_A]
