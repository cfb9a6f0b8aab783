"""The per-call hybrid mode ``parallel="hybrid:r"`` (Tutel's ``adaptive_r`` on the stored
expert-parallel shards; legend: moeflow.types): for one call every expert is split into ``r``
hidden slices laid out slice-major over the ranks, as ``expert_parallel(hidden_shards=r)``
stores them. The owners send the slices in one differentiable all-to-all
(``moeflow.parallel.strategies.slices``), rows go to all slices of their expert through the expert mode's
exchange, and the slices' outputs add up in the combine."""

from __future__ import annotations

import torch

from moeflow.experts.ffn import Experts, GroupedExperts, autocast_cast, grouped_ffn
from moeflow.parallel.strategies.expert import exchange_combine, exchange_dispatch
from moeflow.parallel.exchange.plan import exchange_plan
from moeflow.parallel.strategies.slices import gather_slices
from moeflow.parallel.strategies.base import Call, ExpertGroup

__all__ = ["HybridMode"]


class HybridMode:
    """``parallel=f"hybrid:{shards}"``."""

    def __init__(self, shards: int) -> None:
        self.shards = shards

    def unsupported(self, where: ExpertGroup, experts: Experts) -> str | None:
        r = self.shards
        if not isinstance(experts, GroupedExperts) or experts.config.bias:
            return f"parallel='hybrid:{r}' slices GroupedExperts without biases; got {type(experts).__name__}"
        if where.hidden_shards != 1 or not where.placement.is_contiguous:
            return f"parallel='hybrid:{r}' needs the plain contiguous layout (hidden_shards=1, contiguous placement)"
        if r < 2 or experts.hidden % r or (where.num_experts * r) % where.world:
            return (f"parallel='hybrid:{r}' needs a number of slices >= 2 dividing the hidden size "
                    f"{experts.hidden}, and num_experts x shards divisible by the {where.world} ranks")
        return None

    def run(self, where: ExpertGroup, call: Call) -> torch.Tensor:
        experts = call.experts
        assert isinstance(experts, GroupedExperts)  # checked by the dispatcher (``unsupported``)
        w_in, w_out, _ = gather_slices(experts, self.shards, where.group)
        w_in, w_out = autocast_cast(call.x_TD, w_in, w_out)
        group = where.assign(call, hidden_shards=self.shards)
        plan = exchange_plan(group, where.rank, call.routing, dtype=call.x_TD.dtype, config=where.dispatch)
        expert_in = exchange_dispatch(where, call.x_TD, plan)
        rows = expert_in.reshape(-1, call.x_TD.shape[1]).to(w_in.dtype)
        # capacity layout: every slot of [e, C] is a row (padding rows are zero and ignored)
        counts_e = plan.counts_E if plan.capacity is None else torch.full_like(plan.counts_E, plan.capacity)
        out = grouped_ffn(rows, counts_e, w_in, w_out, **experts.ffn_options())
        return exchange_combine(where, out.view(expert_in.shape[:-1] + (out.shape[-1],)), plan)
