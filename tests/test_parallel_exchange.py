"""The row exchanges (``moeflow.parallel.exchange.alltoall``): flat and two-level deliver the same rows in
the same order and back, and the expert-parallel layer over the two-level exchange (2 nodes x 2
ranks, pipelined too) gives the single-process result. The two-level exchange's phase plan is
also checked in one process on node shapes that 4 gloo ranks cannot make (3 x 2, 2 x 3, 1 x 3,
3 x 1), by carrying every rank's rows through both phases by hand, and both exchanges (blocking
and asynchronous) run on threads standing in for the ranks of an expert group that is not the
world, which shows which group and timer every call is given."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from types import SimpleNamespace

from moeflow.parallel import FlatExchange, HierarchicalExchange, make_groups
from moeflow.parallel.exchange.alltoall import permute_blocks

from helpers import check_equivalence, seeded_layer, spawn_ranks


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
    _chunked(rank, world, groups, torch.Generator().manual_seed(13 + rank))


def _chunked(rank: int, world: int, groups, gen) -> None:  # type: ignore[no-untyped-def]
    """The pipelined call's chunked exchanges (``moeflow.parallel.exchange.chunked``): the flat
    one (slices of one tensor each way), the phased one over the flat and the two-level
    exchange, and one blocking exchange per chunk deliver the same rows and bring the same
    rows home, and give the same gradients; chunks with no rows (everywhere, or from one rank)
    included."""
    from moeflow.parallel.exchange.chunked import FlatChunks, PhasedChunks, chunked_exchange

    same = torch.Generator().manual_seed(12)  # every rank draws the same counts
    counts_nWW = [torch.randint(0, 4, (world, world), generator=same).tolist() for _ in range(3)]
    counts_nWW[1] = [[0] * world for _ in range(world)]  # a chunk nobody sends anything in
    counts_nWW[2][0] = [0] * world  # rank 0 sends nothing in chunk 2
    M = sum(sum(c[rank]) for c in counts_nWW)
    x = torch.randn(M, 3, generator=gen, dtype=torch.float64)
    w = [torch.randn(sum(c[s][rank] for s in range(world)), 3, generator=gen, dtype=torch.float64) for c in counts_nWW]
    g = torch.randn(M, 3, generator=gen, dtype=torch.float64)
    flat, two = FlatExchange(None), HierarchicalExchange(None, groups.hierarchy)
    assert isinstance(chunked_exchange(flat, counts_nWW), FlatChunks)
    assert isinstance(chunked_exchange(two, counts_nWW), PhasedChunks)
    results = []
    for cx in (FlatChunks(flat, counts_nWW), PhasedChunks(flat, counts_nWW), PhasedChunks(two, counts_nWW)):
        xi = x.clone().requires_grad_(True)
        cx.scatter(xi * 1.0)
        received = [cx.receive(i) for i in range(3)]
        for i, r in enumerate(received):
            cx.send_home(i, r * w[i])  # rows of each chunk scaled: the gradient of w sees the routes
        home = cx.home()
        results.append([r.detach() for r in received] + [home.detach(), *torch.autograd.grad(home, [xi], g)])
    # reference: one blocking flat exchange per chunk, there and back
    xi = x.clone().requires_grad_(True)
    parts = xi.split([sum(c[rank]) for c in counts_nWW])
    received = [flat(p, c) for p, c in zip(parts, counts_nWW)]
    homes = [flat(r * w[i], [list(col) for col in zip(*c)]) for i, (r, c) in enumerate(zip(received, counts_nWW))]
    home = torch.cat(homes)
    want = [r.detach() for r in received] + [home.detach(), *torch.autograd.grad(home, [xi], g)]
    for got in results:
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


CASES = {  # looked up by the spawned ranks
    "hierarchical": _case_hierarchical,
    "exchange": _case_exchange,
}


@pytest.mark.distributed
def test_hierarchical_exchange_matches_flat_on_2x2():
    spawn_ranks(4, __name__, "exchange")


@pytest.mark.distributed
def test_hierarchical_expert_parallel_matches_single_process_on_2x2():
    spawn_ranks(4, __name__, "hierarchical")


def _phase_plan(rank: int, world: int, node_size: int) -> HierarchicalExchange:
    """The exchange of ``rank`` without a process group: ``_phases`` reads only these fields."""
    ex = HierarchicalExchange.__new__(HierarchicalExchange)
    ex.rank, ex.world, ex.hierarchy = rank, world, SimpleNamespace(node_size=node_size)
    return ex


def _split(x_ND: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    assert x_ND.shape[0] == sum(sizes), (x_ND.shape, sizes)
    return list(torch.split(x_ND, sizes))


@pytest.mark.reference
@pytest.mark.parametrize("nodes,local", [(3, 2), (2, 3), (1, 3), (3, 1), (2, 2)])
def test_two_level_phase_plan_delivers_every_row_in_source_order(nodes, local, gen):
    """Each rank's rows, labelled (source, destination, position), go through phase 1 (inside
    the node: rank (n, l) sends its blocks for local index l' to (n, l')) and phase 2 (across
    nodes: (n, l) sends to (m, l)) as ``_phases`` plans them, with the all-to-alls done by
    hand: every rank ends with exactly the rows bound for it, grouped by source rank in order,
    and each phase's receive sizes are what its senders send."""
    W, L = nodes * local, local
    counts = torch.randint(0, 4, (W, W), generator=gen)
    counts[0, :] = 0  # a rank that sends nothing
    counts[:, W - 1] = 0  # a rank that receives nothing
    counts = counts.tolist()
    plans = [_phase_plan(r, W, L)._phases(counts) for r in range(W)]
    x = [torch.tensor([[r, d, j] for d in range(W) for j in range(counts[r][d])], dtype=torch.float64).reshape(-1, 3)
         for r in range(W)]
    # phase 1: inside each node
    x1 = [permute_blocks(x[r], counts[r], plans[r][0]) for r in range(W)]
    out1 = [_split(x1[r], plans[r][1]) for r in range(W)]  # [r][l']: to local peer l'
    y1 = []
    for r in range(W):
        n, l = divmod(r, L)
        parts = [out1[n * L + ls][l] for ls in range(L)]
        assert [p.shape[0] for p in parts] == plans[r][2], f"rank {r}: phase-1 receive sizes"
        y1.append(torch.cat(parts))
    # phase 2: across nodes, between the ranks with the same local index
    x2 = [permute_blocks(y1[r], plans[r][3], plans[r][4]) for r in range(W)]
    out2 = [_split(x2[r], plans[r][5]) for r in range(W)]  # [r][m]: to node m
    for r in range(W):
        n, l = divmod(r, L)
        parts = [out2[m * L + l][n] for m in range(nodes)]
        assert [p.shape[0] for p in parts] == plans[r][6], f"rank {r}: phase-2 receive sizes"
        got = torch.cat(parts)
        want = [[s, r, j] for s in range(W) for j in range(counts[s][r])]
        assert got.tolist() == want, f"rank {r} of {nodes} x {local}: {got.tolist()} != {want}"


@pytest.mark.reference
def test_permute_blocks_reorders_blocks_and_back(gen):
    """``permute_blocks`` puts block ``order[i]`` i-th (empty blocks too), and its gradient goes
    back to the rows it came from."""
    sizes, order = [2, 0, 3, 1], [3, 0, 2, 1]
    x = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    y = permute_blocks(x, sizes, order)
    starts = [0, 2, 2, 5]
    want = torch.cat([x[starts[b]:starts[b] + sizes[b]] for b in order])
    assert torch.equal(y, want)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    (gx,) = torch.autograd.grad(y, x, g)
    (gw,) = torch.autograd.grad(want, x, g)
    assert torch.equal(gx, gw)
    assert permute_blocks(x, sizes, [0, 1, 2, 3]) is x  # in order: no copy
    assert permute_blocks(x[:0], [], []).shape == (0, 4)  # no blocks
    # every index it builds is on x's device (meta as the default device would catch one that is not)
    with torch.device("meta"):
        y = permute_blocks(x, sizes, order)
        (gm,) = torch.autograd.grad(y, x, g)
    assert y.device.type == "cpu" and torch.equal(y, want) and torch.equal(gm, gw)


class _Group:
    """A stand-in process group: ``members`` are global ranks, ``me`` this rank's index."""

    def __init__(self, members: tuple[int, ...], me: int) -> None:
        self.members, self.me = members, me


class _Net:
    """Collectives between threads, one thread per rank: what ``moeflow.parallel.exchange.alltoall`` calls
    (``dist.get_rank/get_world_size`` and the three row all-to-alls), each checking its splits.
    Global ranks start at 10 in a world of 99 ranks, so a group of ``None`` (the world) gives a
    rank and size no expert group has, and a mix-up shows. Every call is recorded per thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._boxes: dict = {}
        self._barriers: dict = {}
        self.calls: dict[int, list] = {}

    @staticmethod
    def get_rank(group: _Group | None) -> int:
        return threading.current_thread().rank if group is None else group.me  # type: ignore[attr-defined]

    @staticmethod
    def get_world_size(group: _Group | None) -> int:
        return 99 if group is None else len(group.members)

    def _exchange(self, what: str, x_ND: torch.Tensor, send: list[int], recv: list[int], group: _Group, timer) -> torch.Tensor:  # type: ignore[no-untyped-def]
        assert isinstance(group, _Group), f"{what}: group {group!r}"
        me_global = group.members[group.me]
        self.calls.setdefault(me_global, []).append((what, group.members, list(send), list(recv), timer))
        assert len(send) == len(recv) == len(group.members) and sum(send) == x_ND.shape[0], (what, send, recv)
        with self._lock:
            barrier = self._barriers.setdefault(group.members, threading.Barrier(len(group.members), timeout=20))
            box = self._boxes.setdefault(group.members, {})
        box[group.me] = torch.split(x_ND, list(send))
        barrier.wait()
        parts = [box[s][group.me] for s in range(len(group.members))]
        barrier.wait()  # everyone has read before the next call of this group refills the box
        assert [p.shape[0] for p in parts] == list(recv), f"{what}: received {[p.shape[0] for p in parts]}, expected {recv}"
        return torch.cat(parts)

    def all_to_all_rows(self, x_ND, send, recv, group, timer=None):  # type: ignore[no-untyped-def]
        return self._exchange("blocking", x_ND, send, recv, group, timer)

    def start_all_to_all_rows(self, x_ND, send, recv, group):  # type: ignore[no-untyped-def]
        return self._exchange("start", x_ND, send, recv, group, None), ("pending", list(send), list(recv), group)

    def wait_all_to_all_rows(self, out_MD, pending, send, recv, group):  # type: ignore[no-untyped-def]
        assert pending == ("pending", list(send), list(recv), group), "wait with another start's splits or group"
        return out_MD


def _run_ranks(world: int, fn) -> list:  # type: ignore[no-untyped-def]
    """``fn(r)`` on ``world`` threads (global rank 10 + r); the results, or the first error."""
    out: list = [None] * world
    errors: list = []

    def body(r: int) -> None:
        threading.current_thread().rank = 10 + r  # type: ignore[attr-defined]
        try:
            out[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.fixture
def net(monkeypatch):  # type: ignore[no-untyped-def]
    from moeflow.parallel.exchange import alltoall as exchange

    n = _Net()
    monkeypatch.setattr(exchange, "dist", n)
    for name in ("all_to_all_rows", "start_all_to_all_rows", "wait_all_to_all_rows"):
        monkeypatch.setattr(exchange, name, getattr(n, name))
    return n


@pytest.mark.reference
@pytest.mark.parametrize("nodes,local", [(2, 2), (3, 2), (2, 3), (1, 3), (3, 1)])
def test_exchanges_deliver_every_row_over_their_own_groups(net, nodes, local, gen):
    """Flat and two-level exchanges, blocking and in the three asynchronous steps, on an expert
    group that is not the world (threads stand in for ranks): each rank gets exactly the rows
    bound for it in source order; the flat one talks over its group, the two-level one over the
    node group then the cross-node group, each blocking call with the exchange's comm timer."""
    W, L = nodes * local, local
    members = tuple(10 + r for r in range(W))
    counts = torch.randint(0, 4, (W, W), generator=gen)
    counts[0, :] = 0  # a rank that sends nothing
    counts = counts.tolist()
    x = [torch.tensor([[r, d, j] for d in range(W) for j in range(counts[r][d])], dtype=torch.float64).reshape(-1, 3)
         for r in range(W)]
    want = [[[s, r, j] for s in range(W) for j in range(counts[s][r])] for r in range(W)]
    timer = object()

    def ranks(r: int):  # type: ignore[no-untyped-def]
        group = _Group(members, r)
        n, l = divmod(r, L)
        hierarchy = SimpleNamespace(intra=_Group(tuple(10 + n * L + i for i in range(L)), l),
                                    inter=_Group(tuple(10 + m * L + l for m in range(nodes)), n), node_size=L)
        flat, two = FlatExchange(group), HierarchicalExchange(group, hierarchy)
        assert (flat.rank, flat.world, two.rank, two.world) == (r, W, r, W) and flat.group is two.group is group
        flat.timer = two.timer = timer
        got = [flat(x[r], counts), two(x[r], counts)]
        for ex in (flat, two):
            started = ex.start(x[r], counts)
            got.append(ex.finish(ex.relay(started)))
        got.append(two.finish(two.start(x[r], counts)))  # finish relays what is still in phase 1
        return got

    for r, got in enumerate(_run_ranks(W, ranks)):
        for i, y in enumerate(got):
            assert y.tolist() == want[r], f"rank {r}, exchange {i}: {y.tolist()} != {want[r]}"
        n, l = divmod(r, L)
        node, across = tuple(10 + n * L + i for i in range(L)), tuple(10 + m * L + l for m in range(nodes))
        groups = [(what, g) for what, g, *_ in net.calls[10 + r]]
        assert groups == [("blocking", members), ("blocking", node), ("blocking", across), ("start", members),
                          ("start", node), ("start", across), ("start", node), ("start", across)], groups
        assert [c[4] is timer for c in net.calls[10 + r] if c[0] == "blocking"] == [True] * 3


@pytest.mark.reference
def test_two_level_exchange_refuses_a_hierarchy_that_does_not_fit_its_group(net):
    """``node_size`` must divide the group and the node groups must be L ranks x W/L nodes;
    one rank per node is a valid hierarchy."""
    group = _Group(tuple(range(10, 16)), 0)  # 6 ranks

    def hierarchy(L: int, intra: int, inter: int) -> SimpleNamespace:
        return SimpleNamespace(intra=_Group(tuple(range(intra)), 0), inter=_Group(tuple(range(inter)), 0), node_size=L)

    for L, intra, inter in [(1, 1, 6), (2, 2, 3), (3, 3, 2), (6, 6, 1)]:
        assert HierarchicalExchange(group, hierarchy(L, intra, inter)).hierarchy.node_size == L
    for L in (0, -2, 4, 5, 12):
        with pytest.raises(ValueError, match=f"node_size={L} must divide the expert-parallel group size 6"):
            HierarchicalExchange(group, hierarchy(L, max(L, 1), 1))
    for intra, inter in [(3, 3), (2, 2), (1, 3), (2, 6), (6, 1)]:
        with pytest.raises(ValueError, match=f"hierarchy groups have sizes {intra} x {inter}, expected 2 ranks per node x 3"):
            HierarchicalExchange(group, hierarchy(2, intra, inter))
