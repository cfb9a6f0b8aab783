"""What every way of running an expert-parallel call shares (legend: moeflow.types).

A *strategy* runs one call of one layer over the group in its own way (rows travel to the
experts, weights travel to the rows, ...) and returns ``y_TD``; it holds no state between
calls. The dispatcher (``moeflow.parallel.dispatcher``) picks one per call, directly or through
the tuner, and hands it:

- ``ExpertGroup``: where the call runs (process group, rank, exchange, the expert placement
  and hidden sharding, the dispatch settings), replaced whenever the placement changes;
- ``Call``: what to run (tokens, routing, experts, capacity factor) and the group's routing,
  gathered once per call before any strategy runs (the one collective every strategy needs).

Every strategy starts from ``ExpertGroup.assign``: the same group-wide slot assignment, so drops
and capacity never depend on the strategy and every strategy gives the single-process result
(to rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from moeflow.config import DispatchConfig
from moeflow.experts.ffn import Experts
from moeflow.parallel.exchange.assignment import GroupAssignment, GroupRouting, assign_group
from moeflow.parallel.exchange.alltoall import FlatExchange, HierarchicalExchange
from moeflow.parallel.placement.plan import Placement
from moeflow.types import RoutingResult

__all__ = ["ExpertGroup", "Call", "Strategy"]


@dataclass(frozen=True)
class ExpertGroup:
    """An expert-parallel group as a call sees it.

    ``placement`` places the ``num_experts * hidden_shards`` stored (virtual) experts over the
    ranks; this rank's experts module holds ``placement.slots[rank]`` in that order."""

    group: dist.ProcessGroup | None
    world: int
    rank: int
    exchange: FlatExchange | HierarchicalExchange
    dispatch: DispatchConfig
    num_experts: int
    placement: Placement
    hidden_shards: int

    def assign(self, call: Call, *, hidden_shards: int | None = None) -> GroupAssignment:
        """The group's slot assignment for ``call`` over the stored layout, or (``hidden_shards``
        given) over that many contiguous hidden slices per expert (the per-call hybrid mode)."""
        if hidden_shards is None:
            placement, n = self.placement, self.hidden_shards
        else:
            placement, n = Placement.contiguous(self.num_experts * hidden_shards, self.world), hidden_shards
        return assign_group(call.group_routing, num_experts=self.num_experts, capacity_factor=call.capacity_factor,
                            drop_policy=self.dispatch.drop_policy, placement=placement, hidden_shards=n)


@dataclass(frozen=True)
class Call:
    """One layer call: ``x_TD`` and ``routing`` are this rank's, ``group_routing`` the whole
    group's (``ExpertParallelDispatcher.gather_routing``)."""

    x_TD: torch.Tensor
    routing: RoutingResult
    experts: Experts
    capacity_factor: float
    group_routing: GroupRouting


class Strategy(Protocol):
    """One way of running a call over the group."""

    def unsupported(self, where: ExpertGroup, experts: Experts) -> str | None:
        """Why this strategy cannot run ``experts`` in ``where`` (None when it can)."""
        ...

    def run(self, where: ExpertGroup, call: Call) -> torch.Tensor:
        """``y_TD`` of ``call``: the single-process result on the group's batch, this rank's rows."""
        ...
