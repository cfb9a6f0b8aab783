"""The single-process dispatcher (legend: moeflow.types).

Dispatch moves token rows to expert rows by index (gather), combine moves them back and sums
the k contributions of each token: O(T*K*D) work and memory, never a one-hot ``[T, E, C]``
tensor. ``run`` is the three stages in a row; the stages stay public for callers that run
their own experts between them (the Hugging Face drop-in).
"""

from __future__ import annotations

import torch

from moeflow.config import DispatchConfig
from moeflow.dispatch.capacity import resolve_capacity
from moeflow.dispatch.combine import combine_rows, combine_weights, sum_token_rows
from moeflow.dispatch.slots import assign_slots
from moeflow.experts.ffn import Experts
from moeflow.kernels.permute import permute_rows
from moeflow.types import DispatchPlan, ExpertLayout, RoutingResult

__all__ = ["LocalDispatcher"]


class LocalDispatcher:
    """All experts live in this process (``Dispatcher`` protocol).

    Both directions are single row-moving ops along the plan's one-to-K mapping
    (``moeflow.kernels.permute``: the permute, and the weighted unpermute of
    ``dispatch.combine``), whose backwards are gathers as well: no scatter-add, no one-hot, each
    row read and written once, and no host synchronisation (except reading the kept-row count of
    a capped dropless call, which sizes the expert input).
    """

    collective = False

    def __init__(self, *, num_experts: int, config: DispatchConfig | None = None) -> None:
        self.num_experts = num_experts
        self.config = config if config is not None else DispatchConfig()
        self.layout = ExpertLayout.whole(num_experts)

    def run(
        self, x_TD: torch.Tensor, routing: RoutingResult, experts: Experts, *, capacity_factor: float,
        overlap_degree: int | str | None = None, parallel: str | None = None,
    ) -> torch.Tensor:
        """Dispatch, the experts, combine. ``overlap_degree`` and ``parallel`` choose between
        ways of running a call over several ranks: one process has nothing to choose.

        Dropless without autograd (inference: a decode step routes a handful of tokens) takes
        ``run_dropless_no_grad``, the same rows and experts call in fewer ops."""
        if capacity_factor == 0 and not torch.is_grad_enabled() and x_TD.shape[0] > 0:
            return self.run_dropless_no_grad(x_TD, routing, experts)
        expert_in, plan = self.dispatch(x_TD, routing, capacity_factor=capacity_factor)
        return self.combine(experts(expert_in, plan.counts_E), plan)

    def run_dropless_no_grad(self, x_TD: torch.Tensor, routing: RoutingResult, experts: Experts) -> torch.Tensor:
        """``run`` for ``capacity_factor=0`` where no gradient is needed: the experts get the
        same ``[R, D]`` rows grouped by expert (token order inside an expert) and the same
        ``counts_E`` as through ``dispatch``/``combine``, but the rows move with plain
        ``index_select``/``index_copy_`` and no ``DispatchPlan`` is built (no slot positions,
        no inverse maps, no autograd functions): fewer ops, and the number of ops is what a
        small-T call costs. ``dispatch`` then ``combine`` is its reference (tests compare the
        two). (Without autograd the built-in experts skip their autograd Functions too:
        ``moeflow.experts.ffn.grouped_ffn``.)"""
        T, K = routing.ids_TK.shape
        order_A = torch.sort(routing.ids_TK.reshape(-1), stable=True).indices  # assignment of each row
        x_AD = x_TD.index_select(0, torch.div(order_A, K, rounding_mode="floor"))
        weights_TK = routing.weights_TK.to(x_TD.dtype)
        if self.config.weight_at == "dispatch":
            x_AD = x_AD * weights_TK.reshape(-1).index_select(0, order_A).unsqueeze(1)
        y_AD = experts(x_AD, routing.counts_E)
        # back to assignment order t*K + k, then the weighted sum over each token's K rows
        y_TKD = torch.empty_like(y_AD).index_copy_(0, order_A, y_AD).view(T, K, -1)
        return sum_token_rows(y_TKD, weights_TK, self.config.weight_at)

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float
    ) -> tuple[torch.Tensor, DispatchPlan]:
        """``(expert_in, plan)``: ``expert_in`` is ``[E, C, D]`` (capacity mode, ``plan.capacity
        == C``; rows past ``counts_E[e]`` in slice ``e`` are zero padding whose output is
        ignored) or ``[R, D]`` grouped by expert with ``plan.counts_E`` rows each (dropless)."""
        T, D = x_TD.shape
        E, K = self.num_experts, routing.top_k
        A = T * K
        device = x_TD.device
        cap = resolve_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E)
        policy = None if cap.row_cap is None else self.config.drop_policy
        slots = assign_slots(routing.ids_TK, routing.priority_TK, num_experts=E, drop_policy=policy,
                             counts_E=routing.counts_E)
        # the assignments grouped by expert (priority order inside each expert)
        order_A, expert_A, pos_A = slots.order_A, slots.expert_A, slots.pos_A
        kept_A = None if cap.row_cap is None else pos_A < cap.row_cap

        if cap.layout_capacity is not None:
            C = cap.layout_capacity
            # each kept assignment goes to row e*C + pos; dropped ones to a trash row E*C
            dest_A = torch.where(kept_A, expert_A * C + pos_A, E * C)  # type: ignore[arg-type]
            assign_M = torch.zeros(E * C + 1, dtype=torch.long, device=device).index_copy_(0, dest_A, order_A)[: E * C]
            row_valid_M = torch.zeros(E * C + 1, dtype=torch.bool, device=device).index_copy_(0, dest_A, kept_A)[: E * C]
            row_A = torch.where(kept_A, dest_A, 0)  # type: ignore[arg-type]
        else:
            row_A = torch.arange(A, device=device)
            if kept_A is not None:
                # capped dropless: the number of kept rows decides the expert input size, so it
                # is read on the host here (the one host sync of the local dispatcher). Dropped
                # assignments move behind every kept row and are cut off.
                moved = torch.sort(torch.where(kept_A, expert_A, E), stable=True).indices
                order_A, kept_A = order_A[moved], kept_A[moved]
                rows_kept = int(kept_A.sum())
                row_A = torch.where(kept_A, row_A, 0)
                assign_M = order_A[:rows_kept]
            else:
                assign_M = order_A
            row_valid_M = None
        # so far indexed by sorted position; by assignment from here on
        row_A = torch.empty_like(order_A).scatter_(0, order_A, row_A)
        kept_A = None if kept_A is None else torch.empty_like(kept_A).scatter_(0, order_A, kept_A)

        weights_TK = combine_weights(routing.weights_TK, kept_A, x_TD.dtype, self.config.renormalize_after_drop)
        counts_E = slots.counts_E if cap.row_cap is None else slots.counts_E.clamp(max=cap.row_cap)

        token_M = torch.div(assign_M, K, rounding_mode="floor")
        # one op moves each row once, scaled by its router weight when weights apply at dispatch
        rows_MD = permute_rows(
            x_TD, token_M, row_valid_M, row_A.view(T, K), None if kept_A is None else kept_A.view(T, K),
            weights_TK.reshape(-1)[assign_M] if self.config.weight_at == "dispatch" else None,
        )
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
        """``y_TD`` from the expert output (the layout of ``expert_in``)."""
        return combine_rows(expert_out.reshape(-1, expert_out.shape[-1]), plan)
