"""Load-aware expert placement with replicas (legend: moeflow.types; here also ``s`` slots per rank,
``N`` replicas of one expert).

Under plain expert parallelism rank ``r`` holds experts ``[r*E/W, (r+1)*E/W)``, so a hot expert
makes its rank the straggler of every step. A ``Placement`` instead gives every rank ``s``
*slots* (its memory limit, in experts) and says which global expert each slot holds; a hot
expert may hold several slots on different ranks (replicas, FasterMoE's shadows / EPLB's
redundant experts). The dispatcher splits each expert's kept assignments, in the global batch
order, into equal contiguous parts, one per replica, so every rank agrees on where each row goes
without extra communication.

Training stays the same computation: each replica computes its part of the expert's rows, and
``sync_replica_gradients`` sums the replicas' gradients, so every replica holds the gradient the
single expert would have, and (with the same optimizer state, which ``apply_placement`` copies)
takes the same optimizer step.

- ``plan_placement(load_E, world=, slots_per_rank=)``: minimise the most-loaded rank's work. Spare
  slots go to the expert with the largest load per replica (greedy: optimal for the max per-replica
  load), then replicas are placed heaviest first on the least-loaded rank with a free slot that
  does not hold that expert yet (LPT scheduling), then pairwise swaps while they lower the
  busiest rank, then the replicas' shares are shifted from busier to lighter ranks (water
  filling); never worse than the contiguous block when that is an option, and that block on a tie
  (it moves no expert from plain expert parallelism and keeps the modes that need it: the
  sharded and hybrid strategies, ``MoE.expert_range``).

Moving experts to a placement (parameters and optimizer state) and the replicas' gradients are
in ``moeflow.parallel.placement.rebalance``; this module is pure (no torch.distributed), so every rank
computes the same tables from the same placement.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch

__all__ = ["Placement", "plan_placement"]


SHARE_UNITS = 4096  # replica shares are integers out of this many (exact, same on every rank)


@dataclass(frozen=True)
class Placement:
    """Which global expert each slot of each rank holds, and which share of its rows.

    Attributes:
        num_experts: E, the number of distinct (logical) experts.
        slots: ``slots[r][l]`` = global expert held by local slot ``l`` of rank ``r``; every rank
            has the same number ``s`` of slots, every expert at least one slot, and no rank two
            slots of the same expert. Global slot id of ``(r, l)`` is ``r * s + l``.
        shares: ``shares[r][l]`` = non-negative integer weight of that replica: expert ``x``'s
            kept rows (in the global priority order) are cut into consecutive parts in
            proportion to its replicas' shares, in rank order. None: equal parts.
    """

    num_experts: int
    slots: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        E = self.num_experts
        if not isinstance(E, int) or isinstance(E, bool) or E < 1:
            raise ValueError(f"num_experts must be a positive int, got {E!r}")
        slots = tuple(tuple(int(x) for x in rank_slots) for rank_slots in self.slots)
        object.__setattr__(self, "slots", slots)
        if not slots:
            raise ValueError("slots must list at least one rank")
        s = len(slots[0])
        if s == 0 or any(len(r) != s for r in slots):
            raise ValueError(f"every rank must have the same positive number of slots, got {[len(r) for r in slots]}")
        for r, rank_slots in enumerate(slots):
            bad = [x for x in rank_slots if not 0 <= x < E]
            if bad:
                raise ValueError(f"slots[{r}] holds experts {bad} outside [0, {E})")
            if len(set(rank_slots)) != s:
                raise ValueError(f"slots[{r}]={list(rank_slots)} holds an expert twice")
        missing = sorted(set(range(E)) - {x for r in slots for x in r})
        if missing:
            raise ValueError(f"experts {missing} have no slot")
        if self.shares is not None:
            shares = tuple(tuple(int(q) for q in r) for r in self.shares)
            if [len(r) for r in shares] != [len(r) for r in slots] or any(q < 0 for r in shares for q in r):
                raise ValueError(f"shares must be non-negative integers shaped like slots, got {self.shares}")
            total = [0] * E
            for rs, rq in zip(slots, shares):
                for x, q in zip(rs, rq):
                    total[x] += q
            if any(t == 0 for t in total):
                raise ValueError(f"shares give experts {[x for x in range(E) if total[x] == 0]} no rows")
            object.__setattr__(self, "shares", shares)

    @staticmethod
    def contiguous(num_experts: int, world: int) -> Placement:
        """Plain expert parallelism: rank ``r`` holds ``[r*E/W, (r+1)*E/W)`` (built once per
        size: the per-call hybrid mode asks for one on every call)."""
        if world < 1 or num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be divisible by the world size {world}")
        return _contiguous(num_experts, world)

    @property
    def world(self) -> int:
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots[0])

    @cached_property
    def is_contiguous(self) -> bool:
        if self.num_experts % self.world:
            return False
        return self.slots == Placement.contiguous(self.num_experts, self.world).slots

    def replicas(self, expert: int) -> list[int]:
        """Global slot ids holding ``expert``, in rank order (the first is its primary)."""
        return [g for g, x in enumerate(self.flat) if x == expert]

    @cached_property
    def flat(self) -> tuple[int, ...]:
        """Global expert of each global slot id."""
        return tuple(x for r in self.slots for x in r)

    @cached_property
    def flat_shares(self) -> tuple[int, ...]:
        return (1,) * len(self.flat) if self.shares is None else tuple(q for r in self.shares for q in r)

    @cached_property
    def num_replicas(self) -> tuple[int, ...]:
        counts = [0] * self.num_experts
        for x in self.flat:
            counts[x] += 1
        return tuple(counts)

    def fraction(self, slot: int) -> float:
        """Fraction of its expert's rows that global slot ``slot`` computes."""
        x = self.flat[slot]
        return self.flat_shares[slot] / sum(self.flat_shares[g] for g in self.replicas(x))

    def rank_load(self, load_E: Sequence[float]) -> list[float]:
        """Work of every rank: each expert's load split over its replicas by their shares."""
        s = self.slots_per_rank
        return [sum(float(load_E[x]) * self.fraction(r * s + l) for l, x in enumerate(rs))
                for r, rs in enumerate(self.slots)]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(replica_EN, cum_EN1, n_E)`` as int64 tensors on ``device``: global slot ids of
        each expert's replicas (padded with the primary), the running sums of their shares
        starting at 0 (padded with the total), and the replica counts. Built once per device."""
        if device not in self._tables:
            self._tables[device] = self._build_tables(device)
        return self._tables[device]

    @cached_property
    def _tables(self) -> dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return {}

    def _build_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_max = max(self.num_replicas)
        rows, cums = [], []
        for x in range(self.num_experts):
            reps = self.replicas(x)
            cum = [0]
            for g in reps:
                cum.append(cum[-1] + self.flat_shares[g])
            rows.append(reps + [reps[0]] * (n_max - len(reps)))
            cums.append(cum + [cum[-1]] * (n_max - len(reps)))
        return (torch.tensor(rows, dtype=torch.long, device=device), torch.tensor(cums, dtype=torch.long, device=device),
                torch.tensor(self.num_replicas, dtype=torch.long, device=device))


@lru_cache(maxsize=64)
def _contiguous(num_experts: int, world: int) -> Placement:
    e = num_experts // world
    return Placement(num_experts=num_experts, slots=tuple(tuple(range(r * e, (r + 1) * e)) for r in range(world)))


def plan_placement(load_E: Sequence[float] | torch.Tensor, *, world: int, slots_per_rank: int) -> Placement:
    """A placement of ``E`` experts over ``world`` ranks of ``slots_per_rank`` slots each that
    minimises the most-loaded rank's work (see module docstring). ``load_E``: tokens (or any
    non-negative work measure) per expert, e.g. ``MoE.load_stats()`` summed over the group."""
    load = [float(v) for v in (load_E.tolist() if isinstance(load_E, torch.Tensor) else load_E)]
    E = len(load)
    if E == 0 or any(not v >= 0 for v in load):
        raise ValueError(f"load_E must be a non-empty sequence of non-negative numbers, got {load}")
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(slots_per_rank, int) or slots_per_rank < 1:
        raise ValueError(f"slots_per_rank must be a positive int, got {slots_per_rank!r}")
    total = world * slots_per_rank
    if total < E:
        raise ValueError(f"{world} ranks x slots_per_rank={slots_per_rank} = {total} slots cannot hold {E} experts")
    if slots_per_rank > E:
        raise ValueError(f"slots_per_rank={slots_per_rank} exceeds num_experts={E} (a rank holds an expert once)")
    # replica counts: each spare slot to the expert with the largest load per replica (ties: lower
    # id); at most one replica per rank
    n = [1] * E
    heap = [(-load[x], x) for x in range(E) if world > 1]
    heapq.heapify(heap)
    for _ in range(total - E):
        _, x = heapq.heappop(heap)
        n[x] += 1
        if n[x] < world:
            heapq.heappush(heap, (-load[x] / n[x], x))
    # replicas heaviest first, each on the least-loaded rank with a free slot not holding it yet
    items = sorted(((load[x] / n[x], x) for x in range(E) for _ in range(n[x])), key=lambda t: (-t[0], t[1]))
    rank_load = [0.0] * world
    holds: list[list[int]] = [[] for _ in range(world)]
    for w, x in items:
        free = [r for r in range(world) if len(holds[r]) < slots_per_rank and x not in holds[r]]
        if not free:
            raise ValueError(f"cannot place {n[x]} replicas of expert {x} on {world} ranks of {slots_per_rank} slots")
        r = min(free, key=lambda r: (rank_load[r], len(holds[r]), r))
        holds[r].append(x)
        rank_load[r] += w
    _improve_by_swaps(holds, [load[x] / n[x] for x in range(E)])
    slots = tuple(tuple(sorted(h)) for h in holds)
    plan = Placement(num_experts=E, slots=slots, shares=_balance_shares(slots, load))
    if E % world == 0 and slots_per_rank == E // world:
        plain = Placement.contiguous(E, world)
        if max(plain.rank_load(load)) <= max(plan.rank_load(load)):  # a tie too: see the module docstring
            return plain
    return plan


def _balance_shares(slots: tuple[tuple[int, ...], ...], load: list[float], rounds: int = 2_000) -> tuple[tuple[int, ...], ...]:
    """Shift row shares between replicas of the same expert from the busiest rank to lighter
    ones (water filling), then round them to integers out of ``SHARE_UNITS`` per expert.

    Stops when no shift is worth making, or after ``rounds`` shifts: a bound on planning time
    (past about 32 ranks the pairwise shifts can take 10^4 to 10^5 rounds, seconds, to settle,
    for a busiest rank about 0.2% lighter at most)."""
    W = len(slots)
    holders: dict[int, list[int]] = {}
    for r, rs in enumerate(slots):
        for x in rs:
            holders.setdefault(x, []).append(r)
    share = {(r, x): 1.0 / len(holders[x]) for r, rs in enumerate(slots) for x in rs}
    rank_load = [sum(load[x] * share[(r, x)] for x in rs) for r, rs in enumerate(slots)]
    for _ in range(rounds):
        a = max(range(W), key=lambda r: rank_load[r])
        best = None  # (resulting load of the lighter rank, expert, lighter rank)
        for x in slots[a]:
            if load[x] <= 0 or share[(a, x)] <= 0:
                continue
            for b in holders[x]:
                if b != a and rank_load[b] < rank_load[a] and (best is None or rank_load[b] < best[0]):
                    best = (rank_load[b], x, b)
        if best is None:
            break
        _, x, b = best
        delta = min(share[(a, x)], (rank_load[a] - rank_load[b]) / (2 * load[x]))
        if delta * load[x] <= 1e-9 * rank_load[a]:
            break
        share[(a, x)] -= delta
        share[(b, x)] += delta
        rank_load[a] -= delta * load[x]
        rank_load[b] += delta * load[x]
    units = {}
    for x, rs in holders.items():
        q = [int(share[(r, x)] * SHARE_UNITS) for r in rs]
        q[max(range(len(rs)), key=lambda i: share[(rs[i], x)])] += SHARE_UNITS - sum(q)
        units.update({(r, x): v for r, v in zip(rs, q)})
    return tuple(tuple(units[(r, x)] for x in rs) for r, rs in enumerate(slots))


def _improve_by_swaps(holds: list[list[int]], weight_E: list[float], max_rounds: int = 10_000) -> None:
    """Local search after the greedy placement (which can strand light experts on a heavy rank
    once the others are full): swap one expert of the most-loaded rank with one of another
    rank while that lowers the larger of the two loads; in place."""
    load = [sum(weight_E[x] for x in h) for h in holds]
    for _ in range(max_rounds):
        r = max(range(len(holds)), key=lambda i: load[i])
        best = None
        for i, x in enumerate(holds[r]):
            for r2, h2 in enumerate(holds):
                if r2 == r:
                    continue
                for j, y in enumerate(h2):
                    if x == y or y in holds[r] or x in h2:
                        continue
                    worse = max(load[r] - weight_E[x] + weight_E[y], load[r2] - weight_E[y] + weight_E[x])
                    if worse < load[r] - 1e-12 * max(1.0, load[r]) and (best is None or worse < best[0]):
                        best = (worse, i, r2, j)
        if best is None:
            return
        _, i, r2, j = best
        x, y = holds[r][i], holds[r2][j]
        holds[r][i], holds[r2][j] = y, x
        load[r] += weight_E[y] - weight_E[x]
        load[r2] += weight_E[x] - weight_E[y]
