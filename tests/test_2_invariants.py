"""Tier 2: invariants of the layer that need no reference implementation."""

from __future__ import annotations

import pytest
import torch
from moe_testutils import make_layer, output_and_grads, rand
from torch import nn

import moeflow
from moeflow import ExpertsConfig, RouterConfig

D, H = 8, 8


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("cf", [0.0, 1.0, -1.0], ids=["dropless", "cf1", "capped1"])
def test_single_expert_is_a_dense_ffn(gen, activation, cf):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=1, top_k=1, capacity_factor=cf,
                       experts_cfg=ExpertsConfig(activation=activation))
    x = rand(gen, 20, D)
    r = layer.router(x, top_k=1)
    assert torch.equal(r.weights_TK, torch.ones(20, 1, dtype=torch.float64))  # softmax of one logit: exactly 1
    assert torch.equal(r.ids_TK, torch.zeros(20, 1, dtype=torch.long))
    w_in, w_out = layer.experts.w_in, layer.experts.w_out

    def dense(x_: torch.Tensor) -> torch.Tensor:
        h = x_ @ w_in[0]
        if activation == "swiglu":
            gate, up = h[:, :H], h[:, H:]
            a = gate / (1 + torch.exp(-gate)) * up
        else:
            a = 0.5 * h * (1 + torch.erf(h / 2**0.5))
        return a @ w_out[0]

    params = [w_in, w_out]
    g = rand(gen, 20, D)
    y, grads = output_and_grads(layer, x, params, g)
    y_dense, grads_dense = output_and_grads(dense, x, params, g)
    torch.testing.assert_close(y, y_dense, rtol=1e-12, atol=1e-12)
    for a_, b_ in zip(grads, grads_dense):
        torch.testing.assert_close(a_, b_, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_dropless_equals_capacity_when_capacity_is_t(gen, k):
    E = 6
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=k, capacity_factor=0.0)
    x = rand(gen, 24, D)
    cf = E / k  # C = ceil(cf * T * K / E) = T: nothing can be dropped
    params = [p for _, p in layer.named_parameters()]
    g = rand(gen, 24, D)
    y0, g0 = output_and_grads(lambda x_: layer(x_), x, params, g)
    y1, g1 = output_and_grads(lambda x_: layer(x_, capacity_factor=cf), x, params, g)
    y2, g2 = output_and_grads(lambda x_: layer(x_, capacity_factor=-cf), x, params, g)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y2, y0, rtol=1e-12, atol=1e-12)
    for a, b, c in zip(g0, g1, g2):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(3, 5, D), (15, D), (2, 3, 1, D), (D,)], ids=["3d", "2d", "4d", "1d"])
@pytest.mark.parametrize("cf", [1.0, 0.0], ids=["cf1", "cf0"])
def test_any_leading_shape(gen, shape, cf):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=4, top_k=2, capacity_factor=cf)
    x = rand(gen, *shape)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    flat = layer(x.reshape(-1, D))
    assert torch.equal(y.reshape(-1, D), flat)
    assert flat.abs().max() > 0
    # a non-contiguous input gives the same answer
    xt = rand(gen, D, 6).t()
    assert not xt.is_contiguous()
    torch.testing.assert_close(layer(xt), layer(xt.contiguous()), rtol=1e-12, atol=1e-12)  # BLAS path may differ


@pytest.mark.parametrize("shape", [(0, D), (2, 0, D)], ids=["0xD", "2x0xD"])
@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5], ids=["cf1", "cf0", "capped"])
def test_zero_tokens(gen, shape, cf):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=4, top_k=2, capacity_factor=cf, eval_mode=False,
                       router=RouterConfig(z_loss_coef=0.1, importance_coef=0.1, bias_update_rate=0.1),
                       num_shared_experts=1)
    x = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    aux = moeflow.aux_loss(layer)
    assert aux.item() == 0.0
    assert layer.last_counts_E.tolist() == [0, 0, 0, 0]
    (y.sum() + aux).backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert layer.router.load_counts.sum() == 0
    moeflow.update_expert_bias(layer)  # nothing counted: no change, no error
    assert layer.router.expert_bias.abs().sum() == 0


def test_aux_loss_sums_over_layers(gen):
    cfg = dict(dim=D, hidden=H, num_experts=4, top_k=2)
    a = make_layer(gen, router=RouterConfig(load_balance_coef=0.1, z_loss_coef=0.01), **cfg)
    b = make_layer(gen, router=RouterConfig(load_balance_coef=0.2, importance_coef=0.3), **cfg)
    model = nn.Sequential(a, nn.Linear(D, D).double(), b)
    with pytest.raises(RuntimeError, match="forward"):
        moeflow.aux_loss(model)  # before any forward
    assert moeflow.moe_layers(model) == [a, b]
    model(rand(gen, 12, D))
    total = moeflow.aux_loss(model)
    expected = sum(a.aux_losses.values()) + sum(b.aux_losses.values())
    torch.testing.assert_close(total, expected, rtol=1e-14, atol=0)
    assert set(a.aux_losses) == {"load_balance", "z_loss"} and set(b.aux_losses) == {"load_balance", "importance"}
    assert total.item() > 0
    total.backward()
    assert a.router.linear.weight.grad.abs().max() > 0 and b.router.linear.weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match="no moeflow.MoE"):
        moeflow.aux_loss(nn.Sequential(nn.Linear(2, 2)))


def test_aux_losses_are_those_of_the_last_call(gen):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=4, router=RouterConfig(z_loss_coef=1.0))
    layer(rand(gen, 8, D, std=3.0))
    first = moeflow.aux_loss(layer).detach()
    x2 = rand(gen, 8, D, std=0.1)
    layer(x2)
    second = moeflow.aux_loss(layer)
    assert not torch.equal(first, second)
    layer(x2)
    torch.testing.assert_close(moeflow.aux_loss(layer), second)


@pytest.mark.parametrize("cf", [1.0, 0.0, 0.5], ids=["cf1", "cf0", "cf0.5"])
def test_last_counts_are_router_bincount(gen, cf):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=6, top_k=3, capacity_factor=cf)
    x = rand(gen, 30, D)
    layer(x)
    ids = layer.router(x, top_k=3).ids_TK
    assert layer.last_counts_E.dtype == torch.int64
    assert torch.equal(layer.last_counts_E, torch.bincount(ids.reshape(-1), minlength=6))  # before drops
    assert int(layer.last_counts_E.sum()) == 90
    layer(x, top_k=1)
    assert int(layer.last_counts_E.sum()) == 30


def test_layer_is_deterministic_in_eval(gen):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=6, top_k=2, capacity_factor=0.5,
                       router=RouterConfig(noise_std=1.0, jitter_eps=0.1, input_dropout=0.2))
    x = rand(gen, 16, D)
    assert torch.equal(layer(x), layer(x))


def test_exploration_does_not_touch_expert_input(gen):
    """Jitter, input dropout and noise act on the router only: with one expert (weight exactly
    1 whatever the logits) the training-mode output is the plain FFN of the unperturbed x."""
    cfg = RouterConfig(noise_std=1.0, jitter_eps=0.3, input_dropout=0.5)
    layer = make_layer(gen, dim=D, hidden=H, num_experts=1, top_k=1, capacity_factor=0.0, router=cfg,
                       experts_cfg=ExpertsConfig(activation="relu"), eval_mode=False)
    x = rand(gen, 16, D)
    expected = torch.relu(x @ layer.experts.w_in[0]) @ layer.experts.w_out[0]
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)
