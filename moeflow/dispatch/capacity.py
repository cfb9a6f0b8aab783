"""Capacity semantics (DESIGN section 3), in one place.

``C = ceil(|cf| * T * K / E)``, computed exactly: cf is taken at the decimal value it prints as
(``1.1`` is 11/10, not the nearest binary float), so ``cf=1.1, T*K/E=1000`` gives ``C=1100``,
never 1101. The result is clipped to ``T``: one expert can never receive more than ``T``
assignments (each token picks an expert at most once), so a larger ``C`` would only pad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

from moeflow.config import check_capacity_factor

__all__ = ["CapacityPlan", "resolve_capacity", "capacity_rows"]


@dataclass(frozen=True)
class CapacityPlan:
    """``layout_capacity``: C of the padded ``[E, C, D]`` layout, or None for the grouped layout.
    ``row_cap``: the most rows an expert keeps (None: unlimited, i.e. dropless)."""

    layout_capacity: int | None
    row_cap: int | None


def capacity_rows(factor: float, *, num_tokens: int, top_k: int, num_experts: int) -> int:
    """``min(T, ceil(factor * T * K / E))`` in exact arithmetic, for ``factor > 0``."""
    exact = Fraction(Decimal(repr(float(factor)))) * num_tokens * top_k / num_experts
    return min(num_tokens, math.ceil(exact))


def resolve_capacity(capacity_factor: float, *, num_tokens: int, top_k: int, num_experts: int) -> CapacityPlan:
    """Map a capacity factor to a layout: cf > 0 fixed capacity, 0 dropless, < 0 dropless capped."""
    cf = check_capacity_factor(capacity_factor)
    if cf == 0:
        return CapacityPlan(layout_capacity=None, row_cap=None)
    rows = capacity_rows(abs(cf), num_tokens=num_tokens, top_k=top_k, num_experts=num_experts)
    if cf > 0:
        return CapacityPlan(layout_capacity=rows, row_cap=rows)
    return CapacityPlan(layout_capacity=None, row_cap=rows)
