"""Row exchanges between the ranks of an expert-parallel group (legend: moeflow.types).

An exchange takes this rank's send buffer, whose rows are grouped by destination rank, and
returns the rows every rank sent to it, grouped by source rank, given the full ``[W, W]`` count
matrix ``counts[s][d]`` (rows from s to d; every rank knows it). Both exchanges give identical
results and are differentiable (the backward runs the same exchange in reverse).

- ``FlatExchange``: one ``all_to_all_single`` over the group: W-1 messages per rank.
- ``HierarchicalExchange`` (Tutel's 2DH): with ``W = N nodes x L ranks per node`` and rank
  ``r = n*L + l``: (1) inside each node, send to local peer ``l'`` everything bound for local
  index ``l'`` on any node; (2) across nodes, between the ranks with the same local index, send
  each node its rows. L-1 intra-node plus N-1 inter-node messages per rank instead of W-1, and the
  inter-node messages are L times larger, which is what pays off at many nodes. The block
  reorders between the phases are row gathers; the result is already in source-rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeflow.kernels.gather import gather_rows
from moeflow.parallel.comm import CommTimer, all_to_all_rows, start_all_to_all_rows, wait_all_to_all_rows

__all__ = ["FlatExchange", "HierarchicalExchange", "Hierarchy", "permute_blocks"]

Counts = list[list[int]]


def permute_blocks(x_ND: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Reorder consecutive row blocks of ``sizes`` into block order ``order`` (a gather whose
    backward is the inverse gather)."""
    starts = [0]
    for s in sizes[:-1]:
        starts.append(starts[-1] + s)
    if order == sorted(order):
        return x_ND
    device = x_ND.device
    # not in order, so at least two blocks: the list ``cat`` joins is never empty
    index = torch.cat([torch.arange(starts[b], starts[b] + sizes[b], device=device) for b in order])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=device)
    return gather_rows(x_ND, index, None, inverse.view(-1, 1), None)


class _Started:
    """One asynchronous phase in flight: its output buffer, pending handles and splits."""

    __slots__ = ("buf", "pending", "send", "recv", "group", "then")

    def __init__(self, x_ND: torch.Tensor, send: list[int], recv: list[int], group, then=None) -> None:  # type: ignore[no-untyped-def]
        self.buf, self.pending = start_all_to_all_rows(x_ND, send, recv, group)
        self.send, self.recv, self.group, self.then = send, recv, group, then

    def wait(self) -> torch.Tensor:
        return wait_all_to_all_rows(self.buf, self.pending, self.send, self.recv, self.group)


class FlatExchange:
    """One all-to-all over the whole group.

    Besides the blocking call, exchanges run asynchronously in three steps (the pipelined
    dispatcher uses them; every rank must take them in the same order): ``start`` launches the
    first message phase, ``relay`` waits for it and launches the next (nothing to do here: one
    phase), ``finish`` waits and returns the received rows. Differentiable, and asynchronous in
    backward too (``moeflow.parallel.comm.start_all_to_all_rows``)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timer: CommTimer | None = None

    def __call__(self, x_ND: torch.Tensor, counts: Counts) -> torch.Tensor:
        r, W = self.rank, self.world
        return all_to_all_rows(x_ND, counts[r], [counts[s][r] for s in range(W)], self.group, self.timer)

    def start(self, x_ND: torch.Tensor, counts: Counts) -> _Started:
        r, W = self.rank, self.world
        return _Started(x_ND, counts[r], [counts[s][r] for s in range(W)], self.group)

    def relay(self, started: _Started) -> _Started:
        return started

    def finish(self, started: _Started) -> torch.Tensor:
        return started.wait()


@dataclass(frozen=True)
class Hierarchy:
    """The node structure of an expert-parallel group for the two-level exchange.

    ``intra``: this rank's group of ranks on the same node (group ranks ``n*L .. n*L+L-1`` of
    the expert group, in order); ``inter``: the ranks with the same local index on every node
    (``l, L+l, 2L+l, ...``, in order); ``node_size``: L. Build it with
    ``moeflow.parallel.make_groups(..., node_size=L)``.
    """

    intra: dist.ProcessGroup
    inter: dist.ProcessGroup
    node_size: int


class HierarchicalExchange:
    """Two-level exchange: inside nodes, then across nodes (see module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, hierarchy: Hierarchy) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        L = hierarchy.node_size
        if L < 1 or self.world % L:
            raise ValueError(f"node_size={L} must divide the expert-parallel group size {self.world}")
        if dist.get_world_size(hierarchy.intra) != L or dist.get_world_size(hierarchy.inter) != self.world // L:
            raise ValueError(
                f"hierarchy groups have sizes {dist.get_world_size(hierarchy.intra)} x "
                f"{dist.get_world_size(hierarchy.inter)}, expected {L} ranks per node x {self.world // L} nodes"
            )
        self.hierarchy = hierarchy
        self.timer: CommTimer | None = None

    def _phases(self, counts: Counts) -> tuple:  # type: ignore[type-arg]
        """The block orders and splits of both phases for ``counts``."""
        L = self.hierarchy.node_size
        N = self.world // L
        n, l = divmod(self.rank, L)
        rank_of = lambda node, local: node * L + local  # noqa: E731
        # phase 1, inside the node: blocks (m, l') -> order (l', m), send to local peer l'
        order1 = [rank_of(m, lp) for lp in range(L) for m in range(N)]
        send1 = [sum(counts[self.rank][rank_of(m, lp)] for m in range(N)) for lp in range(L)]
        recv1 = [sum(counts[rank_of(n, ls)][rank_of(m, l)] for m in range(N)) for ls in range(L)]
        # phase 2, across nodes: blocks (ls, m) -> order (m, ls), send to node m
        sizes1 = [counts[rank_of(n, ls)][rank_of(m, l)] for ls in range(L) for m in range(N)]
        order2 = [ls * N + m for m in range(N) for ls in range(L)]
        send2 = [sum(counts[rank_of(n, ls)][rank_of(m, l)] for ls in range(L)) for m in range(N)]
        recv2 = [sum(counts[rank_of(mm, ls)][self.rank] for ls in range(L)) for mm in range(N)]
        return order1, send1, recv1, sizes1, order2, send2, recv2

    def __call__(self, x_ND: torch.Tensor, counts: Counts) -> torch.Tensor:
        order1, send1, recv1, sizes1, order2, send2, recv2 = self._phases(counts)
        x1 = permute_blocks(x_ND, counts[self.rank], order1)
        y1 = all_to_all_rows(x1, send1, recv1, self.hierarchy.intra, self.timer)
        x2 = permute_blocks(y1, sizes1, order2)
        # arrives grouped by (source node, source local index) = source rank order
        return all_to_all_rows(x2, send2, recv2, self.hierarchy.inter, self.timer)

    # the asynchronous steps (see ``FlatExchange``): start = phase 1 launched, relay = phase 1
    # received and phase 2 launched, finish = phase 2 received

    def start(self, x_ND: torch.Tensor, counts: Counts) -> _Started:
        order1, send1, recv1, sizes1, order2, send2, recv2 = self._phases(counts)
        x1 = permute_blocks(x_ND, counts[self.rank], order1)
        return _Started(x1, send1, recv1, self.hierarchy.intra, then=(sizes1, order2, send2, recv2))

    def relay(self, started: _Started) -> _Started:
        if started.then is None:  # already in phase 2
            return started
        sizes1, order2, send2, recv2 = started.then
        x2 = permute_blocks(started.wait(), sizes1, order2)
        return _Started(x2, send2, recv2, self.hierarchy.inter)

    def finish(self, started: _Started) -> torch.Tensor:
        return self.relay(started).wait()
