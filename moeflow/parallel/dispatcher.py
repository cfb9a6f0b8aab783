"""All-to-all dispatcher: experts spread over an expert-parallel group (legend: moeflow.types).

Rank ``r`` of a group of ``W`` ranks holds experts ``[r*e, (r+1)*e)``, ``e = E / W``.

Semantics: the result equals the single-process layer on the batch made by concatenating every
rank's tokens in rank order, in every capacity mode and drop policy. To get there each rank
all-gathers the (small) routing metadata of the group, ``ids_TK`` and, when the drop policy
needs them, the weights, and runs the same slot assignment on the global batch: capacity is
``C = ceil(cf * T_total * K / E)``, drops follow the global priority order, and every rank
knows which rows it sends and receives. Ranks with different token counts (zero included)
therefore always agree on ``C`` and on the split sizes: no hang.

Only kept rows travel (no padding on the wire): one uneven exchange each way, flat or
two-level (``moeflow.parallel.exchange``), differentiable (its backward is the reverse
exchange). On the expert side the received rows
are laid out as ``[e, C, D]`` (capacity mode) or grouped by expert (dropless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from moeflow.config import DispatchConfig, hybrid_shards
from moeflow.dispatch.capacity import resolve_capacity
from moeflow.dispatch.local import combine_weights, sum_token_rows
from moeflow.dispatch.slots import assign_slots
from moeflow.kernels.gather import gather_rows
from moeflow.experts.ffn import GroupedExperts, grouped_ffn
from moeflow.parallel.comm import all_gather_rows, all_gather_shards, all_to_all_rows
from moeflow.parallel.exchange import FlatExchange, HierarchicalExchange, Hierarchy
from moeflow.parallel.placement import Placement
from moeflow.parallel.tuner import ParallelTuner
from moeflow.types import RoutingResult

__all__ = ["AllToAllDispatcher", "AllToAllPlan"]


@dataclass(frozen=True)
class AllToAllPlan:
    """What ``combine`` needs to send expert outputs home and sum them per token.

    J: rows this rank sends (its kept assignments, ordered by destination rank, expert,
    slot); M: rows of the local expert input; R: rows this rank receives.

    Attributes:
        send_assign_J: local flat assignment index of each sent row.
        row_A: sent-row index of each local assignment (arbitrary where dropped).
        kept_A: bool mask of kept local assignments (None: none dropped).
        counts: ``[W][W]`` rows sent from rank s to rank d (kept assignments), for the exchange.
        recv_of_M: received row feeding each expert-input row (arbitrary where empty).
        valid_M: bool mask of expert-input rows that hold a row (None: all).
        M_of_recv: expert-input row of each received row.
        weights_TK, counts_E (rows per *local* expert), capacity, num_tokens, weight_at: as in
            ``moeflow.types.DispatchPlan``.
    """

    send_assign_J: torch.Tensor
    row_A: torch.Tensor
    kept_A: torch.Tensor | None
    counts: list[list[int]]
    recv_of_M: torch.Tensor
    valid_M: torch.Tensor | None
    M_of_recv: torch.Tensor
    weights_TK: torch.Tensor
    counts_E: torch.Tensor
    capacity: int | None
    num_tokens: int
    weight_at: str

    @property
    def top_k(self) -> int:
        return self.weights_TK.shape[1]


class AllToAllDispatcher:
    """Dispatcher protocol over an expert-parallel process group (see module docstring)."""

    collective = True  # every rank must call dispatch/combine, even with no tokens

    def __init__(
        self,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None,
        config: DispatchConfig | None = None,
        hierarchy: Hierarchy | None = None,
        hidden_shards: int = 1,
    ) -> None:
        W = dist.get_world_size(group)
        if not isinstance(hidden_shards, int) or isinstance(hidden_shards, bool) or hidden_shards < 1:
            raise ValueError(f"hidden_shards must be a positive int, got {hidden_shards!r}")
        if (num_experts * hidden_shards) % W:
            raise ValueError(f"num_experts={num_experts} x hidden_shards={hidden_shards} must be divisible by the "
                             f"expert-parallel group size {W}")
        self.num_experts = num_experts
        # each expert's hidden units split into this many slices, held as "virtual" experts
        # j * E + x (``GroupedExperts.hidden_slices``: slice-major, so an expert's slices sit on
        # different ranks); every kept row of expert x goes to all its slices and their outputs
        # add up in combine (Tutel's adaptive_r)
        self.hidden_shards = hidden_shards
        self.group = group
        self.world = W
        self.rank = dist.get_rank(group)
        self.set_placement(Placement.contiguous(num_experts * hidden_shards, W))
        self.config = config if config is not None else DispatchConfig()
        self.exchange = FlatExchange(group) if hierarchy is None else HierarchicalExchange(group, hierarchy)
        self.tuner = ParallelTuner(group, self.config.tuner)

    def set_placement(self, placement: Placement) -> None:
        """Route to the slots of ``placement`` (``moeflow.parallel.placement``); the experts
        module must hold this rank's slots in that order (``apply_placement`` does both)."""
        if placement.num_experts != self.num_experts * self.hidden_shards or placement.world != self.world:
            raise ValueError(f"placement is for {placement.num_experts} experts on {placement.world} ranks; "
                             f"this dispatcher has {self.num_experts} experts on {self.world} ranks")
        if self.hidden_shards > 1 and not placement.is_contiguous:
            raise ValueError("load-aware placement of hidden-sharded experts is not supported (hidden_shards="
                             f"{self.hidden_shards}); use hidden_shards=1")
        self.placement = placement
        self.num_local_experts = placement.slots_per_rank
        # the global index of the first expert held here, while the slots are the plain
        # contiguous block (checkpoints use it); None under any other placement
        self.expert_offset = self.rank * self.num_local_experts if placement.is_contiguous else None
        s = placement.slots_per_rank
        self.slot_experts = placement.slots[self.rank]
        self.slot_primary = tuple(placement.replicas(x)[0] == self.rank * s + l for l, x in enumerate(self.slot_experts))
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        if hasattr(self, "tuner"):  # the fastest setting may differ under the new placement
            self.tuner.reset()

    def _slots(self, expert_S: torch.Tensor, pos_S: torch.Tensor, kept_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global slot of every assignment and its row position within the slot.

        ``expert_S``, ``pos_S``: expert and position among that expert's assignments (global
        priority order); ``kept_E``: kept assignments per expert. The ``k`` kept rows of expert
        ``x`` are cut at ``floor(cum_j * k / total)`` (``cum_j``: running sum of its replicas'
        shares), part ``j`` going to replica ``j``; integer arithmetic, so every rank cuts the
        same way. Dropped assignments go to the last replica (they travel nowhere).
        """
        if self.placement.is_contiguous:
            return expert_S, pos_S
        device = expert_S.device
        if device not in self._tables:
            self._tables[device] = self.placement.tables(device)
        replica_EN, cum_EN1, n_E = self._tables[device]
        cum_SN1 = cum_EN1[expert_S]
        cut_SN1 = torch.div(cum_SN1 * kept_E[expert_S].unsqueeze(1), cum_SN1[:, -1:], rounding_mode="floor")
        j_S = torch.minimum((cut_SN1[:, 1:] <= pos_S.unsqueeze(1)).sum(1), n_E[expert_S] - 1)
        start_S = cut_SN1.gather(1, j_S.unsqueeze(1)).squeeze(1)
        return replica_EN[expert_S, j_S], pos_S - start_S

    def dispatch(
        self, x_TD: torch.Tensor, routing: RoutingResult, *, capacity_factor: float,
        meta: list[torch.Tensor] | None = None, shards: int | None = None,
    ) -> tuple[torch.Tensor, AllToAllPlan]:
        send_JD, plan, _ = self._prepare(x_TD, routing, capacity_factor, meta, shards)
        recv_RD = self.exchange(send_JD, plan.counts)
        expert_in = gather_rows(recv_RD, plan.recv_of_M, plan.valid_M, plan.M_of_recv.view(-1, 1), None)
        if plan.capacity is not None:
            expert_in = expert_in.view(plan.counts_E.numel(), plan.capacity, x_TD.shape[1])
        return expert_in, plan

    def gather_routing(self, routing: RoutingResult) -> list[torch.Tensor]:
        """Every rank's routing metadata (ids, and weights when the drop policy needs them), in
        rank order: the one collective that makes every rank agree on the global batch."""
        meta = routing.ids_TK.detach().to(torch.float64)
        if self.config.drop_policy != "position":
            meta = torch.cat([meta, routing.weights_TK.detach().to(torch.float64)], dim=1)
        return all_gather_rows(meta, self.group)

    def _prepare(
        self, x_TD: torch.Tensor, routing: RoutingResult, capacity_factor: float,
        meta: list[torch.Tensor] | None = None, shards: int | None = None, *, gather_send: bool = True,
    ) -> tuple[torch.Tensor | None, AllToAllPlan, _Global]:
        """Agree with the group on every kept assignment (from ``meta`` = ``gather_routing``'s
        result when the caller has it already); return this rank's send rows (None with
        ``gather_send=False``: the pipelined path gathers them chunk by chunk), the plan, and the
        global view (for ``run``). ``shards``: route to ``E * shards`` contiguous hidden slices
        for this call (the per-call hybrid mode) instead of the stored layout."""
        T, D = x_TD.shape
        E, W, e, r = self.num_experts, self.world, self.num_local_experts, self.rank
        if shards is not None:
            e = E * shards // W
        K = routing.top_k
        device = x_TD.device

        # -- the global batch: every rank's routing metadata, in rank order
        parts = self.gather_routing(routing) if meta is None else meta
        needs_weights = self.config.drop_policy != "position"
        tokens_W = [p.shape[0] for p in parts]
        T_total = sum(tokens_W)
        first_token = sum(tokens_W[:r])
        all_meta = torch.cat(parts, dim=0)
        all_ids = all_meta[:, :K].to(torch.long)
        all_w = all_meta[:, K:] if needs_weights else torch.zeros_like(all_meta[:, :K])

        cap = resolve_capacity(capacity_factor, num_tokens=max(T_total, 1), top_k=K, num_experts=E)
        policy = None if cap.row_cap is None else self.config.drop_policy
        slots = assign_slots(all_ids, all_w, num_experts=E, drop_policy=policy)
        order_S, expert_S, pos_S = slots.order_A, slots.expert_A, slots.pos_A  # S: global, by expert
        kept_S = torch.ones_like(order_S, dtype=torch.bool) if cap.row_cap is None else pos_S < cap.row_cap
        K0, n = K, (self.hidden_shards if shards is None else shards)
        if n > 1:
            # every assignment (t, k) of expert x becomes n assignments (t, k*n + j) of the slices
            # j*E + x, kept or dropped together; regrouped by slice (stable: priority order kept)
            j_S = torch.arange(n, device=device).repeat(order_S.numel())
            order_S, expert_S = order_S.repeat_interleave(n) * n + j_S, j_S * E + expert_S.repeat_interleave(n)
            pos_S, kept_S = pos_S.repeat_interleave(n), kept_S.repeat_interleave(n)
            by_slice = torch.sort(expert_S, stable=True).indices
            order_S, expert_S, pos_S, kept_S = (t[by_slice] for t in (order_S, expert_S, pos_S, kept_S))
            K = K0 * n
        if shards is None and not self.placement.is_contiguous:
            # rows travel by (destination rank, slot): regroup the global view by slot (a stable
            # sort keeps each slot's rows in priority order)
            slot_S, pos_S = self._slots(expert_S, pos_S, torch.bincount(expert_S[kept_S], minlength=E))
            by_slot = torch.sort(slot_S, stable=True).indices
            order_S, expert_S, pos_S, kept_S, slot_S = (t[by_slot] for t in (order_S, expert_S, pos_S, kept_S, slot_S))
        else:
            slot_S = expert_S
        src_S = torch.bucketize(torch.div(order_S, K, rounding_mode="floor"), _cumsum(tokens_W, device), right=True)
        dst_S = torch.div(slot_S, e, rounding_mode="floor")

        # -- send side: my kept assignments, by (destination, expert, slot)
        mine = kept_S & (src_S == r)
        send_assign_J = order_S[mine] - first_token * K
        counts = torch.bincount(src_S[kept_S] * W + dst_S[kept_S], minlength=W * W).view(W, W).tolist()
        row_A = torch.zeros(T * K, dtype=torch.long, device=device)
        row_A[send_assign_J] = torch.arange(send_assign_J.numel(), device=device)
        kept_A = None
        if cap.row_cap is not None:
            kept_A = torch.zeros(T * K, dtype=torch.bool, device=device)
            kept_A[send_assign_J] = True

        # -- receive side: kept assignments for my experts, in (source, expert, slot) order
        to_me = kept_S & (dst_S == r)
        src_R, local_R, pos_R, order_R = src_S[to_me], slot_S[to_me] - r * e, pos_S[to_me], order_S[to_me]
        by_src = torch.sort(src_R, stable=True).indices
        src_R, local_R, pos_R, order_R = src_R[by_src], local_R[by_src], pos_R[by_src], order_R[by_src]
        R = local_R.numel()
        counts_E = torch.bincount(local_R, minlength=e)
        if cap.layout_capacity is not None:
            C = cap.layout_capacity
            M_of_recv = local_R * C + pos_R
            M = e * C
        else:
            C = None
            M_of_recv = torch.empty(R, dtype=torch.long, device=device)
            M_of_recv[torch.sort(local_R, stable=True).indices] = torch.arange(R, device=device)
            M = R
        recv_of_M = torch.zeros(M, dtype=torch.long, device=device)
        recv_of_M[M_of_recv] = torch.arange(R, device=device)
        valid_M = None
        if cap.layout_capacity is not None:
            valid_M = torch.zeros(M, dtype=torch.bool, device=device)
            valid_M[M_of_recv] = True

        kept_A0 = None if kept_A is None else kept_A.view(T, K0, n)[:, :, 0].reshape(-1)
        weights_TK = combine_weights(routing.weights_TK, kept_A0, x_TD.dtype, self.config.renormalize_after_drop)
        if n > 1:  # each slice's partial output carries its assignment's weight
            weights_TK = weights_TK.repeat_interleave(n, dim=1)

        plan = AllToAllPlan(
            send_assign_J=send_assign_J,
            row_A=row_A,
            kept_A=kept_A,
            counts=counts,
            recv_of_M=recv_of_M,
            valid_M=valid_M,
            M_of_recv=M_of_recv,
            weights_TK=weights_TK,
            counts_E=counts_E,
            capacity=C,
            num_tokens=T,
            weight_at=self.config.weight_at,
        )
        glob = _Global(tokens_W=tokens_W, kept_S=kept_S, src_S=src_S, dst_S=dst_S, order_S=order_S,
                       expert_S=expert_S, slot_S=slot_S, src_R=src_R, local_R=local_R, order_R=order_R)
        send_JD = _send_rows(x_TD, send_assign_J, row_A, kept_A, weights_TK, K, self.config.weight_at) if gather_send else None
        return send_JD, plan, glob

    def combine(self, expert_out: torch.Tensor, plan: AllToAllPlan) -> torch.Tensor:
        D = expert_out.shape[-1]
        T, K = plan.num_tokens, plan.top_k
        out_MD = expert_out.reshape(-1, D)
        back_RD = gather_rows(
            out_MD,
            plan.M_of_recv,
            None,
            plan.recv_of_M.view(-1, 1),
            None if plan.valid_M is None else plan.valid_M.view(-1, 1),
        )
        home_JD = self.exchange(back_RD, [list(col) for col in zip(*plan.counts)])  # reverse routes
        rows_AD = gather_rows(
            home_JD,
            plan.row_A,
            plan.kept_A,
            plan.send_assign_J.view(-1, 1),
            None,
        )
        return sum_token_rows(rows_AD.view(T, K, D), plan.weights_TK, plan.weight_at)


    # -- pipelining (overlap_degree > 1) ------------------------------------------------------

    def run(
        self, x_TD: torch.Tensor, routing: RoutingResult, experts: Callable[..., torch.Tensor], *,
        capacity_factor: float, overlap_degree: int | str = 1, parallel: str = "expert",
        meta: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Dispatch, run ``experts`` and combine in one call, in one of the parallel modes.

        ``parallel="expert"``: rows travel to their experts' ranks; with ``overlap_degree > 1``
        the exchange is split into chunks that overlap with the expert compute: chunk ``i``
        holds, on every rank, the kept assignments of that rank's tokens ``[i*T_r/n,
        (i+1)*T_r/n)``; all send exchanges start asynchronously, then each chunk is received,
        computed (rows grouped by local expert) and sent home asynchronously while the next
        chunk's rows arrive; in backward the reverse exchanges are asynchronous too (see
        ``start_all_to_all_rows``).

        ``parallel="data"``: no row leaves its rank; the experts' weights are all-gathered for
        the call (``GroupedExperts`` only) and their gradients summed back onto the shards.

        ``"auto"`` in either argument: the tuner times the candidate settings on the first
        calls of each global batch size and keeps the fastest (``ParallelTuner``). Drops and
        capacity are always decided on the whole group's batch first, so every setting gives
        the single-process result (to rounding: the experts see grouped rows instead of the
        ``[e, C, D]`` layout).
        """
        if parallel == "auto" or overlap_degree == "auto":
            return self.tuner.run(self, x_TD, routing, experts, capacity_factor, parallel, overlap_degree)
        shards = hybrid_shards(parallel)
        if shards is not None:
            if overlap_degree != 1:
                raise ValueError(f"overlap_degree={overlap_degree} applies to parallel='expert', not {parallel!r}")
            return self._run_hybrid(x_TD, routing, experts, capacity_factor, meta, shards)
        if parallel in ("data", "sharded"):
            if overlap_degree != 1:
                raise ValueError(f"overlap_degree={overlap_degree} applies to parallel='expert', not {parallel!r}")
            run = self._run_data_parallel if parallel == "data" else self._run_sharded
            return run(x_TD, routing, experts, capacity_factor, meta)
        if parallel != "expert":
            raise ValueError(f"parallel must be 'expert', 'data', 'sharded', 'hybrid:r' or 'auto', got {parallel!r}")
        if overlap_degree == 1:
            expert_in, plan = self.dispatch(x_TD, routing, capacity_factor=capacity_factor, meta=meta)
            return self.combine(experts(expert_in, plan.counts_E), plan)
        return self._run_chunked(x_TD, routing, experts, capacity_factor, int(overlap_degree), meta)

    def _run_data_parallel(self, x_TD, routing, experts, capacity_factor: float, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if not isinstance(experts, GroupedExperts):
            raise ValueError(f"parallel='data' gathers GroupedExperts weights; got {type(experts).__name__} "
                             "(use parallel='expert')")
        send_JD, plan, g = self._prepare(x_TD, routing, capacity_factor, meta)
        # my kept rows are already grouped by global expert (the send order is by destination
        # rank, then expert): count them per global expert and run every expert here
        # (by global slot: with replicas, each slot computes its share with its own copy)
        mine = g.kept_S & (g.src_S == self.rank)
        counts_E = torch.bincount(g.slot_S[mine], minlength=len(self.placement.flat))  # every global slot
        weights = [None if w is None else all_gather_shards(w, self.group)
                   for w in (experts.w_in, experts.w_out, experts.b_in, experts.b_out)]
        if torch.is_autocast_enabled(x_TD.device.type):
            dt = torch.get_autocast_dtype(x_TD.device.type)
            send_JD = send_JD.to(dt)
            weights = [None if w is None else w.to(dt) for w in weights]
        out_JD = grouped_ffn(send_JD, counts_E, *weights, activation=experts.config.activation,
                             backend=experts.config.backend)
        T, K, D = plan.num_tokens, plan.top_k, x_TD.shape[1]
        rows_AD = gather_rows(out_JD, plan.row_A, plan.kept_A, plan.send_assign_J.view(-1, 1), None)
        return sum_token_rows(rows_AD.view(T, K, D), plan.weights_TK.to(out_JD.dtype), plan.weight_at)

    def sharded_supported(self, experts: object) -> str | None:
        """Why ``parallel="sharded"`` cannot run ``experts`` here (None when it can)."""
        if not isinstance(experts, GroupedExperts):
            return f"parallel='sharded' slices GroupedExperts weights; got {type(experts).__name__}"
        if experts.hidden % self.world:
            return (f"parallel='sharded' splits the expert hidden size {experts.hidden} over the {self.world} "
                    "ranks: it must be divisible")
        if not self.placement.is_contiguous:
            return "parallel='sharded' needs the contiguous expert placement"
        return None

    def _run_sharded(self, x_TD, routing, experts, capacity_factor: float, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Sharded-expert mode (Tutel's ``r = W``): every rank holds (for this call) hidden
        columns ``[r*H/W, (r+1)*H/W)`` of *every* expert, received from the experts' owners; the
        group's kept rows are all-gathered, each rank computes its partial expert outputs
        (``act(x W_in[:, cols]) W_out[cols, :]``: the hidden units are independent, so the
        partials add up to the full output), and the partials are summed back onto the rows'
        ranks. Per-rank work is ``1/W`` of the whole, whatever the routing."""
        why = self.sharded_supported(experts)
        if why is not None:
            raise ValueError(why)
        send_JD, plan, g = self._prepare(x_TD, routing, capacity_factor, meta)
        W, r, D = self.world, self.rank, x_TD.shape[1]
        rows_W = [sum(plan.counts[s]) for s in range(W)]  # kept rows of each rank
        J = rows_W[r]
        rows_ND = all_to_all_rows(send_JD.repeat(W, 1), [J] * W, rows_W, self.group)  # all-gather
        expert_N = torch.cat([g.expert_S[g.kept_S & (g.src_S == s)] for s in range(W)])
        by_expert = torch.sort(expert_N, stable=True).indices
        w_in, w_out, b_in = _slice_major(experts, self.world, self.group)
        if torch.is_autocast_enabled(x_TD.device.type):
            dt = torch.get_autocast_dtype(x_TD.device.type)
            rows_ND = rows_ND.to(dt)
            w_in, w_out, b_in = (None if w is None else w.to(dt) for w in (w_in, w_out, b_in))
        out = grouped_ffn(_permute_rows(rows_ND, by_expert), torch.bincount(expert_N, minlength=self.placement.num_experts),
                          w_in, w_out, b_in,
                          None, activation=experts.config.activation, backend=experts.config.backend)
        out_ND = _permute_rows(out, _inverse(by_expert))
        if experts.b_out is not None:  # added once (by rank 0); every rank keeps it in its graph
            out_ND = out_ND + all_gather_shards(experts.b_out, self.group).to(out_ND.dtype)[expert_N] * float(r == 0)
        home_JD = all_to_all_rows(out_ND, rows_W, [J] * W, self.group).view(W, J, D).sum(0)  # reduce-scatter
        T, K = plan.num_tokens, plan.top_k
        rows_AD = gather_rows(home_JD, plan.row_A, plan.kept_A, plan.send_assign_J.view(-1, 1), None)
        return sum_token_rows(rows_AD.view(T, K, D), plan.weights_TK.to(home_JD.dtype), plan.weight_at)

    def hybrid_supported(self, experts: object, shards: int) -> str | None:
        """Why ``parallel="hybrid"`` with ``shards`` cannot run ``experts`` here (None if it can)."""
        if not isinstance(experts, GroupedExperts) or experts.config.bias:
            return f"parallel='hybrid:{shards}' slices GroupedExperts without biases; got {type(experts).__name__}"
        if self.hidden_shards != 1 or not self.placement.is_contiguous:
            return f"parallel='hybrid:{shards}' needs the plain contiguous layout (hidden_shards=1, contiguous placement)"
        if not isinstance(shards, int) or shards < 2 or experts.hidden % shards or (self.num_experts * shards) % self.world:
            return (f"parallel='hybrid:{shards}' needs a number of slices >= 2 dividing the hidden size "
                    f"{experts.hidden}, and num_experts x shards divisible by the {self.world} ranks")
        return None

    def _run_hybrid(self, x_TD, routing, experts, capacity_factor: float, meta, shards: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Per-call hybrid (Tutel's ``adaptive_r`` on the stored expert-parallel shards): for this
        call every expert is split into ``shards`` hidden slices laid out slice-major over the
        ranks (as ``expert_parallel(hidden_shards=shards)`` stores them): the owners send the
        slices in one differentiable all-to-all, rows go to all slices of their expert, and the
        slices' outputs add up in the combine."""
        why = self.hybrid_supported(experts, shards)
        if why is not None:
            raise ValueError(why)
        w_in, w_out, _ = _slice_major(experts, shards, self.group)
        if torch.is_autocast_enabled(x_TD.device.type):
            dt = torch.get_autocast_dtype(x_TD.device.type)
            w_in, w_out = w_in.to(dt), w_out.to(dt)
        expert_in, plan = self.dispatch(x_TD, routing, capacity_factor=capacity_factor, meta=meta, shards=shards)
        rows = expert_in.reshape(-1, x_TD.shape[1]).to(w_in.dtype)
        # capacity layout: every slot of [e, C] is a row (padding rows are zero and ignored)
        counts = plan.counts_E if plan.capacity is None else torch.full_like(plan.counts_E, plan.capacity)
        out = grouped_ffn(rows, counts, w_in, w_out, activation=experts.config.activation, backend=experts.config.backend)
        return self.combine(out.view(expert_in.shape[:-1] + (out.shape[-1],)), plan)

    def _run_chunked(self, x_TD, routing, experts, capacity_factor: float, n: int, meta) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """The pipelined expert-parallel call (see ``run``). Chunk ``i`` is the token range
        ``[ceil(i*T/n), ceil((i+1)*T/n))`` of every rank; its rows are gathered straight from
        ``x_TD`` and its outputs are combined as soon as they are home, so the chunking adds no
        pass over the rows to the unchunked path (only per-chunk index work and messages)."""
        _, plan, g = self._prepare(x_TD, routing, capacity_factor, meta, gather_send=False)
        W, r, e, K = self.world, self.rank, self.num_local_experts, plan.top_k
        device, D = x_TD.device, x_TD.shape[1]
        T = plan.num_tokens
        first = _cumsum(g.tokens_W, device) - torch.tensor(g.tokens_W, device=device)
        tokens = torch.tensor(g.tokens_W, device=device).clamp(min=1)

        def chunk_of(order: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
            local_token = torch.div(order, K, rounding_mode="floor") - first[src]
            return torch.div(local_token * n, tokens[src], rounding_mode="floor")

        kept = g.kept_S
        chunk_S = chunk_of(g.order_S[kept], g.src_S[kept])
        counts_nWW = torch.bincount((chunk_S * W + g.src_S[kept]) * W + g.dst_S[kept],
                                    minlength=n * W * W).view(n, W, W).tolist()
        chunk_R = chunk_of(g.order_R, g.src_R)
        # my tokens of chunk i: [bounds[i], bounds[i+1]) (t lies in chunk t*n // T)
        bounds = [-(-i * T // n) for i in range(n + 1)]
        chunk_J = torch.div(torch.div(plan.send_assign_J, K, rounding_mode="floor") * n, max(T, 1),
                            rounding_mode="floor")

        def chunk_plan(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
            """Chunk i's sent assignments (chunk-local ``t*K + k``, in send order), their rows by
            assignment, and the kept mask (None when nothing is dropped)."""
            t0, t1 = bounds[i], bounds[i + 1]
            a_J = plan.send_assign_J[chunk_J == i] - t0 * K
            row_A = torch.zeros((t1 - t0) * K, dtype=torch.long, device=device)
            row_A[a_J] = torch.arange(a_J.numel(), device=device)
            kept_A = None if plan.kept_A is None else plan.kept_A[t0 * K : t1 * K]
            return a_J, row_A, kept_A

        ex = self.exchange
        plans = [chunk_plan(i) for i in range(n)]
        # every chunk's exchange starts now (two-level: its first phase); they complete in order.
        # Chunk i+1's second phase is launched before chunk i's experts run, so it overlaps too.
        # one split (its backward is one cat), not n slices (each slice's backward would zero-fill
        # and add a whole [T, D] gradient)
        sizes = [bounds[i + 1] - bounds[i] for i in range(n)]
        x_nTD, w_nTK = x_TD.split(sizes), plan.weights_TK.split(sizes)
        started = [ex.start(_send_rows(x_nTD[i], a_J, row_A, kept_A, w_nTK[i], K, plan.weight_at), counts_nWW[i])
                   for i, (a_J, row_A, kept_A) in enumerate(plans)]
        if n:
            started[0] = ex.relay(started[0])
        homes: list = []
        outs: list[torch.Tensor] = []

        def combine_chunk(i: int) -> None:  # chunk i's outputs are on their way home: sum them
            a_J, row_A, kept_A = plans[i]
            rows_AD = gather_rows(ex.finish(homes[i]), row_A, kept_A, a_J.view(-1, 1), None)
            outs.append(sum_token_rows(rows_AD.view(sizes[i], K, D), w_nTK[i], plan.weight_at))

        for i in range(n):
            if i + 1 < n:
                started[i + 1] = ex.relay(started[i + 1])
            recv_RD = ex.finish(started[i])
            local = g.local_R[chunk_R == i]
            by_expert = torch.sort(local, stable=True).indices
            expert_out = experts(_permute_rows(recv_RD, by_expert), torch.bincount(local, minlength=e))
            back_RD = _permute_rows(expert_out, _inverse(by_expert))
            homes.append(ex.start(back_RD, [list(col) for col in zip(*counts_nWW[i])]))  # reverse routes
            if i:  # the previous chunk's outputs came home while this one was computed
                combine_chunk(i - 1)
        if n:
            combine_chunk(n - 1)
        return torch.cat(outs) if outs else x_TD.new_zeros(0, D)


@dataclass(frozen=True)
class _Global:
    """The group-wide assignment view the pipelined path chunks by (S: kept or not, global, by
    expert; R: received here, by source)."""

    tokens_W: list[int]
    kept_S: torch.Tensor
    src_S: torch.Tensor
    dst_S: torch.Tensor
    order_S: torch.Tensor
    expert_S: torch.Tensor
    slot_S: torch.Tensor
    src_R: torch.Tensor
    local_R: torch.Tensor
    order_R: torch.Tensor


@lru_cache(maxsize=None)
def _slice_routes(E: int, W: int, rank: int, n: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Which slices of the slice-major layout (slice ``v = j * E + x``: hidden part ``j`` of
    expert ``x``; rank ``q`` holds ``v`` in ``[q*E*n/W, (q+1)*E*n/W)``) this rank sends and
    receives, when rank ``x // (E/W)`` owns expert ``x``: ``(local expert and part j of each
    sent slice, in destination order; send and receive splits; the receive position of each
    held slice)``. Depends only on the sizes, so it is computed once."""
    e, e_v = E // W, E * n // W
    owner = lambda v: (v % E) // e  # noqa: E731
    sent = [v for d in range(W) for v in range(d * e_v, (d + 1) * e_v) if owner(v) == rank]
    send_split = [sum(1 for v in range(d * e_v, (d + 1) * e_v) if owner(v) == rank) for d in range(W)]
    held = range(rank * e_v, (rank + 1) * e_v)
    recv_split = [sum(1 for v in held if owner(v) == src) for src in range(W)]
    arrival = [v - rank * e_v for src in range(W) for v in held if owner(v) == src]
    position = [0] * e_v
    for i, slot in enumerate(arrival):
        position[slot] = i
    return [v % E - rank * e for v in sent], [v // E for v in sent], send_split, recv_split, position


def _slice_major(experts: GroupedExperts, n: int, group: dist.ProcessGroup | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's hidden slices of the slice-major layout (``GroupedExperts.hidden_slices``)
    over the group, from the contiguous expert shards: ``(w_in [e_v, D, F/n], w_out [e_v, H/n,
    D], b_in [e_v, F/n] or None)``, ``e_v = E * n / W``; gated activations keep their (gate, up)
    halves. One gather of the slices to send and one differentiable all-to-all (its backward
    returns each slice's gradient to the owner). ``n = W`` gives every rank part ``rank`` of
    every expert (the sharded-expert mode)."""
    W, rank, e, H, D = dist.get_world_size(group), dist.get_rank(group), experts.num_experts, experts.hidden, experts.dim
    h, halves = H // n, experts.halves
    local, part, send_split, recv_split, position = _slice_routes(e * W, W, rank, n)
    device = experts.w_in.device
    local_S = torch.tensor(local, dtype=torch.long, device=device)
    part_S = torch.tensor(part, dtype=torch.long, device=device)
    # ``experts.ffn.cut_hidden_slice``'s layout, gathered for all (expert, part) pairs at once
    pieces = [experts.w_in.unflatten(-1, (halves, n, h))[local_S, :, :, part_S].reshape(len(local), -1),
              experts.w_out.unflatten(1, (n, h))[local_S, part_S].reshape(len(local), -1)]
    if experts.b_in is not None:
        pieces.append(experts.b_in.unflatten(-1, (halves, n, h))[local_S, :, part_S].reshape(len(local), -1))
    recv = all_to_all_rows(torch.cat(pieces, dim=1), send_split, recv_split, group)
    slots = recv.index_select(0, torch.tensor(position, dtype=torch.long, device=device))
    e_v, n_in, n_out = len(position), D * halves * h, h * D
    w_in = slots[:, :n_in].view(e_v, D, halves * h)
    w_out = slots[:, n_in : n_in + n_out].view(e_v, h, D)
    b_in = slots[:, n_in + n_out :] if experts.b_in is not None else None
    return w_in, w_out, b_in


def _send_rows(x_TD: torch.Tensor, send_assign_J: torch.Tensor, row_A: torch.Tensor, kept_A: torch.Tensor | None,
               weights_TK: torch.Tensor, K: int, weight_at: str) -> torch.Tensor:
    """The rows sent for assignments ``send_assign_J`` (``t*K + k`` into ``x_TD``), in that
    order, weighted when the weights apply at dispatch; backward gathers each token's (up to K)
    row gradients through ``row_A`` (masked by ``kept_A``)."""
    T = x_TD.shape[0]
    send_JD = gather_rows(
        x_TD,
        torch.div(send_assign_J, K, rounding_mode="floor"),
        None,
        row_A.view(T, K),
        None if kept_A is None else kept_A.view(T, K),
    )
    if weight_at == "dispatch":
        send_JD = send_JD * weights_TK.reshape(-1)[send_assign_J].unsqueeze(1)
    return send_JD


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _permute_rows(x_ND: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x_ND[perm]`` for a permutation, backward by the inverse gather."""
    return gather_rows(x_ND, perm, None, _inverse(perm).view(-1, 1), None)


def _cumsum(sizes: list[int], device: torch.device) -> torch.Tensor:
    """Inclusive prefix sums of ``sizes`` (token offsets of the ranks)."""
    return torch.cumsum(torch.tensor(sizes, dtype=torch.long, device=device), 0)
