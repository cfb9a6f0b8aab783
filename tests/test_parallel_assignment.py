"""The group's slot assignment (``moeflow.parallel.exchange.assignment``, pure torch) and the
per-rank exchange plans built from it, with W ranks simulated in one process.

Properties, on random routings (hypothesis) over capacity modes, drop policies, hidden shards
and load-aware placements with replicas:

- (every rank computes the assignment with this function from the same all-gathered routing;
  that real ranks agree shows in the expert-parallel layer equalling the single process on 2 and
  4 gloo ranks, ``tests/test_parallel_dispatcher.py``: calling it W times in one process here
  could not fail, so it is not done);
- the kept assignments and their positions are the single-process ones on the concatenated
  batch (``assign_slots`` + capacity), and every kept row lands in a slot holding its expert
  (or its hidden slice), inside capacity, replicas cut by their shares;
- what rank ``s`` sends to rank ``d`` is, row for row, what ``d`` expects from ``s``;
- running the plans with a simulated exchange gives the local dispatcher's output on the
  concatenated batch.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeflow.config import DispatchConfig
from moeflow.dispatch import LocalDispatcher, assign_slots, resolve_capacity
from moeflow.experts import GroupedExperts
from moeflow.kernels.gather import gather_rows
from moeflow.parallel.exchange.assignment import CallArguments, GroupRouting, assign_group
from moeflow.parallel.placement.plan import Placement, plan_placement
from moeflow.parallel.exchange.plan import exchange_plan, send_rows
from moeflow.dispatch.combine import combine_rows
from moeflow.types import RoutingResult

pytestmark = pytest.mark.reference


@st.composite
def scenarios(draw):  # type: ignore[no-untyped-def]
    W = draw(st.integers(1, 4))
    n = draw(st.sampled_from([1, 1, 2]))
    e_whole = draw(st.integers(1, 3))
    E = W * e_whole
    if n > 1 and E * n % W:
        n = 1
    K = draw(st.integers(1, min(E, 3)))
    tokens_W = draw(st.lists(st.integers(0, 9), min_size=W, max_size=W))
    cf = draw(st.sampled_from([1.0, 0.5, 1.25, 0.0, -0.8, -2.0]))
    policy = draw(st.sampled_from(["position", "score", "bpr"]))
    weight_at = draw(st.sampled_from(["combine", "dispatch"]))
    renorm = draw(st.booleans())
    extra_slots = draw(st.integers(0, 2)) if n == 1 and W > 1 else 0
    seed = draw(st.integers(0, 2**31 - 1))
    return W, E, K, n, tokens_W, cf, policy, weight_at, renorm, extra_slots, seed


def _routings(W: int, E: int, K: int, tokens_W: list[int], gen: torch.Generator) -> list[RoutingResult]:
    out = []
    for T in tokens_W:
        scores_TE = torch.rand(T, E, generator=gen, dtype=torch.float64)
        weights_TK, ids_TK = scores_TE.topk(K, dim=1)
        out.append(RoutingResult(weights_TK=weights_TK, ids_TK=ids_TK, logits_TE=scores_TE, scores_TE=scores_TE))
    return out


def _gathered(routings: list[RoutingResult], policy: str) -> GroupRouting:
    """What ``ExpertParallelDispatcher.gather_routing`` gives every rank."""
    parts = []
    for r in routings:
        meta = r.ids_TK.to(torch.float64)
        if policy != "position":
            meta = torch.cat([meta, r.priority_TK.to(torch.float64)], dim=1)
        parts.append(meta)
    return GroupRouting.from_parts(parts, routings[0].top_k, routings[0].logits_TE.shape[1])


def _placement(W: int, E: int, n: int, extra: int, gen: torch.Generator) -> Placement:
    if extra == 0 or n > 1:
        return Placement.contiguous(E * n, W)
    load = (torch.rand(E, generator=gen) ** 3 * 100).tolist()  # skewed: replicas for hot experts
    return plan_placement(load, world=W, slots_per_rank=min(E, E // W + extra))


@given(scenarios())
def test_group_assignment_is_the_single_process_assignment(scenario):  # type: ignore[no-untyped-def]
    W, E, K, n, tokens_W, cf, policy, weight_at, renorm, extra, seed = scenario
    gen = torch.Generator().manual_seed(seed)
    routings = _routings(W, E, K, tokens_W, gen)
    placement = _placement(W, E, n, extra, gen)
    kw = dict(num_experts=E, capacity_factor=cf, drop_policy=policy, placement=placement, hidden_shards=n)
    g = assign_group(_gathered(routings, policy), **kw)

    # the single-process assignment on the concatenated batch
    T = sum(tokens_W)
    ids_TK = torch.cat([r.ids_TK for r in routings])
    prio_TK = torch.cat([r.priority_TK for r in routings])
    cap = resolve_capacity(cf, num_tokens=max(T, 1), top_k=K, num_experts=E)
    single = assign_slots(ids_TK, prio_TK, num_experts=E, drop_policy=None if cap.row_cap is None else policy)
    kept_A = torch.ones(T * K, dtype=torch.bool)
    pos_A = torch.empty(T * K, dtype=torch.long)
    pos_A[single.order_A] = single.pos_A
    if cap.row_cap is not None:
        kept_A = pos_A < cap.row_cap
    # group assignment (t, k*n + j) is slice j of single-process assignment (t, k)
    base_G = torch.div(g.order_G, n, rounding_mode="floor")
    assert g.order_G.numel() == T * K * n and torch.equal(torch.sort(g.order_G).values, torch.arange(T * K * n))
    assert torch.equal(g.kept_G, kept_A[base_G])
    assert g.capacity == cap
    if placement.is_contiguous:  # positions are the single-process ones (a replica's count from its cut)
        assert torch.equal(g.pos_G[g.kept_G], pos_A[base_G][g.kept_G])
    part_G = g.order_G % n
    expert_of_slot = torch.tensor(placement.flat, dtype=torch.long)
    held = expert_of_slot[g.slot_G[g.kept_G]]  # the (virtual) expert each kept row's slot holds
    assert torch.equal(held, part_G[g.kept_G] * E + ids_TK.reshape(-1)[base_G[g.kept_G]])
    assert torch.equal(g.dst_G, torch.div(g.slot_G, placement.slots_per_rank, rounding_mode="floor"))
    first = torch.cumsum(torch.tensor([0] + tokens_W), 0)
    assert torch.equal(g.src_G, torch.bucketize(torch.div(base_G, K, rounding_mode="floor"), first[1:], right=True))
    # inside every slot: positions 0..count-1 in priority order, within capacity; a replicated
    # expert's kept rows are cut by its replicas' shares
    for slot in range(len(placement.flat)):
        mine = g.kept_G & (g.slot_G == slot)
        assert torch.equal(g.pos_G[mine], torch.arange(int(mine.sum())))
        if cap.row_cap is not None:
            assert int(mine.sum()) <= cap.row_cap
    if n == 1:
        for x in range(E):
            reps = placement.replicas(x)
            kept = int(kept_A.view(T, K)[ids_TK == x].sum())
            shares = [placement.flat_shares[s] for s in reps]
            cum = torch.cumsum(torch.tensor([0] + shares), 0)
            cuts = torch.div(cum * kept, cum[-1], rounding_mode="floor").tolist()
            got = [int((g.kept_G & (g.slot_G == s)).sum()) for s in reps]
            assert got == [b - a for a, b in zip(cuts, cuts[1:])], (x, reps, got, cuts)

    # what s sends to d is, row for row, what d expects from s
    for s in range(W):
        sent = g.send_side(s)
        dest_M = g.dst_G[g.sent_by(s)]
        assert [int((dest_M == d).sum()) for d in range(W)] == g.counts_WW[s]
        assert torch.equal(dest_M, torch.sort(dest_M, stable=True).values)  # grouped by destination
        for d in range(W):
            recv = g.receive_side(d)
            expected = sent.assign_M[dest_M == d] + sum(tokens_W[:s]) * K * n
            assert torch.equal(recv.order_R[recv.src_R == s], expected)
            assert int(recv.counts_e.sum()) == sum(g.counts_WW[q][d] for q in range(W))

    # the plans, run with a simulated exchange, give the local dispatcher's result
    config = DispatchConfig(drop_policy=policy, weight_at=weight_at, renormalize_after_drop=renorm)
    D, H = 4, 6
    torch.manual_seed(seed % 1000)
    experts = GroupedExperts(num_experts=E, dim=D, hidden=H, dtype=torch.float64)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.5)
    stored = experts.hidden_slices(n) if n > 1 else experts
    xs = [torch.randn(t, D, generator=gen, dtype=torch.float64) for t in tokens_W]
    local = LocalDispatcher(num_experts=E, config=config)
    all_routing = RoutingResult(weights_TK=torch.cat([r.weights_TK for r in routings]), ids_TK=ids_TK,
                                logits_TE=torch.cat([r.logits_TE for r in routings]),
                                scores_TE=torch.cat([r.scores_TE for r in routings]))
    y_ref = local.run(torch.cat(xs), all_routing, experts, capacity_factor=cf)
    plans = [exchange_plan(g, r, routings[r], dtype=torch.float64, config=config) for r in range(W)]
    sends = [send_rows(xs[r], p.assign_M, p.row_A, p.kept_A, p.weights_TK, p.weight_at) for r, p in enumerate(plans)]
    splits = [list(torch.tensor(c).cumsum(0)) for c in g.counts_WW]
    blocks = [[sends[s][(splits[s][d - 1] if d else 0):splits[s][d]] for d in range(W)] for s in range(W)]
    homes = [[None] * W for _ in range(W)]
    for d, p in enumerate(plans):
        recv_RD = torch.cat([blocks[s][d] for s in range(W)])
        expert_in = gather_rows(recv_RD, p.recv_row_I, p.valid_I, p.input_row_R.view(-1, 1), None)
        slots = torch.tensor(placement.slots[d], dtype=torch.long)
        mine = GroupedExperts(num_experts=len(slots), dim=D, hidden=H // n, dtype=torch.float64)
        with torch.no_grad():
            for name, q in mine.named_parameters():
                q.copy_(getattr(stored, name)[slots])
        if p.capacity is not None:
            expert_in = expert_in.view(len(slots), p.capacity, D)
        out_ID = mine(expert_in, p.counts_E).reshape(-1, D)
        back_RD = out_ID[p.input_row_R]
        start = 0
        for s in range(W):
            homes[s][d] = back_RD[start : start + g.counts_WW[s][d]]
            start += g.counts_WW[s][d]
    for r, p in enumerate(plans):
        y = combine_rows(torch.cat(homes[r]), p)
        off = sum(tokens_W[:r])
        torch.testing.assert_close(y, y_ref[off : off + tokens_W[r]], rtol=1e-12, atol=1e-12)


@given(st.integers(1, 8), st.sampled_from([1.0, 0.0, -0.8, 1.1, 1e-300, 2.5]),
       st.sampled_from(["expert", "data", "sharded", "auto", "hybrid:2", "hybrid:16"]),
       st.sampled_from([1, 2, 7, "auto"]))
def test_call_arguments_travel_exactly(top_k, cf, parallel, degree):
    """The per-call arguments every rank must pass alike survive the int encoding exactly, and
    the check names each argument that differs with every rank's value."""
    call = CallArguments(top_k=top_k, capacity_factor=cf, parallel=parallel, overlap_degree=degree)
    assert CallArguments.decode(call.encode()) == call
    CallArguments.check_agree([call.encode()] * 3)
    other = CallArguments(top_k=top_k + 1, capacity_factor=cf, parallel=parallel, overlap_degree=degree)
    with pytest.raises(ValueError, match=rf"top_k: rank 0 {top_k}, rank 1 {top_k + 1}, rank 2 {top_k}$"):
        CallArguments.check_agree([call.encode(), other.encode(), call.encode()])


def _fields(obj) -> dict:  # type: ignore[no-untyped-def]
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor) or v is None}


@pytest.mark.parametrize("n,extra,cf", [(2, 0, 1.0), (1, 1, 1.25), (1, 0, 0.0), (1, 2, -0.8)])
def test_group_assignment_builds_every_tensor_on_the_routing_device(n, extra, cf):  # type: ignore[no-untyped-def]
    """With ``meta`` as the default device and the routing on the CPU, the assignment and both
    sides of every rank are the CPU ones: a tensor built without naming its device would land
    on ``meta`` and fail (on a GPU it would be a host tensor in the step: a copy or a crash)."""
    W, E, K, tokens_W = 2, 4, 2, [6, 3]
    gen = torch.Generator().manual_seed(5)
    routings = _routings(W, E, K, tokens_W, gen)
    kw = dict(num_experts=E, capacity_factor=cf, drop_policy="score", hidden_shards=n)
    want = assign_group(_gathered(routings, "score"), placement=_placement(W, E, n, extra, torch.Generator().manual_seed(1)), **kw)
    placement = _placement(W, E, n, extra, torch.Generator().manual_seed(1))  # its device tables not built yet
    with torch.device("meta"):
        got = assign_group(_gathered(routings, "score"), placement=placement, **kw)
        sides = [(got.send_side(r), got.receive_side(r)) for r in range(W)]
    pairs = [(_fields(got), _fields(want))]
    pairs += [(_fields(s), _fields(want.send_side(r))) for r, (s, _) in enumerate(sides)]
    pairs += [(_fields(q), _fields(want.receive_side(r))) for r, (_, q) in enumerate(sides)]
    for got_fields, want_fields in pairs:
        assert got_fields.keys() == want_fields.keys()
        for name, value in got_fields.items():
            if value is None:
                assert want_fields[name] is None, name
            else:
                assert value.device.type == "cpu" and torch.equal(value, want_fields[name]), name
    assert got.counts_WW == want.counts_WW


@pytest.mark.parametrize("cf", [0.0, -0.8])
def test_dropless_expert_input_keeps_arrival_order_inside_each_slot(cf):  # type: ignore[no-untyped-def]
    """Without a capacity layout the expert input is grouped by local slot and, inside a slot,
    in arrival order (source rank, then the sender's order): enough rows (hundreds a rank) that
    an unstable sort would reorder them."""
    W, E, K, tokens_W = 2, 4, 2, [300, 260]
    routings = _routings(W, E, K, tokens_W, torch.Generator().manual_seed(9))
    g = assign_group(_gathered(routings, "score"), num_experts=E, capacity_factor=cf, drop_policy="score",
                     placement=Placement.contiguous(E, W))
    for d in range(W):
        recv = g.receive_side(d)
        assert torch.equal(recv.src_R, torch.sort(recv.src_R).values)  # arrival order: by source rank
        starts = torch.cumsum(recv.counts_e, 0) - recv.counts_e
        for slot in range(len(recv.counts_e)):
            mine = recv.input_row_R[recv.local_R == slot]
            assert mine.numel() > 100
            assert torch.equal(mine, torch.arange(int(starts[slot]), int(starts[slot]) + mine.numel())), (d, slot)


@pytest.mark.parametrize("cf", [1.5, 1.0, 0.5, 0.0, -0.8])
@pytest.mark.parametrize("tokens_W", [[1, 0], [0, 0], [0, 1, 0], [3, 2]])
def test_capacity_is_the_single_process_capacity_of_the_group_batch(cf, tokens_W):  # type: ignore[no-untyped-def]
    """C comes from the group's token count (at least one token), as the single process on the
    concatenated batch: one token with cf=1.5 over 2 experts (top-1) has C = 1, two would have
    2; over 3 experts (top-2) likewise."""
    W = len(tokens_W)
    E, K = W, W - 1
    routings = _routings(W, E, K, tokens_W, torch.Generator().manual_seed(2))
    g = assign_group(_gathered(routings, "position"), num_experts=E, capacity_factor=cf, drop_policy="position",
                     placement=Placement.contiguous(E, W))
    assert g.capacity == resolve_capacity(cf, num_tokens=max(sum(tokens_W), 1), top_k=K, num_experts=E)


def test_hidden_shards_need_the_contiguous_placement():  # type: ignore[no-untyped-def]
    """Hidden slices of an expert are cut for contiguous blocks of experts: a placement with
    replicas or moved experts is refused for any ``hidden_shards > 1`` (2 included)."""
    W, E = 2, 4
    routing = _gathered(_routings(W, E, 2, [3, 2], torch.Generator().manual_seed(3)), "position")
    for n in (2, 4):
        moved = plan_placement([50.0] + [1.0] * (E * n - 1), world=W, slots_per_rank=E * n // W + 1)
        assert not moved.is_contiguous
        with pytest.raises(ValueError, match=f"hidden_shards={n} needs the contiguous placement"):
            assign_group(routing, num_experts=E, capacity_factor=1.0, drop_policy="position", placement=moved,
                         hidden_shards=n)


def test_slot_chunks_and_the_chunk_of_a_slot():
    """``slot_chunks``: ``i * e // n`` bounds, empty chunks dropped; ``chunk_of_slot`` reads them
    back for every slot; bad sizes raise."""
    from moeflow.parallel.strategies.pipeline import chunk_of_slot, slot_chunks

    assert slot_chunks(8, 2) == [0, 4, 8] and slot_chunks(4, 3) == [0, 1, 2, 4] and slot_chunks(64, 4)[1] == 16
    assert slot_chunks(2, 4) == [0, 1, 2] and slot_chunks(1, 2) == [0, 1] and slot_chunks(5, 1) == [0, 5]
    for e, n in ((8, 2), (4, 3), (2, 4), (7, 3), (1, 5), (64, 4), (64, 3), (5, 5), (6, 4), (3, 7)):
        bounds = slot_chunks(e, n)
        got = chunk_of_slot(torch.arange(e), e, n).tolist()
        assert got == [max(i for i in range(len(bounds) - 1) if bounds[i] <= s) for s in range(e)]
    with pytest.raises(ValueError, match="degree=0"):
        slot_chunks(4, 0)
