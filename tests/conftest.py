"""Shared fixtures: fresh random inputs per test (never zeros), fp64 by default."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis: no per-example deadline (the first torch call of a process can be slow on a loaded
# 2-core machine, and a deadline would make that a flaky failure), a moderate number of examples
# so the whole suite stays fast. ``HYPOTHESIS_PROFILE=thorough`` runs many more.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Small matmuls on a 2-core machine: more threads only add overhead and run-to-run variation.
torch.set_num_threads(min(2, torch.get_num_threads()))


def _test_seed(nodeid: str) -> int:
    # zlib.crc32 is stable across processes (``hash(str)`` is salted per process, which would
    # make a failure impossible to reproduce).
    return zlib.crc32(nodeid.encode()) % (2**31)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A seeded generator per test: reproducible, different for each test through its node id."""
    return torch.Generator().manual_seed(_test_seed(request.node.nodeid))


@pytest.fixture(autouse=True)
def _seed_global_rng(request: pytest.FixtureRequest) -> None:
    """Seed the global RNG too (noise, jitter and dropout in the router draw from it)."""
    torch.manual_seed(_test_seed(request.node.nodeid) + 1)


def randomize_(module: torch.nn.Module, gen: torch.Generator, std: float = 0.5) -> torch.nn.Module:
    """Overwrite every parameter with fresh N(0, std^2) values so nothing is near zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype) * std)
    return module
