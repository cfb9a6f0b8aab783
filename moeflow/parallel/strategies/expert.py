"""The expert-parallel mode: rows travel to the ranks holding their experts and back
(legend: moeflow.types).

Only kept rows travel (no padding on the wire): one uneven exchange each way, flat or two-level
(``moeflow.parallel.exchange.alltoall``), differentiable (its backward is the reverse exchange). On the
expert side the received rows are laid out as ``[e, C, D]`` (capacity mode) or grouped by slot
(dropless). With ``overlap_degree > 1`` the call is pipelined over chunks of the local expert slots
(``moeflow.parallel.strategies.pipeline``; with one slot per rank, over chunks of the tokens).
"""

from __future__ import annotations

import torch

from moeflow.experts.ffn import Experts
from moeflow.dispatch.combine import combine_rows
from moeflow.kernels.gather import gather_rows
from moeflow.parallel.strategies.pipeline import run_pipelined
from moeflow.parallel.exchange.plan import ExchangePlan, exchange_plan, send_rows
from moeflow.parallel.strategies.base import Call, ExpertGroup

__all__ = ["ExpertMode", "exchange_dispatch", "exchange_combine"]


class ExpertMode:
    """``parallel="expert"`` with pipelining degree ``overlap_degree`` (1: one exchange each way)."""

    def __init__(self, overlap_degree: int = 1) -> None:
        self.overlap_degree = overlap_degree

    def unsupported(self, where: ExpertGroup, experts: Experts) -> str | None:
        return None  # any experts module: only rows travel

    def run(self, where: ExpertGroup, call: Call) -> torch.Tensor:
        group = where.assign(call)
        if self.overlap_degree > 1:
            return run_pipelined(where, call, group, self.overlap_degree)
        plan = exchange_plan(group, where.rank, call.routing, dtype=call.x_TD.dtype, config=where.dispatch)
        expert_in = exchange_dispatch(where, call.x_TD, plan)
        return exchange_combine(where, call.experts(expert_in, plan.counts_E), plan)


def exchange_dispatch(where: ExpertGroup, x_TD: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """Send this rank's kept rows and lay out the received ones as the expert input: ``[e, C,
    D]`` in the capacity layout, ``[R, D]`` grouped by slot otherwise."""
    send_MD = send_rows(x_TD, plan.assign_M, plan.row_A, plan.kept_A, plan.weights_TK, plan.weight_at)
    recv_RD = where.exchange(send_MD, plan.counts_WW)
    expert_in = gather_rows(recv_RD, plan.recv_row_I, plan.valid_I, plan.input_row_R.view(-1, 1), None)
    if plan.capacity is not None:
        expert_in = expert_in.view(plan.counts_E.numel(), plan.capacity, x_TD.shape[1])
    return expert_in


def exchange_combine(where: ExpertGroup, expert_out: torch.Tensor, plan: ExchangePlan) -> torch.Tensor:
    """Send the expert outputs home (the reverse routes) and sum them per token."""
    out_ID = expert_out.reshape(-1, expert_out.shape[-1])
    back_RD = gather_rows(out_ID, plan.input_row_R, None, plan.recv_row_I.view(-1, 1),
                          None if plan.valid_I is None else plan.valid_I.view(-1, 1))
    home_MD = where.exchange(back_RD, [list(col) for col in zip(*plan.counts_WW)])
    return combine_rows(home_MD, plan)
