"""Capacity arithmetic (``moeflow.dispatch.capacity``): ``C = ceil(cf * T * K / E)`` in exact decimal
rounding, clipped to the tokens, at least one row for a positive factor; the fixed, dropless and
capped modes."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moeflow.dispatch.capacity import capacity_rows, resolve_capacity

pytestmark = pytest.mark.unit


def test_capacity_exact_decimal_rounding():
    # naive binary floating point: 1.1 * 100 = 110.00000000000001 -> ceil gives 111
    assert math.ceil(1.1 * 100) == 111 and math.ceil(1.1 * 3000) == 3301
    assert capacity_rows(1.1, num_tokens=200, top_k=2, num_experts=4) == 110  # T*K/E = 100
    assert capacity_rows(1.1, num_tokens=6000, top_k=4, num_experts=8) == 3300  # T*K/E = 3000
    assert capacity_rows(1.1, num_tokens=5000, top_k=1, num_experts=5) == 1100  # T*K/E = 1000
    assert capacity_rows(1.1, num_tokens=4000, top_k=2, num_experts=8) == 1100
    assert capacity_rows(1.0, num_tokens=4096, top_k=2, num_experts=8) == 1024
    assert capacity_rows(1.25, num_tokens=4096, top_k=2, num_experts=8) == 1280
    assert capacity_rows(1.15, num_tokens=60, top_k=1, num_experts=2) == 35  # 34.5 rounds up
    assert capacity_rows(1.0, num_tokens=7, top_k=2, num_experts=3) == 5  # ceil(14/3)


def test_capacity_clipped_to_tokens():
    assert capacity_rows(4.0, num_tokens=10, top_k=2, num_experts=2) == 10
    assert capacity_rows(1e9, num_tokens=3, top_k=1, num_experts=8) == 3


@pytest.mark.parametrize("cf", [1e-300, 5e-324, 1e-9, 0.001])
def test_capacity_tiny_positive_factor_keeps_one_row(cf):
    assert capacity_rows(cf, num_tokens=16, top_k=1, num_experts=8) == 1
    plan = resolve_capacity(cf, num_tokens=16, top_k=1, num_experts=8)
    assert plan.layout_capacity == 1 and plan.row_cap == 1
    plan = resolve_capacity(-cf, num_tokens=16, top_k=1, num_experts=8)
    assert plan.layout_capacity is None and plan.row_cap == 1


def test_resolve_capacity_modes():
    fixed = resolve_capacity(1.0, num_tokens=4096, top_k=2, num_experts=8)
    assert (fixed.layout_capacity, fixed.row_cap) == (1024, 1024)
    dropless = resolve_capacity(0.0, num_tokens=4096, top_k=2, num_experts=8)
    assert (dropless.layout_capacity, dropless.row_cap) == (None, None)
    dropless_int = resolve_capacity(0, num_tokens=10, top_k=2, num_experts=8)
    assert (dropless_int.layout_capacity, dropless_int.row_cap) == (None, None)
    capped = resolve_capacity(-0.75, num_tokens=100, top_k=2, num_experts=6)
    assert capped.layout_capacity is None and capped.row_cap == 25  # ceil(0.75 * 200 / 6) = ceil(25.0)
    capped = resolve_capacity(-1.1, num_tokens=5000, top_k=1, num_experts=5)
    assert capped.layout_capacity is None and capped.row_cap == 1100
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="capacity_factor"):
            resolve_capacity(bad, num_tokens=8, top_k=1, num_experts=2)


@given(
    num=st.integers(1, 10**6),
    den=st.sampled_from([1, 2, 4, 5, 8, 10, 100, 1000]),
    T=st.integers(1, 5000),
    E=st.integers(1, 64),
    data=st.data(),
)
def test_capacity_rows_matches_exact_fraction(num, den, T, E, data):
    K = data.draw(st.integers(1, E))
    cf = num / den  # a short decimal, e.g. 1.1, 0.25, 12.5
    expected = min(T, math.ceil(Fraction(str(cf)) * T * K / E))
    assert capacity_rows(cf, num_tokens=T, top_k=K, num_experts=E) == expected
    assert resolve_capacity(-cf, num_tokens=T, top_k=K, num_experts=E).row_cap == expected
