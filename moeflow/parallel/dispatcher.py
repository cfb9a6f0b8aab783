"""The expert-parallel dispatcher: experts spread over a process group (legend: moeflow.types).

It implements the ``Dispatcher`` protocol for ``expert_parallel``: per call it gathers the
group's routing metadata (the one collective every call makes, so that every rank agrees on the
global batch) and runs the call with one strategy, chosen by the call's ``parallel`` and
``overlap_degree`` (defaults: its ``ParallelConfig``):

- ``"expert"`` (``moeflow.parallel.strategies.expert``, pipelined with ``overlap_degree > 1``): rows travel;
- ``"data"`` (``moeflow.parallel.strategies.data``): weights travel to the rows;
- ``"sharded"`` / ``"hybrid:r"`` (``moeflow.parallel.strategies.sharded`` / ``hybrid``): hidden slices of
  every expert travel;
- ``"auto"``: the tuner (``moeflow.parallel.placement.tuner``) times the candidates and keeps the fastest.

Semantics: the result equals the single-process layer on the batch made by concatenating every
rank's tokens in rank order, in every capacity mode and drop policy, whatever the strategy
(``moeflow.parallel.exchange.assignment``). Ranks with different token counts (zero included) always
agree on ``C`` and on the split sizes: no hang.

Rank ``r`` of ``W`` holds the slots ``placement.slots[r]`` (contiguous blocks of ``E / W``
experts by default; ``set_placement`` changes it, ``moeflow.parallel.placement.rebalance`` moves the
weights) of the ``E * hidden_shards`` stored experts (``hidden_shards > 1``: hidden slices).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from moeflow.config import DispatchConfig, ParallelConfig, hybrid_shards
from moeflow.experts.ffn import Experts
from moeflow.parallel.exchange.assignment import CallArguments, GroupRouting
from moeflow.parallel.comm import all_gather_rows_with_header
from moeflow.parallel.strategies.data import DataMode
from moeflow.parallel.exchange.alltoall import FlatExchange, HierarchicalExchange, Hierarchy
from moeflow.parallel.strategies.expert import ExpertMode
from moeflow.parallel.strategies.hybrid import HybridMode
from moeflow.parallel.placement.plan import Placement
from moeflow.parallel.strategies.sharded import ShardedMode
from moeflow.parallel.strategies.base import Call, ExpertGroup, Strategy
from moeflow.parallel.placement.tuner import ParallelTuner, Setting
from moeflow.types import ExpertLayout, RoutingResult

__all__ = ["ExpertParallelDispatcher"]


class ExpertParallelDispatcher:
    """``Dispatcher`` over an expert-parallel process group (see module docstring)."""

    collective = True  # every rank must call run, even with no tokens

    def __init__(
        self,
        *,
        num_experts: int,
        group: dist.ProcessGroup | None,
        config: DispatchConfig | None = None,
        parallel: ParallelConfig | None = None,
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
        self.group = group
        self.world = W
        self.rank = dist.get_rank(group)
        self.config = config if config is not None else DispatchConfig()
        self.parallel = parallel if parallel is not None else ParallelConfig()
        self.hidden_shards = hidden_shards
        self.exchange = FlatExchange(group) if hierarchy is None else HierarchicalExchange(group, hierarchy)
        self.tuner = ParallelTuner(group, self.parallel.tuner)
        self.set_placement(Placement.contiguous(num_experts * hidden_shards, W))

    @property
    def placement(self) -> Placement:
        return self.where.placement

    def set_placement(self, placement: Placement) -> None:
        """Route to the slots of ``placement`` (``moeflow.parallel.placement.plan``); the experts
        module must hold this rank's slots in that order (``apply_placement`` does both)."""
        n = self.hidden_shards
        if placement.num_experts != self.num_experts * n or placement.world != self.world:
            raise ValueError(f"placement is for {placement.num_experts} experts on {placement.world} ranks; "
                             f"this dispatcher has {self.num_experts} experts on {self.world} ranks")
        if n > 1 and not placement.is_contiguous:
            raise ValueError("load-aware placement of hidden-sharded experts is not supported (hidden_shards="
                             f"{n}); use hidden_shards=1")
        self.where = ExpertGroup(group=self.group, world=self.world, rank=self.rank, exchange=self.exchange,
                                 dispatch=self.config, num_experts=self.num_experts, placement=placement,
                                 hidden_shards=n)
        E, s = self.num_experts, placement.slots_per_rank
        held = placement.slots[self.rank]  # stored (virtual) experts: slice j of expert x is j*E + x
        self.layout = ExpertLayout(
            num_experts=E,
            slot_experts=tuple(v % E for v in held),
            slot_primary=tuple(v // E == 0 if n > 1 else placement.replicas(v)[0] == self.rank * s + l
                               for l, v in enumerate(held)),
            hidden_shards=n,
            slot_parts=tuple(v // E for v in held),
        )
        self.tuner.reset()  # the fastest setting may differ under the new placement

    def gather_routing(self, routing: RoutingResult, *, capacity_factor: float, parallel: str = "expert",
                       overlap_degree: int | str = 1) -> GroupRouting:
        """Every rank's routing metadata (ids, and the priority when the drop policy reads it),
        in rank order: the one exchange that makes every rank agree on the global batch. The
        call's arguments that every rank must pass alike travel with it (in the row-count
        collective, so no extra message) and are checked first: a mismatch raises
        ``ValueError`` on every rank, naming the argument and each rank's value, instead of a
        collective mismatch inside the backend or a silently different result."""
        meta = routing.ids_TK.detach().to(torch.float64)
        if self.config.drop_policy != "position":
            meta = torch.cat([meta, routing.priority_TK.detach().to(torch.float64)], dim=1)
        call = CallArguments(top_k=routing.top_k, capacity_factor=capacity_factor, parallel=parallel,
                             overlap_degree=overlap_degree)
        parts = all_gather_rows_with_header(meta, call.encode(), self.group, check=CallArguments.check_agree)
        return GroupRouting.from_parts(parts, routing.top_k, routing.logits_TE.shape[1])

    def strategy(self, parallel: str, overlap_degree: int) -> Strategy:
        """The strategy that runs ``parallel`` mode (not ``"auto"``) at ``overlap_degree``."""
        shards = hybrid_shards(parallel)
        if parallel != "expert" and overlap_degree != 1:
            raise ValueError(f"overlap_degree={overlap_degree} applies to parallel='expert', not {parallel!r}")
        if shards is not None:
            return HybridMode(shards)
        if parallel == "expert":
            return ExpertMode(overlap_degree)
        if parallel == "data":
            return DataMode()
        if parallel == "sharded":
            return ShardedMode()
        raise ValueError(f"parallel must be 'expert', 'data', 'sharded', 'hybrid:r' or 'auto', got {parallel!r}")

    def candidates(self, experts: Experts, parallel: str, overlap_degree: int | str) -> list[Setting]:
        """The settings ``"auto"`` chooses from for a call with these arguments: the expert mode
        at every tuned degree, and (``parallel="auto"``) every other mode that can run
        ``experts`` here."""
        degrees = self.parallel.tuner.degrees if overlap_degree == "auto" else (int(overlap_degree),)
        out: list[Setting] = [("expert", d) for d in degrees] if parallel in ("expert", "auto") else []
        modes = ["data"] if parallel == "data" else []
        if parallel == "auto":
            modes = ["data", "sharded"] + [f"hybrid:{r}" for r in range(2, self.world + 1) if self.world % r == 0]
        out += [(mode, 1) for mode in modes if self.strategy(mode, 1).unsupported(self.where, experts) is None]
        if not out:
            raise ValueError(f"parallel={parallel!r} cannot run {type(experts).__name__} here: "
                             f"{self.strategy(parallel, 1).unsupported(self.where, experts)}")
        return out

    def run(
        self, x_TD: torch.Tensor, routing: RoutingResult, experts: Experts, *, capacity_factor: float,
        overlap_degree: int | str | None = None, parallel: str | None = None,
    ) -> torch.Tensor:
        """Dispatch, run ``experts`` and combine over the group (``Dispatcher.run``): every rank
        of the group calls it for every call of the layer, in the same order."""
        mode = self.parallel.parallel if parallel is None else parallel
        degree = self.parallel.overlap_degree if overlap_degree is None else overlap_degree
        group_routing = self.gather_routing(routing, capacity_factor=capacity_factor, parallel=mode, overlap_degree=degree)
        call = Call(x_TD=x_TD, routing=routing, experts=experts, capacity_factor=capacity_factor,
                    group_routing=group_routing)
        if "auto" in (mode, degree):
            return self.tuner.run(
                call, parallel=mode, overlap_degree=degree,
                candidates=lambda: self.candidates(experts, mode, degree),
                run=lambda setting, x: self._run(self.strategy(*setting), dataclasses.replace(call, x_TD=x)),
            )
        return self._run(self.strategy(mode, int(degree)), call)

    def _run(self, strategy: Strategy, call: Call) -> torch.Tensor:
        why = strategy.unsupported(self.where, call.experts)
        if why is not None:
            raise ValueError(why)
        return strategy.run(self.where, call)
