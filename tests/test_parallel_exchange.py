"""The row exchanges (``moeflow.parallel.exchange``): flat and two-level deliver the same rows in
the same order and back, and the expert-parallel layer over the two-level exchange (2 nodes x 2
ranks, pipelined too) gives the single-process result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeflow.parallel import FlatExchange, HierarchicalExchange, make_groups

from helpers import check_equivalence, seeded_layer, spawn_ranks

pytestmark = pytest.mark.distributed


def _case_hierarchical(rank: int, world: int) -> None:
    """The two-level exchange (2 nodes x 2 ranks) gives the single-process result too."""
    groups = make_groups(world, node_size=2)
    assert dist.get_world_size(groups.hierarchy.intra) == 2 and dist.get_world_size(groups.hierarchy.inter) == world // 2
    for i, (k, cf, policy) in enumerate([(2, 1.0, "position"), (2, 0.0, "position"), (1, -0.8, "score"), (2, 1.0, "bpr")]):
        tokens = [9, 0, 14, 5][:world]
        layer = seeded_layer(8, k, cf, policy, "combine", seed=300 + i)
        check_equivalence(rank, world, layer, tokens, seed=300 + i, what=f"2-level k={k} cf={cf} {policy}",
                           hierarchy=groups.hierarchy)
        # pipelined: both phases of every chunk's exchange asynchronous, forward and backward
        for degree in (2, 3):
            check_equivalence(rank, world, layer, tokens, seed=300 + i, hierarchy=groups.hierarchy,
                               overlap_degree=degree, what=f"2-level pipelined degree={degree} k={k} cf={cf} {policy}")


def _case_exchange(rank: int, world: int) -> None:
    """Flat and two-level exchanges deliver the same rows in the same order, and back."""
    groups = make_groups(world, node_size=2)
    gen = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 4, (world, world), generator=gen)
    counts[0, :] = 0  # a rank that sends nothing
    counts = counts.tolist()
    n_send = sum(counts[rank])
    # row j of rank s bound for d carries (s, d, j) so misplaced rows are visible
    dest = [d for d in range(world) for _ in range(counts[rank][d])]
    x = torch.tensor([[rank, d, j] for j, d in enumerate(dest)], dtype=torch.float64).reshape(n_send, 3)
    x.requires_grad_(True)
    flat = FlatExchange(None)(x, counts)
    two = HierarchicalExchange(None, groups.hierarchy)(x, counts)
    assert torch.equal(flat, two)
    expected_src = [s for s in range(world) for _ in range(counts[s][rank])]
    assert flat[:, 0].tolist() == expected_src and all(flat[:, 1] == rank)
    g = torch.randn(flat.shape, generator=gen, dtype=torch.float64)
    (gf,) = torch.autograd.grad(flat, x, g)
    (gt,) = torch.autograd.grad(two, x, g)
    assert torch.equal(gf, gt)


CASES = {  # looked up by the spawned ranks
    "hierarchical": _case_hierarchical,
    "exchange": _case_exchange,
}


def test_hierarchical_exchange_matches_flat_on_2x2():
    spawn_ranks(4, __name__, "exchange")


def test_hierarchical_expert_parallel_matches_single_process_on_2x2():
    spawn_ranks(4, __name__, "hierarchical")
