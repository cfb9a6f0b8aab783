"""The grouped GEMM backend of ``GroupedExperts`` (``grouped_backend``): resolved once per
backend, device, dtype and weight shapes and kept, not again on every call, with the answer
``grouped_ffn`` gives per call (the same outputs and gradients)."""

from __future__ import annotations

import pytest
import torch

import moeflow.experts.ffn as ffn
from moeflow import ExpertsConfig, GroupedExperts
from moeflow.experts.ffn import grouped_ffn

from helpers import random_counts

pytestmark = pytest.mark.reference


def test_the_backend_is_resolved_once_per_device_dtype_and_shapes(monkeypatch):
    gen = torch.Generator().manual_seed(11)
    experts = GroupedExperts(num_experts=4, dim=16, hidden=24, config=ExpertsConfig(activation="geglu"))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    seen = []
    real = ffn.resolve_grouped_mm_backend
    monkeypatch.setattr(ffn, "resolve_grouped_mm_backend", lambda *a: seen.append(a[1:3]) or real(*a))
    counts = random_counts(gen, 4, 12, 1)
    for dtype, backend in ((torch.float32, "grouped_mm"), (torch.float64, "loop")):
        experts.to(dtype)
        x = torch.randn(12, 16, generator=gen, dtype=torch.float64).to(dtype)
        before = len(seen)
        for _ in range(3):
            experts.zero_grad()
            xr = x.clone().requires_grad_()
            y = experts(xr, counts)
            y.backward(torch.ones_like(y))
        assert len(seen) == before + 1 and experts.grouped_backend(x.device, dtype) == backend
        grads = [xr.grad, experts.w_in.grad, experts.w_out.grad]
        experts.zero_grad()
        xr = x.clone().requires_grad_()
        ref = grouped_ffn(xr, counts, experts.w_in, experts.w_out, activation="geglu")  # resolves per call
        ref.backward(torch.ones_like(ref))
        assert torch.equal(y, ref)
        for a, b in zip(grads, [xr.grad, experts.w_in.grad, experts.w_out.grad]):
            assert torch.equal(a, b)
        experts.zero_grad()
    experts.config = ExpertsConfig(activation="geglu", backend="loop")  # another backend: resolved anew
    with torch.no_grad():
        experts(x, counts)
    assert experts.grouped_backend(x.device, torch.float64) == "loop" and seen[-1] == (x.device, torch.float64)
    with pytest.raises(ValueError, match="backend='grouped_mm' does not support"):
        GroupedExperts(num_experts=4, dim=16, hidden=24, config=ExpertsConfig(backend="grouped_mm"),
                       dtype=torch.float64)(x, counts)
