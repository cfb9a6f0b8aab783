"""Tier 2: single-process regressions found in review (autocast, meta init, empty batches,
host-sync-free counting)."""

from __future__ import annotations

import torch

import moeflow
from moeflow.kernels.counts import count_ids


def test_autocast_bf16_dropless_and_capped():
    layer = moeflow.MoE(dim=16, hidden=16, num_experts=4, top_k=2, capacity_factor=0)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    for cf in (0.0, -1.0, 1.0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, capacity_factor=cf)
        assert y.shape == x.shape and torch.isfinite(y.float()).all()
        ref = layer(x.float(), capacity_factor=cf)
        assert (y.float() - ref).abs().max() <= 5e-2 * ref.abs().max() + 1e-3


def test_meta_init_then_to_empty():
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, device="meta")
    layer.to_empty(device="cpu")
    assert layer.router.expert_bias.device.type == "cpu" and layer.router.expert_bias.dtype == torch.float32


def test_empty_batch_backward_without_input_grad():
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2)
    y = layer(torch.randn(0, 8))
    y.sum().backward()
    assert moeflow.aux_loss(layer) == 0 and "load_balance" in layer.aux_losses
    assert all(p.grad is not None and (p.grad == 0).all() for p in layer.parameters())


def test_count_ids_matches_bincount():
    ids = torch.randint(0, 7, (50, 3))
    assert torch.equal(count_ids(ids, 7), torch.bincount(ids.reshape(-1), minlength=7))
    assert torch.equal(count_ids(torch.zeros(0, 2, dtype=torch.long), 3), torch.zeros(3, dtype=torch.long))


def test_deepcopy_after_forward():
    import copy

    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2)
    layer(torch.randn(5, 8))
    clone = copy.deepcopy(layer)
    assert clone.aux_losses is None and layer.aux_losses is not None
    x = torch.randn(3, 8)
    assert torch.equal(clone(x), layer(x))
