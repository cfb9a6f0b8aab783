"""Shared fixtures: fresh random inputs per test (never zeros), fp64 by default."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator per test: reproducible, different for each test through its name."""
    import os

    seed = abs(hash(os.environ.get("PYTEST_CURRENT_TEST", ""))) % (2**31)
    return torch.Generator().manual_seed(seed)


def randomize_(module: torch.nn.Module, gen: torch.Generator, std: float = 0.5) -> torch.nn.Module:
    """Overwrite every parameter with fresh N(0, std^2) values so nothing is near zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
    return module
