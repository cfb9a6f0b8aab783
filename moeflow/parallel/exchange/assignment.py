"""The group's slot assignment: where every assignment of every rank goes (legend:
moeflow.types). Pure torch, no torch.distributed: each rank runs it on the same input (every
rank's routing metadata, gathered once per call) and so derives the same result, which is why
ranks never disagree on capacity, drops or message sizes, and never hang.

Semantics: the single-process layer on the batch made by concatenating every rank's tokens in
rank order. Capacity is ``C = ceil(cf * T_group * K / E)``, drops follow the group-wide priority
order (``moeflow.dispatch.slots``), then every kept assignment is given a *slot* (a place in some
rank's experts module) and a position inside it:

1. hidden shards (``n > 1``): each assignment ``(t, k)`` of expert ``x`` becomes ``n``
   assignments ``(t, k*n + j)`` of the slices ``j*E + x``, kept or dropped together;
2. a load-aware placement with replicas cuts each expert's kept rows, in priority order, into
   consecutive parts by the replicas' integer shares (``floor(cum * kept / total)``): integer
   arithmetic, so every rank cuts the same way;
3. otherwise slot = expert (contiguous blocks of ``e`` slots per rank).

Rank ``slot // e`` computes the row. ``GroupAssignment`` holds the result for the whole group;
``send_side`` and ``receive_side`` give one rank's view of it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import torch

from moeflow.dispatch.capacity import CapacityPlan, resolve_capacity
from moeflow.dispatch.slots import assign_slots
from moeflow.kernels.counts import count_ids
from moeflow.parallel.placement.plan import Placement

__all__ = ["CallArguments", "GroupRouting", "GroupAssignment", "SendSide", "ReceiveSide", "assign_group"]

_MODES = ("expert", "data", "sharded", "auto")  # "hybrid:r" is encoded as 100 + r


@dataclass(frozen=True)
class CallArguments:
    """The arguments of a layer call that every rank of the group must pass alike, as the ints
    that travel with the gathered routing (``encode``), and the check that they do."""

    top_k: int
    capacity_factor: float
    parallel: str
    overlap_degree: int | str

    def encode(self) -> list[int]:
        mode = _MODES.index(self.parallel) if self.parallel in _MODES else 100 + int(self.parallel.split(":")[1])
        degree = -1 if self.overlap_degree == "auto" else int(self.overlap_degree)
        cf_bits = struct.unpack("<q", struct.pack("<d", float(self.capacity_factor)))[0]  # exact
        return [self.top_k, cf_bits, mode, degree]

    @classmethod
    def decode(cls, ints: list[int]) -> CallArguments:
        top_k, cf_bits, mode, degree = ints
        return cls(top_k=top_k, capacity_factor=struct.unpack("<d", struct.pack("<q", cf_bits))[0],
                   parallel=_MODES[mode] if mode < len(_MODES) else f"hybrid:{mode - 100}",
                   overlap_degree="auto" if degree == -1 else degree)

    @classmethod
    def check_agree(cls, every: list[list[int]]) -> None:
        """Raise ``ValueError`` naming each argument that differs and every rank's value."""
        calls = [cls.decode(ints) for ints in every]
        diffs = [f"{name}: " + ", ".join(f"rank {r} {getattr(c, name)!r}" for r, c in enumerate(calls))
                 for name in ("top_k", "capacity_factor", "parallel", "overlap_degree")
                 if len({getattr(c, name) for c in calls}) > 1]
        if diffs:
            raise ValueError("the ranks of the expert-parallel group called the MoE layer with different "
                             "arguments (every rank must pass the same): " + "; ".join(diffs))


@dataclass(frozen=True)
class GroupRouting:
    """Every rank's routing metadata in rank order, over the group's tokens (all ranks' tokens
    concatenated): ``ids_TK`` (int64) and, when the drop policy reads it, ``priority_TK``
    (float64; None for ``"position"``); ``counts_E``, the group's assignments per expert, counted
    once here for the slot assignment and the tuner."""

    tokens_W: tuple[int, ...]
    ids_TK: torch.Tensor
    priority_TK: torch.Tensor | None
    counts_E: torch.Tensor

    @classmethod
    def from_parts(cls, parts: list[torch.Tensor], top_k: int, num_experts: int) -> GroupRouting:
        """From each rank's ``[T_r, K]`` (ids) or ``[T_r, 2K]`` (ids, priority) float64 rows."""
        rows = torch.cat(parts, dim=0)
        priority = rows[:, top_k:] if rows.shape[1] > top_k else None
        ids_TK = rows[:, :top_k].to(torch.long)
        return cls(tokens_W=tuple(p.shape[0] for p in parts), ids_TK=ids_TK, priority_TK=priority,
                   counts_E=count_ids(ids_TK, num_experts))

    @property
    def top_k(self) -> int:
        return self.ids_TK.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.ids_TK.shape[0]

    def first_token(self, rank: int) -> int:
        """Index of ``rank``'s first token in the group's tokens."""
        return sum(self.tokens_W[:rank])


@dataclass(frozen=True)
class GroupAssignment:
    """The group's kept and dropped assignments, grouped by slot (priority order inside a slot).

    Attributes:
        routing: the ``GroupRouting`` it was computed from.
        top_k: assignments per token after hidden sharding (``K * hidden_shards``).
        hidden_shards: ``n``, hidden slices per expert.
        slots_per_rank: ``e``, slots held by each rank.
        capacity: the capacity plan of the call (``C`` of the layout, the row cap).
        order_G: group flat index (``t_group * top_k + k``) of each assignment.
        expert_G: its (virtual, when sliced: ``j*E + x``) expert.
        slot_G: its global slot (rank ``slot // e`` holds it).
        pos_G: its position inside the slot.
        kept_G: whether it fits in capacity.
        src_G: the rank whose token it is; ``dst_G``: the rank that computes it.
    """

    routing: GroupRouting
    top_k: int
    hidden_shards: int
    slots_per_rank: int
    capacity: CapacityPlan
    order_G: torch.Tensor
    expert_G: torch.Tensor
    slot_G: torch.Tensor
    pos_G: torch.Tensor
    kept_G: torch.Tensor
    src_G: torch.Tensor
    dst_G: torch.Tensor

    @property
    def world(self) -> int:
        return len(self.routing.tokens_W)

    @cached_property
    def counts_WW(self) -> list[list[int]]:
        """``counts[s][d]``: kept rows rank ``s`` sends to rank ``d`` (read on the host once: the
        exchange's split sizes)."""
        W, kept = self.world, self.kept_G
        flat = torch.bincount(self.src_G[kept] * W + self.dst_G[kept], minlength=W * W)
        return flat.view(W, W).tolist()

    def sent_by(self, rank: int) -> torch.Tensor:
        """Bool mask of the kept assignments of ``rank``'s tokens, in send order (by destination
        rank, then slot, then position)."""
        return self.kept_G & (self.src_G == rank)

    def send_side(self, rank: int) -> SendSide:
        """``rank``'s sent rows: which of its assignments, in send order."""
        T, K = self.routing.tokens_W[rank], self.top_k
        device = self.order_G.device
        assign_M = self.order_G[self.sent_by(rank)] - self.routing.first_token(rank) * K
        row_A = torch.zeros(T * K, dtype=torch.long, device=device)
        row_A[assign_M] = torch.arange(assign_M.numel(), device=device)
        kept_A = None
        if self.capacity.row_cap is not None:
            kept_A = torch.zeros(T * K, dtype=torch.bool, device=device)
            kept_A[assign_M] = True
        return SendSide(assign_M=assign_M, row_A=row_A, kept_A=kept_A)

    def receive_side(self, rank: int) -> ReceiveSide:
        """The rows ``rank``'s experts receive, in arrival order (by source rank, then slot,
        then position), and the layout of its expert input."""
        e = self.slots_per_rank
        to_me = self.kept_G & (self.dst_G == rank)
        src_R, local_R, pos_R, order_R = (self.src_G[to_me], self.slot_G[to_me] - rank * e, self.pos_G[to_me],
                                          self.order_G[to_me])
        by_src = torch.sort(src_R, stable=True).indices
        src_R, local_R, pos_R, order_R = src_R[by_src], local_R[by_src], pos_R[by_src], order_R[by_src]
        R, device = local_R.numel(), local_R.device
        C = self.capacity.layout_capacity
        if C is not None:  # [e, C, D]: row l*C + pos
            input_row_R = local_R * C + pos_R
            I = e * C
        else:  # grouped by local slot, arrival order inside a slot
            input_row_R = torch.empty(R, dtype=torch.long, device=device)
            input_row_R[torch.sort(local_R, stable=True).indices] = torch.arange(R, device=device)
            I = R
        recv_row_I = torch.zeros(I, dtype=torch.long, device=device)
        recv_row_I[input_row_R] = torch.arange(R, device=device)
        valid_I = None
        if C is not None:
            valid_I = torch.zeros(I, dtype=torch.bool, device=device)
            valid_I[input_row_R] = True
        return ReceiveSide(src_R=src_R, local_R=local_R, order_R=order_R, input_row_R=input_row_R,
                           recv_row_I=recv_row_I, valid_I=valid_I, counts_e=torch.bincount(local_R, minlength=e))


@dataclass(frozen=True)
class SendSide:
    """One rank's sent rows. ``assign_M``: the local flat assignment (``t*K + k``) of each sent
    row; ``row_A``: the sent row of each local assignment (arbitrary where dropped);
    ``kept_A``: bool mask of the kept local assignments (None: nothing can be dropped)."""

    assign_M: torch.Tensor
    row_A: torch.Tensor
    kept_A: torch.Tensor | None


@dataclass(frozen=True)
class ReceiveSide:
    """The rows one rank's experts receive, in arrival order (by source rank).

    ``src_R``: source rank; ``local_R``: local slot; ``order_R``: group flat assignment index;
    ``input_row_R``: row of the expert input it fills (``I`` rows: ``e*C`` in the capacity
    layout, grouped by slot otherwise); ``recv_row_I``: the received row feeding each input row
    (arbitrary where ``valid_I`` is False); ``valid_I``: input rows holding a row (None: all);
    ``counts_e``: rows per local slot."""

    src_R: torch.Tensor
    local_R: torch.Tensor
    order_R: torch.Tensor
    input_row_R: torch.Tensor
    recv_row_I: torch.Tensor
    valid_I: torch.Tensor | None
    counts_e: torch.Tensor


def assign_group(
    routing: GroupRouting,
    *,
    num_experts: int,
    capacity_factor: float,
    drop_policy: str,
    placement: Placement,
    hidden_shards: int = 1,
) -> GroupAssignment:
    """The group's slot assignment (see module docstring). ``placement`` places the
    ``num_experts * hidden_shards`` (virtual) experts over the ranks; a non-contiguous one
    (replicas, moved experts) needs ``hidden_shards == 1``."""
    E, n, K = num_experts, hidden_shards, routing.top_k
    if placement.num_experts != E * n:
        raise ValueError(f"placement is for {placement.num_experts} experts, the call has {E} x {n} hidden shards")
    if n > 1 and not placement.is_contiguous:
        raise ValueError(f"hidden_shards={n} needs the contiguous placement")
    T = routing.num_tokens
    cap = resolve_capacity(capacity_factor, num_tokens=max(T, 1), top_k=K, num_experts=E)
    policy = None if cap.row_cap is None else drop_policy
    priority = routing.priority_TK if routing.priority_TK is not None else torch.zeros_like(routing.ids_TK, dtype=torch.float64)
    slots = assign_slots(routing.ids_TK, priority, num_experts=E, drop_policy=policy, counts_E=routing.counts_E)
    order_G, expert_G, pos_G = slots.order_A, slots.expert_A, slots.pos_A
    kept_G = torch.ones_like(order_G, dtype=torch.bool) if cap.row_cap is None else pos_G < cap.row_cap
    if n > 1:
        order_G, expert_G, pos_G, kept_G = _expand_hidden(order_G, expert_G, pos_G, kept_G, E, n)
    if placement.is_contiguous:
        slot_G = expert_G
    else:
        # rows travel by (destination rank, slot): regroup by slot (stable: priority order kept)
        kept_E = torch.bincount(expert_G[kept_G], minlength=E)
        slot_G, pos_G = _cut_replicas(placement, expert_G, pos_G, kept_E)
        by_slot = torch.sort(slot_G, stable=True).indices
        order_G, expert_G, pos_G, kept_G, slot_G = (t[by_slot] for t in (order_G, expert_G, pos_G, kept_G, slot_G))
    first_W = torch.cumsum(torch.tensor(routing.tokens_W, dtype=torch.long, device=order_G.device), 0)
    src_G = torch.bucketize(torch.div(order_G, K * n, rounding_mode="floor"), first_W, right=True)
    e = placement.slots_per_rank
    return GroupAssignment(
        routing=routing, top_k=K * n, hidden_shards=n, slots_per_rank=e, capacity=cap, order_G=order_G,
        expert_G=expert_G, slot_G=slot_G, pos_G=pos_G, kept_G=kept_G, src_G=src_G,
        dst_G=torch.div(slot_G, e, rounding_mode="floor"),
    )


def _expand_hidden(order_G: torch.Tensor, expert_G: torch.Tensor, pos_G: torch.Tensor, kept_G: torch.Tensor,
                   E: int, n: int) -> tuple[torch.Tensor, ...]:
    """Every assignment ``(t, k)`` of expert ``x`` becomes ``n`` assignments ``(t, k*n + j)`` of
    the slices ``j*E + x``, kept or dropped together; regrouped by slice (stable: priority
    order kept)."""
    j_G = torch.arange(n, device=order_G.device).repeat(order_G.numel())
    order_G, expert_G = order_G.repeat_interleave(n) * n + j_G, j_G * E + expert_G.repeat_interleave(n)
    pos_G, kept_G = pos_G.repeat_interleave(n), kept_G.repeat_interleave(n)
    by_slice = torch.sort(expert_G, stable=True).indices
    return tuple(t[by_slice] for t in (order_G, expert_G, pos_G, kept_G))


def _cut_replicas(placement: Placement, expert_G: torch.Tensor, pos_G: torch.Tensor,
                  kept_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Global slot of every assignment and its position within the slot.

    The ``k`` kept rows of expert ``x`` are cut at ``floor(cum_j * k / total)`` (``cum_j``:
    running sum of its replicas' shares), part ``j`` going to replica ``j``. Dropped
    assignments go to the last replica (they travel nowhere)."""
    replica_EN, cum_EN1, n_E = placement.tables(expert_G.device)
    cum_GN1 = cum_EN1[expert_G]
    cut_GN1 = torch.div(cum_GN1 * kept_E[expert_G].unsqueeze(1), cum_GN1[:, -1:], rounding_mode="floor")
    j_G = torch.minimum((cut_GN1[:, 1:] <= pos_G.unsqueeze(1)).sum(1), n_E[expert_G] - 1)
    start_G = cut_GN1.gather(1, j_G.unsqueeze(1)).squeeze(1)
    return replica_EN[expert_G, j_G], pos_G - start_G
