"""Slot assignment, drop policies and the local dispatcher against brute-force Python.

Property tests draw random routings (T tokens, E experts, K distinct experts per token, skewed
so some experts overflow) and check every integer output exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeflow import DispatchConfig, LocalDispatcher, RoutingResult
from moeflow.dispatch import assign_slots, priority_order

pytestmark = pytest.mark.reference

POLICIES = ["position", "score", "bpr"]
CAPACITY_FACTORS = [0.0, 1e-9, 0.25, 0.5, 1.0, 1.5, 4.0, -1e-9, -0.25, -0.5, -1.0, -4.0]


@dataclass
class Case:
    ids: list[list[int]]  # T x K, distinct per row
    weights: list[list[float]]  # T x K
    E: int

    @property
    def T(self) -> int:
        return len(self.ids)

    @property
    def K(self) -> int:
        return len(self.ids[0])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(self.ids, dtype=torch.long), torch.tensor(self.weights, dtype=torch.float64)


@st.composite
def cases(draw, max_T: int = 40, max_E: int = 8) -> Case:
    T = draw(st.integers(1, max_T))
    E = draw(st.integers(1, max_E))
    K = draw(st.integers(1, E))
    seed = draw(st.integers(0, 2**31 - 1))
    ties = draw(st.booleans())  # few distinct weights: exercises the tie-breaking rules
    g = torch.Generator().manual_seed(seed)
    # skewed expert popularity so that capacity actually drops assignments
    popularity = torch.rand(E, generator=g, dtype=torch.float64) ** 3 + 0.02
    ids = torch.multinomial(popularity.expand(T, E), K, replacement=False, generator=g)
    if ties:
        weights = torch.tensor([0.25, 0.5, 0.75, 1.0], dtype=torch.float64)[torch.randint(0, 4, (T, K), generator=g)]
    else:
        weights = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.05
    return Case(ids=ids.tolist(), weights=weights.tolist(), E=E)


# ----------------------------------------------------------------------------- brute force


def bf_priority(case: Case, policy: str | None) -> list[int]:
    """Flat assignment indices a = t*K + k, highest priority first."""
    T, K, w = case.T, case.K, case.weights
    A = range(T * K)
    if policy is None:
        return list(A)
    if policy == "position":
        return sorted(A, key=lambda a: (a % K, a // K))
    if policy == "score":
        return sorted(A, key=lambda a: (-w[a // K][a % K], a))
    best = [max(row) for row in w]
    return sorted(A, key=lambda a: (a % K, -best[a // K], a // K))


def bf_capacity(cf: float, T: int, K: int, E: int) -> int | None:
    if cf == 0:
        return None
    return min(T, math.ceil(abs(Fraction(repr(cf))) * T * K / E))


def bf_kept(case: Case, policy: str, cap: int | None) -> list[bool]:
    K = case.K
    kept = [True] * (case.T * case.K)
    if cap is None:
        return kept
    taken = [0] * case.E
    for a in bf_priority(case, policy):
        e = case.ids[a // K][a % K]
        kept[a] = taken[e] < cap
        taken[e] += 1
    return kept


def bf_expert_rows(case: Case, policy: str | None, kept: list[bool]) -> list[list[int]]:
    """For each expert, the tokens of its kept assignments in slot order."""
    K = case.K
    rows: list[list[int]] = [[] for _ in range(case.E)]
    for a in bf_priority(case, policy):
        if kept[a]:
            rows[case.ids[a // K][a % K]].append(a // K)
    return rows


def routing_of(ids: torch.Tensor, weights: torch.Tensor, E: int) -> RoutingResult:
    T = ids.shape[0]
    dummy = torch.zeros(T, E, dtype=weights.dtype)
    return RoutingResult(weights_TK=weights, ids_TK=ids, logits_TE=dummy, scores_TE=dummy)


# ----------------------------------------------------------------------------- slots


@given(case=cases(), policy=st.sampled_from([None, *POLICIES]))
def test_assign_slots_matches_brute_force(case, policy):
    ids, w = case.tensors()
    s = assign_slots(ids, w, num_experts=case.E, drop_policy=policy)
    K = case.K
    prio = bf_priority(case, policy)
    rank = {a: i for i, a in enumerate(prio)}
    expected_order = sorted(range(case.T * K), key=lambda a: (case.ids[a // K][a % K], rank[a]))
    assert s.order_A.tolist() == expected_order
    assert s.expert_A.tolist() == [case.ids[a // K][a % K] for a in expected_order]
    counts = [sum(row.count(e) for row in case.ids) for e in range(case.E)]
    assert s.counts_E.tolist() == counts
    assert s.counts_E.dtype == torch.int64
    # positions inside each expert are exactly 0..n-1, in order
    expected_pos = [p for n in counts for p in range(n)]
    assert s.pos_A.tolist() == expected_pos


@given(case=cases(), policy=st.sampled_from(POLICIES))
def test_priority_order_matches_brute_force(case, policy):
    _, w = case.tensors()
    assert priority_order(w, policy).tolist() == bf_priority(case, policy)


def test_priority_order_tie_rules():
    w = torch.tensor([[0.5, 0.2], [0.5, 0.9], [0.5, 0.5], [0.9, 0.1]], dtype=torch.float64)
    # score: 0.9 (a=3), 0.9 (a=6), then the 0.5s by flat index 0, 2, 4, 5, then 0.2 (a=1), 0.1 (a=7)
    assert priority_order(w, "score").tolist() == [3, 6, 0, 2, 4, 5, 1, 7]
    # bpr: token best weights 0.5, 0.9, 0.5, 0.9 -> token order 1, 3, 0, 2; choice-major
    assert priority_order(w, "bpr").tolist() == [2, 6, 0, 4, 3, 7, 1, 5]
    assert priority_order(w, "position").tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    with pytest.raises(ValueError, match="drop_policy"):
        priority_order(w, "random")


# ----------------------------------------------------------------------------- dispatcher


@given(
    case=cases(),
    policy=st.sampled_from(POLICIES),
    cf=st.sampled_from(CAPACITY_FACTORS),
    weight_at=st.sampled_from(["combine", "dispatch"]),
)
def test_dispatch_layout_and_kept_set(case, policy, cf, weight_at):
    ids, w = case.tensors()
    T, K, E, D = case.T, case.K, case.E, 3
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T * 131 + E), dtype=torch.float64) + 2.0
    disp = LocalDispatcher(num_experts=E, config=DispatchConfig(drop_policy=policy, weight_at=weight_at))
    expert_in, plan = disp.dispatch(x, routing_of(ids, w, E), capacity_factor=cf)

    cap = bf_capacity(cf, T, K, E)
    kept = bf_kept(case, policy, cap)
    counts = [sum(row.count(e) for row in case.ids) for e in range(E)]
    kept_counts = [min(n, cap) if cap is not None else n for n in counts]
    assert plan.counts_E.tolist() == kept_counts
    if cap is None:
        assert plan.kept_A is None
    else:
        assert plan.kept_A.tolist() == kept
    rows = bf_expert_rows(case, policy if cap is not None else None, kept)
    scale = w.reshape(-1) if weight_at == "dispatch" else torch.ones(T * K, dtype=torch.float64)
    weight_of = {(a // K, case.ids[a // K][a % K]): scale[a] for a in range(T * K)}

    def expected_rows(e: int) -> torch.Tensor:
        return torch.stack([x[t] * weight_of[(t, e)] for t in rows[e]]) if rows[e] else x.new_zeros(0, D)

    if cf > 0:
        assert plan.capacity == cap and expert_in.shape == (E, cap, D)
        for e in range(E):
            n = kept_counts[e]
            assert torch.equal(expert_in[e, :n], expected_rows(e))
            assert torch.equal(expert_in[e, n:], x.new_zeros(cap - n, D))  # zero padding
    else:
        assert plan.capacity is None
        assert expert_in.shape == (sum(kept_counts), D)  # grouped layout: no padding rows
        start = 0
        for e in range(E):
            n = kept_counts[e]
            assert torch.equal(expert_in[start : start + n], expected_rows(e))
            start += n


def _expert_fn(z: torch.Tensor) -> torch.Tensor:
    """A non-linear 'expert' that is non-zero on zero rows, so leaking padding would show."""
    return torch.tanh(z) * 1.5 + 0.25


@given(
    case=cases(max_T=24, max_E=6),
    policy=st.sampled_from(POLICIES),
    cf=st.sampled_from(CAPACITY_FACTORS),
    weight_at=st.sampled_from(["combine", "dispatch"]),
    renormalize=st.booleans(),
)
def test_dropped_assignments_contribute_nothing(case, policy, cf, weight_at, renormalize):
    """Output and gradients equal a brute-force sum over the kept assignments only; a dropped
    assignment's weight gets exactly zero gradient."""
    ids, w0 = case.tensors()
    T, K, E, D = case.T, case.K, case.E, 3
    g = torch.Generator().manual_seed(T * 7 + K)
    x0 = torch.randn(T, D, generator=g, dtype=torch.float64)
    gy = torch.randn(T, D, generator=g, dtype=torch.float64)
    cfg = DispatchConfig(drop_policy=policy, weight_at=weight_at, renormalize_after_drop=renormalize)
    disp = LocalDispatcher(num_experts=E, config=cfg)

    x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    expert_in, plan = disp.dispatch(x, routing_of(ids, w, E), capacity_factor=cf)
    y = disp.combine(_expert_fn(expert_in), plan)
    gx, gw = torch.autograd.grad((y * gy).sum(), [x, w])

    kept = bf_kept(case, policy, bf_capacity(cf, T, K, E))
    xr, wr = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
    out = []
    for t in range(T):
        k_kept = [k for k in range(K) if kept[t * K + k]]
        scale = 1.0
        if renormalize and cf != 0 and k_kept:
            scale = wr[t].sum() / sum(wr[t, k] for k in k_kept)
        terms = [
            wr[t, k] * scale * _expert_fn(xr[t]) if weight_at == "combine" else _expert_fn(xr[t] * (wr[t, k] * scale))
            for k in k_kept
        ]
        out.append(torch.stack(terms).sum(0) if terms else xr.new_zeros(D))
    y_ref = torch.stack(out)
    gx_ref, gw_ref = torch.autograd.grad((y_ref * gy).sum(), [xr, wr], allow_unused=True)
    gx_ref = torch.zeros_like(x0) if gx_ref is None else gx_ref
    gw_ref = torch.zeros_like(w0) if gw_ref is None else gw_ref

    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)
    dropped = ~torch.tensor(kept).view(T, K)
    if not renormalize:
        assert torch.all(gw[dropped] == 0)  # exactly nothing flows to a dropped weight
    assert torch.all(y[dropped.all(dim=1)] == 0)  # a token with nothing kept gets exactly 0


@given(case=cases(), policy=st.sampled_from(POLICIES), cf=st.sampled_from(CAPACITY_FACTORS))
def test_round_trip_identity_experts(case, policy, cf):
    """Identity experts, unit weights: combine(dispatch(x)) == x * (kept assignments of the token)."""
    ids, _ = case.tensors()
    T, K, E, D = case.T, case.K, case.E, 5
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T + 1000 * E), dtype=torch.float64)
    ones = torch.ones(T, K, dtype=torch.float64)
    for weight_at in ("combine", "dispatch"):
        disp = LocalDispatcher(num_experts=E, config=DispatchConfig(drop_policy=policy, weight_at=weight_at))
        expert_in, plan = disp.dispatch(x, routing_of(ids, ones, E), capacity_factor=cf)
        y = disp.combine(expert_in, plan)
        kept = bf_kept(Case(ids=case.ids, weights=ones.tolist(), E=E), policy, bf_capacity(cf, T, K, E))
        n_kept = torch.tensor(kept, dtype=torch.float64).view(T, K).sum(1, keepdim=True)
        torch.testing.assert_close(y, x * n_kept, rtol=1e-14, atol=0)
        if cf == 0:
            assert torch.equal(n_kept, torch.full((T, 1), float(K), dtype=torch.float64))


def test_dispatch_uses_input_dtype_for_weights():
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.9, 0.1]], dtype=torch.float64)  # router computed in fp64
    x = torch.randn(3, 4, dtype=torch.float32)
    disp = LocalDispatcher(num_experts=2)
    expert_in, plan = disp.dispatch(x, routing_of(ids, w, 2), capacity_factor=0)
    y = disp.combine(expert_in, plan)
    assert y.dtype == torch.float32 and expert_in.dtype == torch.float32
    torch.testing.assert_close(y, x * 1.0, rtol=1e-6, atol=1e-6)  # weights sum to 1 per token


def test_sum_token_rows_weights_each_of_k_rows(gen):
    """``sum_token_rows`` for K = 1 (its elementwise case) and K = 2, also where D is 1 (so the
    K = 1 case is taken by K, not by another dimension of size 1)."""
    from moeflow.dispatch.combine import sum_token_rows

    for T, K, D in [(5, 1, 3), (5, 2, 1), (4, 3, 2)]:
        rows = torch.randn(T, K, D, generator=gen, dtype=torch.float64)
        w = torch.rand(T, K, generator=gen, dtype=torch.float64) + 0.1
        expected = torch.stack([sum(w[t, k] * rows[t, k] for k in range(K)) for t in range(T)])
        torch.testing.assert_close(sum_token_rows(rows, w, "combine"), expected, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(sum_token_rows(rows, w, "dispatch"), rows.sum(1), rtol=0, atol=0)


def test_renormalize_kept_rescales_to_the_total_and_zeroes_tokens_with_nothing_kept():
    from moeflow.dispatch.combine import renormalize_kept

    w = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [0.7, 0.2, 0.1]], dtype=torch.float64)
    kept = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    out = renormalize_kept(w, kept)
    # kept entries now sum to the token's total (1.0); a token with nothing kept has no weight
    torch.testing.assert_close((out * kept).sum(1), torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(out[0], w[0] / 0.7, rtol=1e-15, atol=0)
    assert torch.equal(out[1], torch.zeros(3, dtype=torch.float64)) and torch.equal(out[2], w[2])
