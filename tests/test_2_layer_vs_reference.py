"""Tier 2: the MoE layer against the per-expert loop reference (``moeflow.testing.loop_moe``).

fp64, eval mode; outputs and the gradients of x and of every parameter (router, experts,
shared experts) must agree to ~1e-10. The reference routes token by token in Python and drops
by an independent per-expert loop, so this checks routing, slot assignment, drop policies,
dispatch/combine and the experts together.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
from moe_testutils import assert_close_rel, compare_layer_with, make_layer, output_and_grads, rand
from torch import nn

import moeflow
from moeflow import DispatchConfig, ExpertsConfig, RouterConfig
from moeflow.dispatch.capacity import capacity_rows
from moeflow.kernels import native_grouped_mm_supported
from moeflow.testing import einsum_moe, loop_moe

T, D, H, E = 32, 8, 8, 6

SCORINGS = {
    "softmax": dict(scoring="softmax"),
    "softmax-norm": dict(scoring="softmax", normalize_topk=True),
    "topk_softmax": dict(scoring="topk_softmax"),
    "sigmoid-norm-2.5": dict(scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5),
    "sigmoid-groups": dict(scoring="sigmoid", num_groups=3, topk_groups=2, group_score="top2_sum"),
}
CAPACITY_FACTORS = [1.0, 0.5, 0.0, -0.75, 4.0]
POLICIES = ["position", "score", "bpr"]


def _router(kind: str, scoring: str) -> RouterConfig:
    return RouterConfig(kind=kind, cosine_proj_dim=8, **SCORINGS[scoring])


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cf", CAPACITY_FACTORS, ids=[f"cf{c}" for c in CAPACITY_FACTORS])
@pytest.mark.parametrize("scoring", list(SCORINGS))
@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_layer_matches_loop_reference(gen, kind, scoring, cf, policy, weight_at, k):
    layer = make_layer(
        gen,
        dim=D,
        hidden=H,
        num_experts=E,
        top_k=k,
        capacity_factor=cf,
        router=_router(kind, scoring),
        dispatch=DispatchConfig(drop_policy=policy, weight_at=weight_at),
    )
    x = rand(gen, T, D)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), x, gen)
    if cf in (0.5, -0.75):  # these factors always drop something (cap < mean load <= max load)
        cap = capacity_rows(abs(cf), num_tokens=T, top_k=k, num_experts=E)
        assert int(layer.last_counts_E.max()) > cap


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.75], ids=["cf1", "cf0", "cf-0.75"])
@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu", "geglu"])
def test_activations_with_bias(gen, activation, cf):
    layer = make_layer(
        gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf,
        experts_cfg=ExpertsConfig(activation=activation, bias=True),
    )
    assert layer.experts.b_in is not None
    compare_layer_with(layer, lambda x: loop_moe(layer, x), rand(gen, T, D), gen)


@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("cf", [0.5, -0.75, 1.0], ids=["cf0.5", "cf-0.75", "cf1"])
def test_renormalize_after_drop(gen, cf, policy, weight_at):
    cfg = DispatchConfig(drop_policy=policy, weight_at=weight_at, renormalize_after_drop=True)
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=3, capacity_factor=cf, dispatch=cfg)
    x = rand(gen, T, D)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), x, gen)
    # renormalising changes the answer (something was dropped from a token that kept something)
    plain = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=3, capacity_factor=cf,
                       dispatch=DispatchConfig(drop_policy=policy, weight_at=weight_at))
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        assert not torch.allclose(layer(x), plain(x))


def _hand_shared(layer: moeflow.MoE, x: torch.Tensor) -> torch.Tensor:
    """The shared expert written out: act(x W_in^T + b) W_out^T (+ b), times sigmoid(x g) if gated."""
    s = layer.shared
    h = x @ s.proj_in.weight.t()
    if s.proj_in.bias is not None:
        h = h + s.proj_in.bias
    act = layer.config.experts.activation
    if act == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        a = gate * torch.sigmoid(gate) * up
    elif act == "relu":
        a = h.clamp_min(0)
    else:
        raise AssertionError(act)
    y = a @ s.proj_out.weight.t()
    if s.proj_out.bias is not None:
        y = y + s.proj_out.bias
    if layer.config.shared_gate:
        y = y * torch.sigmoid(x @ s.gate.weight.t())
    return y


@pytest.mark.parametrize(
    "shared",
    [
        dict(num_shared_experts=1),
        dict(num_shared_experts=2, shared_gate=True),
        dict(num_shared_experts=1, shared_hidden=12, shared_gate=True),
        dict(num_shared_experts=2, experts_cfg=ExpertsConfig(activation="relu", bias=True)),
    ],
    ids=["one", "two-gated", "hidden12-gated", "relu-bias"],
)
@pytest.mark.parametrize("cf", [1.0, 0.0], ids=["cf1", "cf0"])
def test_shared_experts(gen, shared, cf):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf, **shared)
    assert layer.shared is not None
    width = layer.config.shared_width
    gated = layer.config.experts.gated
    assert layer.shared.proj_in.weight.shape == ((2 if gated else 1) * width, D)
    x = rand(gen, T, D)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), x, gen)
    # independent of loop_moe (which reuses layer.shared): routed part + the shared FFN by hand
    routed_only = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf,
                             experts_cfg=layer.config.experts)
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")})
    with torch.no_grad():
        torch.testing.assert_close(layer(x), routed_only(x) + _hand_shared(layer, x), rtol=1e-12, atol=1e-12)
        assert _hand_shared(layer, x).abs().max() > 1e-3


@pytest.mark.parametrize(
    "override",
    [dict(capacity_factor=0), dict(capacity_factor=0.5), dict(capacity_factor=-0.75), dict(capacity_factor=4.0),
     dict(top_k=1), dict(top_k=3), dict(top_k=3, capacity_factor=0.0)],
    ids=["cf0", "cf0.5", "cf-0.75", "cf4", "k1", "k3", "k3-cf0"],
)
def test_per_call_overrides(gen, override):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=1.0,
                       dispatch=DispatchConfig(drop_policy="score"))
    x = rand(gen, T, D)
    compare_layer_with(
        layer, lambda x: loop_moe(layer, x, **override), x, gen, call=lambda x: layer(x, **override)
    )
    # the same as a layer configured with those values ...
    configured = make_layer(gen, dim=D, hidden=H, num_experts=E, dispatch=DispatchConfig(drop_policy="score"),
                            **{"top_k": 2, "capacity_factor": 1.0, **override})
    configured.load_state_dict(layer.state_dict())
    with torch.no_grad():
        y = layer(x, **override)
        assert torch.equal(y, configured(x))
        # ... and the override does not stick: the next plain call uses the configured values
        torch.testing.assert_close(layer(x), loop_moe(layer, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("activation, bias", [("swiglu", False), ("relu", True), ("geglu", True)])
@pytest.mark.parametrize("cf", [0.0, -0.75, 1.0], ids=["cf0", "cf-0.75", "cf1"])
def test_experts_backend_loop_vs_grouped_mm(gen, cf, activation, bias):
    """fp32: the two grouped-GEMM backends agree (outputs and gradients) in every capacity mode."""
    kw = dict(dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf, dtype=torch.float32)
    loop = make_layer(gen, experts_cfg=ExpertsConfig(activation=activation, bias=bias, backend="loop"), **kw)
    x = rand(gen, T, D, dtype=torch.float32)
    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32, (D, 2 * H, H)):
        native = make_layer(gen, experts_cfg=ExpertsConfig(activation=activation, bias=bias, backend="grouped_mm"), **kw)
        if cf > 0:
            pytest.skip("capacity mode does not use the grouped GEMM; F.grouped_mm unsupported here")
        with pytest.raises(ValueError, match="grouped_mm"):
            native(x)
        return
    native = make_layer(gen, experts_cfg=ExpertsConfig(activation=activation, bias=bias, backend="grouped_mm"), **kw)
    native.load_state_dict(loop.state_dict())
    names, params_loop = zip(*loop.named_parameters())
    params_native = [p for _, p in native.named_parameters()]
    g = rand(gen, T, D, dtype=torch.float32)
    y1, gr1 = output_and_grads(loop, x, params_loop, g)
    y2, gr2 = output_and_grads(native, x, params_native, g)
    assert_close_rel(y2, y1, 1e-5, "output")
    for name, a, b in zip(("x", *names), gr2, gr1):
        assert_close_rel(a, b, 1e-5, f"grad of {name}")


def test_grouped_mm_backend_rejects_unaligned_dims(gen):
    """A 6-wide fp32 row is 24 bytes: F.grouped_mm cannot take it, 'auto' falls back to the loop."""
    kw = dict(dim=6, hidden=6, num_experts=4, top_k=2, capacity_factor=0.0, dtype=torch.float32)
    x = rand(gen, 16, 6, dtype=torch.float32)
    explicit = make_layer(gen, experts_cfg=ExpertsConfig(backend="grouped_mm"), **kw)
    with pytest.raises(ValueError, match="grouped_mm"):
        explicit(x)
    auto = make_layer(gen, experts_cfg=ExpertsConfig(backend="auto"), **kw)
    loop = make_layer(gen, experts_cfg=ExpertsConfig(backend="loop"), **kw)
    loop.load_state_dict(auto.state_dict())
    with torch.no_grad():
        assert torch.equal(auto(x), loop(x))


def _module_experts(dim: int, hidden: int, n: int) -> moeflow.ModuleExperts:
    return moeflow.ModuleExperts(
        [nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)).double() for _ in range(n)]
    )


@pytest.mark.parametrize("policy", ["position", "bpr"])
@pytest.mark.parametrize("cf", [1.0, 0.5, 0.0, -0.75], ids=["cf1", "cf0.5", "cf0", "cf-0.75"])
def test_module_experts(gen, cf, policy):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf,
                       experts=_module_experts(D, H, E), dispatch=DispatchConfig(drop_policy=policy))
    assert isinstance(layer.experts, moeflow.ModuleExperts)
    assert all(getattr(p, "moeflow_expert", False) for p in layer.experts.parameters())
    compare_layer_with(layer, lambda x: loop_moe(layer, x), rand(gen, T, D), gen)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize("cf", [1.0, 0.5, 0.0, 4.0], ids=["cf1", "cf0.5", "cf0", "cf4"])
@pytest.mark.parametrize("policy", ["position", "bpr"])
def test_einsum_reference_agrees_with_loop(gen, policy, cf, weight_at, k):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=k, capacity_factor=cf,
                       dispatch=DispatchConfig(drop_policy=policy, weight_at=weight_at),
                       router=RouterConfig(scoring="softmax", normalize_topk=True))
    x = rand(gen, T, D)
    names, params = zip(*layer.named_parameters())
    g = rand(gen, T, D)
    y1, gr1 = output_and_grads(lambda x: loop_moe(layer, x), x, params, g)
    y2, gr2 = output_and_grads(lambda x: einsum_moe(layer, x), x, params, g)
    assert_close_rel(y2, y1, 1e-10, "output")
    for name, a, b in zip(("x", *names), gr2, gr1):
        assert_close_rel(a, b, 1e-10, f"grad of {name}")


def test_einsum_reference_limits(gen):
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E, dispatch=DispatchConfig(drop_policy="score"))
    with pytest.raises(ValueError, match="score"):
        einsum_moe(layer, rand(gen, 4, D))
    layer = make_layer(gen, dim=D, hidden=H, num_experts=E)
    with pytest.raises(ValueError, match="capacity_factor"):
        einsum_moe(layer, rand(gen, 4, D), capacity_factor=-1.0)


@st.composite
def layer_configs(draw):
    E_ = draw(st.integers(1, 8))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if E_ % g == 0]))
    topk_groups = draw(st.integers(1, groups))
    k = draw(st.integers(1, topk_groups * (E_ // groups)))
    scoring = draw(st.sampled_from(["softmax", "topk_softmax", "sigmoid"]))
    group_score = "top2_sum" if groups > 1 and E_ // groups >= 2 and draw(st.booleans()) else "max"
    router = RouterConfig(
        kind=draw(st.sampled_from(["linear", "cosine"])),
        scoring=scoring,
        normalize_topk=scoring != "topk_softmax" and draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
        num_groups=groups,
        topk_groups=topk_groups,
        group_score=group_score,
        bias=draw(st.booleans()),
        cosine_proj_dim=4,
    )
    dispatch = DispatchConfig(
        drop_policy=draw(st.sampled_from(POLICIES)),
        weight_at=draw(st.sampled_from(["combine", "dispatch"])),
        renormalize_after_drop=draw(st.booleans()),
    )
    experts = ExpertsConfig(activation=draw(st.sampled_from(["relu", "gelu", "silu", "swiglu", "geglu"])), bias=draw(st.booleans()))
    return dict(
        num_experts=E_, top_k=k, router=router, dispatch=dispatch, experts_cfg=experts,
        capacity_factor=draw(st.sampled_from([1.0, 0.5, 0.0, -0.75, -2.0, 4.0, 1e-9, 1.1])),
        num_shared_experts=draw(st.sampled_from([0, 0, 1])),
    )


@given(cfg=layer_configs(), T_=st.integers(1, 20), seed=st.integers(0, 2**31 - 1))
def test_random_layer_configs_match_loop_reference(cfg, T_, seed):
    """Any combination of the options above, any small T (including 1), E (including 1) and k."""
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(gen, dim=4, hidden=4, **cfg)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), rand(gen, T_, 4), gen)
