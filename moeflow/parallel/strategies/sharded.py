"""The sharded-expert mode (Tutel's ``r = W``; legend: moeflow.types): for one call every rank
holds hidden columns ``[r*H/W, (r+1)*H/W)`` of *every* expert, received from the experts'
owners (``moeflow.parallel.strategies.slices``). The group's kept rows are all-gathered, each rank computes
its partial expert outputs (``act(x W_in[:, cols]) W_out[cols, :]``: the hidden units are
independent, so the partials add up to the full output), and the partials are summed back onto
the rows' ranks. Per-rank work is ``1/W`` of the whole, however skewed the routing."""

from __future__ import annotations

import torch

from moeflow.dispatch.combine import combine_rows
from moeflow.experts.ffn import Experts, GroupedExperts, autocast_cast, grouped_ffn
from moeflow.parallel.comm import all_gather_shards, all_to_all_rows
from moeflow.parallel.exchange.plan import exchange_plan, inverse_permutation, permute_rows, send_rows
from moeflow.parallel.strategies.slices import gather_slices
from moeflow.parallel.strategies.base import Call, ExpertGroup

__all__ = ["ShardedMode"]


class ShardedMode:
    """``parallel="sharded"``."""

    def unsupported(self, where: ExpertGroup, experts: Experts) -> str | None:
        if not isinstance(experts, GroupedExperts):
            return f"parallel='sharded' slices GroupedExperts weights; got {type(experts).__name__}"
        if experts.hidden % where.world:
            return (f"parallel='sharded' splits the expert hidden size {experts.hidden} over the {where.world} "
                    "ranks: it must be divisible")
        if not where.placement.is_contiguous:
            return "parallel='sharded' needs the contiguous expert placement"
        return None

    def run(self, where: ExpertGroup, call: Call) -> torch.Tensor:
        experts = call.experts
        assert isinstance(experts, GroupedExperts)  # checked by the dispatcher (``unsupported``)
        group = where.assign(call)
        plan = exchange_plan(group, where.rank, call.routing, dtype=call.x_TD.dtype, config=where.dispatch)
        W, r, D = where.world, where.rank, call.x_TD.shape[1]
        send_MD = send_rows(call.x_TD, plan.assign_M, plan.row_A, plan.kept_A, plan.weights_TK, plan.weight_at)
        rows_W = [sum(plan.counts_WW[s]) for s in range(W)]  # kept rows of each rank
        M = rows_W[r]
        group_rows = all_to_all_rows(send_MD.repeat(W, 1), [M] * W, rows_W, where.group)  # all-gather
        # (virtual) expert of every row of the group, in the gathered order
        expert_rows = torch.cat([group.expert_G[group.sent_by(s)] for s in range(W)])
        by_expert = torch.sort(expert_rows, stable=True).indices
        w_in, w_out, b_in = gather_slices(experts, W, where.group)
        group_rows, w_in, w_out, b_in = autocast_cast(group_rows, group_rows, w_in, w_out, b_in)
        out = grouped_ffn(permute_rows(group_rows, by_expert),
                          torch.bincount(expert_rows, minlength=where.placement.num_experts),
                          w_in, w_out, b_in, None, **experts.ffn_options())
        out_rows = permute_rows(out, inverse_permutation(by_expert))
        if experts.b_out is not None:  # added once (by rank 0); every rank keeps it in its graph
            out_rows = out_rows + all_gather_shards(experts.b_out, where.group).to(out_rows.dtype)[expert_rows] * float(r == 0)
        home_MD = all_to_all_rows(out_rows, rows_W, [M] * W, where.group).view(W, M, D).sum(0)  # reduce-scatter
        return combine_rows(home_MD, plan)
