"""The MoE layer in every dtype. fp64 stays fp64; fp32/bf16/fp16 agree with a higher precision copy
of the same layer within the tolerance of the dtype (error judged norm-wise, relative to the
output); bf16 autocast, dropless and capped."""

from __future__ import annotations

import copy

import pytest
import torch

import moeflow
from moeflow import DispatchConfig, ExpertsConfig

from helpers import make_layer, output_and_grads, rand, rel_err

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.75], ids=["cf1", "cf0", "capped"])
def test_fp64_end_to_end(gen, cf):
    layer = make_layer(gen, dim=8, hidden=8, num_experts=6, top_k=2, capacity_factor=cf, num_shared_experts=1)
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    x = rand(gen, 16, 8)
    r = layer.router(x, top_k=2)
    assert r.weights_TK.dtype == r.logits_TE.dtype == r.scores_TE.dtype == torch.float64
    params = list(layer.parameters())
    y, grads = output_and_grads(layer, x, params, rand(gen, 16, 8))
    assert y.dtype == torch.float64
    assert all(g.dtype == torch.float64 for g in grads)
    assert all(v.dtype == torch.float64 for v in layer.aux_losses.values())


def _low_precision_pair(gen, low: torch.dtype, hi: torch.dtype, cf: float, **kw):
    """(layer in `low`, the same rounded parameters in `hi`)."""
    layer_hi = make_layer(gen, dtype=hi, capacity_factor=cf, **kw)
    layer_low = copy.deepcopy(layer_hi).to(low)
    with torch.no_grad():  # the high precision copy holds exactly the rounded values
        for p_hi, p_low in zip(layer_hi.parameters(), layer_low.parameters()):
            p_hi.copy_(p_low.to(hi))
    return layer_low, layer_hi


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("cf", [1.0, 0.0, -0.75], ids=["cf1", "cf0", "capped"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_matches_fp32(gen, low, cf, activation):
    T, D = 16, 16
    layer_low, layer_32 = _low_precision_pair(
        gen, low, torch.float32, cf, dim=D, hidden=32, num_experts=4, top_k=2,
        experts_cfg=ExpertsConfig(activation=activation, bias=True), dispatch=DispatchConfig(drop_policy="score"),
    )
    x_low = rand(gen, T, D, dtype=low)
    x_32 = x_low.float()
    # the router runs in fp32 on identical values, so the routing is identical
    r_low, r_32 = layer_low.router(x_low, top_k=2), layer_32.router(x_32, top_k=2)
    assert torch.equal(r_low.ids_TK, r_32.ids_TK)
    assert torch.equal(r_low.weights_TK, r_32.weights_TK)

    g = rand(gen, T, D, dtype=low)
    params_low = [layer_low.experts.w_in, layer_low.experts.w_out, layer_low.router.linear.weight]
    params_32 = [layer_32.experts.w_in, layer_32.experts.w_out, layer_32.router.linear.weight]
    y_low, grads_low = output_and_grads(layer_low, x_low, params_low, g)
    y_32, grads_32 = output_and_grads(layer_32, x_32, params_32, g.float())
    assert y_low.dtype == low and y_low.shape == x_low.shape
    assert all(gr.dtype == low for gr in grads_low)
    assert torch.isfinite(y_low).all()
    assert rel_err(y_low, y_32, norm="fro") < 3e-2
    for name, a, b in zip(["x", "w_in", "w_out", "router"], grads_low, grads_32):
        assert rel_err(a, b, norm="fro") < 5e-2, name


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.75], ids=["cf1", "cf0", "capped"])
def test_fp32_matches_fp64(gen, cf):
    T, D = 32, 8
    layer_32, layer_64 = _low_precision_pair(
        gen, torch.float32, torch.float64, cf, dim=D, hidden=16, num_experts=6, top_k=2, num_shared_experts=1
    )
    x_32 = rand(gen, T, D, dtype=torch.float32)
    x_64 = x_32.double()
    assert torch.equal(layer_32.router(x_32, top_k=2).ids_TK, layer_64.router(x_64, top_k=2).ids_TK)
    g = rand(gen, T, D, dtype=torch.float32)
    p32, p64 = list(layer_32.parameters()), list(layer_64.parameters())
    y32, gr32 = output_and_grads(layer_32, x_32, p32, g)
    y64, gr64 = output_and_grads(layer_64, x_64, p64, g.double())
    assert y32.dtype == torch.float32 and y64.dtype == torch.float64
    assert rel_err(y32, y64, norm="fro") < 1e-5
    for (name, _), a, b in zip([("x", None), *layer_32.named_parameters()], gr32, gr64):
        assert rel_err(a, b, norm="fro") < 1e-5, name


def test_autocast_bf16_dropless_and_capped():
    layer = moeflow.MoE(dim=16, hidden=16, num_experts=4, top_k=2, capacity_factor=0)
    x = torch.randn(6, 16, dtype=torch.bfloat16)
    for cf in (0.0, -1.0, 1.0):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, capacity_factor=cf)
        assert y.shape == x.shape and torch.isfinite(y.float()).all()
        ref = layer(x.float(), capacity_factor=cf)
        assert (y.float() - ref).abs().max() <= 5e-2 * ref.abs().max() + 1e-3


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_the_plan_holds_the_combine_weights_in_the_input_dtype(gen, cf):
    """``DispatchPlan.weights_TK`` is in the input dtype (types.py), whatever the router's (fp32
    by default): what the combine multiplies the expert rows by."""
    layer = make_layer(gen, dim=16, hidden=16, num_experts=4, top_k=2, dtype=torch.bfloat16, capacity_factor=cf)
    x = torch.randn(6, 16, generator=gen).to(torch.bfloat16)
    routing = layer.router(x, top_k=2)
    assert routing.weights_TK.dtype == torch.float32
    _, plan = layer.dispatcher.dispatch(x, routing, capacity_factor=cf)
    assert plan.weights_TK.dtype == torch.bfloat16
    torch.testing.assert_close(plan.weights_TK, routing.weights_TK.to(torch.bfloat16), rtol=0, atol=0)
