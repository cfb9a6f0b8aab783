"""Argument checks shared by the configs and the per-call overrides: each raises a
``TypeError``/``ValueError`` that names the argument and the value."""

from __future__ import annotations

import math
from typing import Literal, get_args

__all__ = ["check_capacity_factor", "check_parallel_mode", "check_overlap_degree", "check_top_k", "hybrid_shards"]

ParallelMode = Literal["expert", "data", "sharded", "auto"]


def _choice(name: str, value: object, literal: object) -> None:
    allowed = get_args(literal)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def hybrid_shards(parallel: object) -> int | None:
    """``r`` of a ``"hybrid:r"`` parallel mode (None for the other modes)."""
    if isinstance(parallel, str) and parallel.startswith("hybrid:"):
        digits = parallel[len("hybrid:"):]
        if digits.isdigit() and int(digits) >= 2:
            return int(digits)
    return None


def _parallel_mode(value: object) -> None:
    if hybrid_shards(value) is None:
        allowed = list(get_args(ParallelMode))
        if value not in allowed:
            raise ValueError(f"parallel must be one of {allowed} or 'hybrid:r' (r >= 2 hidden slices), got {value!r}")


def _int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _float(name: str, value: object, *, minimum: float | None = None, below: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if below is not None and value >= below:
        raise ValueError(f"{name} must be < {below}, got {value}")


def check_capacity_factor(value: object, name: str = "capacity_factor") -> float:
    """Validate a capacity factor: any finite number; 0 means dropless, < 0 dropless capped."""
    _float(name, value)
    return float(value)  # type: ignore[arg-type]


def check_parallel_mode(value: object) -> str:
    """``parallel``: ``"expert"``, ``"data"``, ``"sharded"``, ``"hybrid:r"`` or ``"auto"``."""
    _parallel_mode(value)
    return value  # type: ignore[return-value]


def check_overlap_degree(value: object) -> int | str:
    """``overlap_degree``: an int >= 1 or ``"auto"``."""
    if value == "auto":
        return "auto"
    _int("overlap_degree", value, minimum=1)
    return value  # type: ignore[return-value]


def check_top_k(top_k: object, num_experts: int) -> int:
    _int("top_k", top_k, minimum=1)
    if top_k > num_experts:  # type: ignore[operator]
        raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")
    return top_k  # type: ignore[return-value]
