"""The data-parallel mode on expert-parallel shards (legend: moeflow.types): no row leaves its
rank; the experts' weights are all-gathered for the call (every slot of the placement, replicas
included) and their gradients summed back onto the shards. Cheaper than moving rows when tokens
are few."""

from __future__ import annotations

import torch

from moeflow.dispatch.combine import combine_rows
from moeflow.experts.ffn import Experts, GroupedExperts, autocast_cast, grouped_ffn
from moeflow.parallel.comm import all_gather_shards
from moeflow.parallel.exchange.plan import exchange_plan, send_rows
from moeflow.parallel.strategies.base import Call, ExpertGroup

__all__ = ["DataMode"]


class DataMode:
    """``parallel="data"``."""

    def unsupported(self, where: ExpertGroup, experts: Experts) -> str | None:
        if not isinstance(experts, GroupedExperts):
            return f"parallel='data' gathers GroupedExperts weights; got {type(experts).__name__} (use parallel='expert')"
        return None

    def run(self, where: ExpertGroup, call: Call) -> torch.Tensor:
        experts = call.experts
        assert isinstance(experts, GroupedExperts)  # checked by the dispatcher (``unsupported``)
        group = where.assign(call)
        plan = exchange_plan(group, where.rank, call.routing, dtype=call.x_TD.dtype, config=where.dispatch)
        rows_MD = send_rows(call.x_TD, plan.assign_M, plan.row_A, plan.kept_A, plan.weights_TK, plan.weight_at)
        # my kept rows are already grouped by global slot (the send order is by destination
        # rank, then slot): count them per slot and run every slot here with its own copy
        # (a scatter-add of the mask: torch.bincount and a boolean index would read on the host on CUDA)
        mine_G = group.sent_by(where.rank)
        rows_per_slot = torch.zeros(len(where.placement.flat), dtype=torch.long, device=mine_G.device)
        rows_per_slot.scatter_add_(0, group.slot_G, mine_G.long())
        weights = [None if w is None else all_gather_shards(w, where.group)
                   for w in (experts.w_in, experts.w_out, experts.b_in, experts.b_out)]
        rows_MD, *weights = autocast_cast(rows_MD, rows_MD, *weights)
        out_MD = grouped_ffn(rows_MD, rows_per_slot, *weights, **experts.ffn_options())
        return combine_rows(out_MD, plan)
