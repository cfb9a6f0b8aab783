"""The MoE layer (``moeflow.layer.moe``) against the per-expert loop reference
(``moeflow.testing.loop_moe``), then its invariants that need no reference, and regressions
found in review (meta init, empty batches, deepcopy).

Against the reference: fp64, eval mode; outputs and the gradients of x and of every parameter (router, experts,
shared experts) must agree to ~1e-10. The reference routes token by token in Python and drops
by an independent per-expert loop, so this checks routing, slot assignment, drop policies,
dispatch/combine and the experts together.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch
from torch import nn

import moeflow
from moeflow import DispatchConfig, ExpertsConfig, RouterConfig
from moeflow.dispatch.capacity import capacity_rows
from moeflow.kernels import native_grouped_mm_supported
from moeflow.testing import einsum_moe, loop_moe

from helpers import assert_close_rel, compare_layer_with, make_layer, output_and_grads, rand

pytestmark = pytest.mark.reference

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


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
def test_dense_ffn_on_its_own(gen, activation):
    """``DenseFFN`` as a user builds it (it is public): by default no biases, no gate and
    weights of std 0.02; with ``bias``, ``gate``, ``init_std`` and ``dtype`` given, zero biases
    that are used, a bias-free gate of one output, and ``act(x W_in + b_in) W_out + b_out``
    scaled by ``sigmoid(x g)``. Gated activations double ``proj_in``'s width."""
    from moeflow.experts.ffn import DenseFFN, activate

    torch.manual_seed(3)
    width = 48 if activation == "gelu" else 96
    plain = DenseFFN(dim=64, hidden=48, activation=activation)
    assert plain.proj_in.weight.shape == (width, 64) and plain.proj_out.weight.shape == (64, 48)
    assert plain.proj_in.bias is None and plain.proj_out.bias is None and plain.gate is None
    assert all(0.018 < float(w.detach().std()) < 0.022 for w in (plain.proj_in.weight, plain.proj_out.weight))
    full = DenseFFN(dim=64, hidden=48, activation=activation, bias=True, gate=True, init_std=0.3, dtype=torch.float64)
    assert full.gate.weight.shape == (1, 64) and full.gate.bias is None
    assert all(p.dtype == torch.float64 for p in full.parameters())
    assert all(0.28 < float(w.detach().std()) < 0.32 for w in (full.proj_in.weight, full.proj_out.weight))
    assert all(torch.equal(b, torch.zeros_like(b)) for b in (full.proj_in.bias, full.proj_out.bias))
    with torch.no_grad():
        for b in (full.proj_in.bias, full.proj_out.bias):
            b.copy_(rand(gen, *b.shape))
    x = rand(gen, 5, 64)
    a = activate(x @ full.proj_in.weight.t() + full.proj_in.bias, activation)
    want = (a @ full.proj_out.weight.t() + full.proj_out.bias) * torch.sigmoid(x @ full.gate.weight.t())
    with torch.no_grad():
        torch.testing.assert_close(full(x), want, rtol=1e-12, atol=1e-12)


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
    # the shared FFN has biases exactly when the experts do
    bias = layer.config.experts.bias
    assert (layer.shared.proj_in.bias is not None, layer.shared.proj_out.bias is not None) == (bias, bias)
    x = rand(gen, T, D)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), x, gen)
    # independent of loop_moe (which reuses layer.shared): routed part + the shared FFN by hand
    routed_only = make_layer(gen, dim=D, hidden=H, num_experts=E, top_k=2, capacity_factor=cf,
                             experts_cfg=layer.config.experts)
    routed_only.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("shared.")})
    with torch.no_grad():
        torch.testing.assert_close(layer(x), routed_only(x) + _hand_shared(layer, x), rtol=1e-12, atol=1e-12)
        assert _hand_shared(layer, x).abs().max() > 1e-3


def test_a_new_layer_has_no_counts_or_losses_yet():
    """Before its first call a layer reports nothing (None, which callers test for), not an
    empty value."""
    layer = moeflow.MoE(config=moeflow.MoEConfig(dim=8, hidden=8, num_experts=4, top_k=2))
    assert layer.last_counts_E is None and layer.aux_losses is None and layer.shared is None


def test_a_router_without_a_config_takes_the_default_one():
    """``Router(config=None)`` is ``RouterConfig()``: a linear top-k softmax router that routes."""
    from moeflow.layer.router import Router

    torch.manual_seed(3)
    router = Router(dim=8, num_experts=4)
    assert router.config == RouterConfig() and router.config is not None
    result = router(torch.randn(5, 8), top_k=2)
    assert result.ids_TK.shape == (5, 2) and torch.equal(router.expert_bias, torch.zeros(4))


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("bias", [False, True])
def test_a_router_makes_its_parameters_as_configured(kind, bias):
    """Every parameter of either router kind has the bias the config asks for and the device
    and dtype the router was given (``meta`` and fp64 here, neither the default)."""
    from moeflow.layer.router import Router

    router = Router(dim=8, num_experts=4, config=RouterConfig(kind=kind, bias=bias), device="meta",
                    dtype=torch.float64)
    params = dict(router.named_parameters())
    assert all(p.is_meta and p.dtype == torch.float64 for p in params.values()), params
    assert (("linear.bias" if kind == "linear" else "proj.bias") in params) == bias
    buffers = dict(router.named_buffers())  # the balancing state: fp32 bias, int64 counts, on the device
    assert {name: (b.shape, b.dtype, b.is_meta) for name, b in buffers.items()} == {
        "expert_bias": ((4,), torch.float32, True), "load_counts": ((4,), torch.int64, True)}
    fresh = Router(dim=8, num_experts=4, config=RouterConfig(kind=kind, bias=bias))
    assert not fresh.expert_bias.any() and not fresh.load_counts.any()
    default = torch.get_default_dtype()
    try:  # the bias is fp32 whatever the default dtype too
        torch.set_default_dtype(torch.float64)
        assert Router(dim=8, num_experts=4, config=RouterConfig(kind=kind, bias=bias)).expert_bias.dtype == torch.float32
    finally:
        torch.set_default_dtype(default)
    if kind == "cosine":
        assert params["expert_embed"].shape == (4, router.config.cosine_proj_dim)
        # drawn at std 0.32 (X-MoE's gain): the logits normalise it away, but not its updates
        torch.manual_seed(11)
        embed = Router(dim=8, num_experts=4, config=RouterConfig(kind=kind, bias=bias)).expert_embed
        assert 0.29 < float(embed.std()) < 0.35 and abs(float(embed.mean())) < 0.05


def test_shared_experts_take_the_experts_init_std():
    """The shared FFN is drawn with the experts' ``init_std`` (not ``DenseFFN``'s default),
    as the routed experts are: 0.3 and 0.002, each far from the default 0.02."""
    for std in (0.3, 0.002):
        torch.manual_seed(5)
        cfg = moeflow.MoEConfig(dim=64, hidden=96, num_experts=4, top_k=2, num_shared_experts=1,
                        experts=ExpertsConfig(init_std=std))
        layer = moeflow.MoE(config=cfg)
        for w in (layer.shared.proj_in.weight, layer.shared.proj_out.weight, layer.experts.w_in):
            assert abs(w.detach().std().item() / std - 1) < 0.1, (std, w.shape)


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


@pytest.mark.parametrize("halves", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_hidden_slices_cut_and_join_by_hidden_unit(gen, halves, n):
    """Slice ``j`` of ``n`` holds hidden units ``[j*H/n, (j+1)*H/n)``: those columns of every
    half of ``w_in`` (gate, then up) and those rows of ``w_out``, leading dims kept;
    ``join_hidden_slices`` puts one expert's slices back together exactly."""
    from moeflow.experts.ffn import cut_hidden_slice, join_hidden_slices

    E, D, H = 2, 4, 6
    w_in, w_out = rand(gen, E, D, halves * H), rand(gen, E, H, D)
    h = H // n
    for j in range(n):
        cols = [c for g in range(halves) for c in range(g * H + j * h, g * H + (j + 1) * h)]
        assert torch.equal(cut_hidden_slice("w_in", w_in, n, j, halves), w_in[..., cols])
        assert torch.equal(cut_hidden_slice("w_out", w_out, n, j, halves), w_out[:, j * h:(j + 1) * h])
    for e in range(E):
        for name, full in (("w_in", w_in[e]), ("w_out", w_out[e])):
            parts = [cut_hidden_slice(name, full, n, j, halves) for j in range(n)]
            assert torch.equal(join_hidden_slices(name, parts, halves), full)
    for bad in (lambda: cut_hidden_slice("b_in", w_in, n, 0, halves), lambda: join_hidden_slices("b_in", [w_in[0]], halves)):
        with pytest.raises(ValueError, match="'b_in'"):
            bad()
    # GroupedExperts.hidden_slices: expert j*E + x is slice j of expert x, and the slices' outputs
    # add up to the expert's (its E*n experts run on E*n copies of each expert's rows)
    experts = moeflow.GroupedExperts(num_experts=E, dim=D, hidden=H, dtype=torch.float64,
                                     config=ExpertsConfig(activation="swiglu" if halves == 2 else "gelu"))
    sliced = experts.hidden_slices(n)
    assert (sliced.num_experts, sliced.hidden, sliced.halves) == (E * n, h, halves)
    assert all(p.is_leaf and p.requires_grad for p in sliced.parameters())
    for j in range(n):
        for e in range(E):
            assert torch.equal(sliced.w_in[j * E + e], cut_hidden_slice("w_in", experts.w_in[e], n, j, halves))
            assert torch.equal(sliced.w_out[j * E + e], cut_hidden_slice("w_out", experts.w_out[e], n, j, halves))
    x = rand(gen, E, 3, D)
    with torch.no_grad():
        whole = experts(x, torch.full((E,), 3))
        parts = sliced(x.repeat(n, 1, 1), torch.full((E * n,), 3)).unflatten(0, (n, E)).sum(0)
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    for r in (0, 4, 2.0):
        with pytest.raises(ValueError, match="hidden slices"):
            experts.hidden_slices(r)
    with torch.device("meta"):  # the default device: the copies must land on the weights' device
        assert experts.hidden_slices(n).w_in.device.type == experts.shard(0, 1).w_in.device.type == "cpu"
    with pytest.raises(ValueError, match="bias=False"):
        moeflow.GroupedExperts(num_experts=E, dim=D, hidden=H, config=ExpertsConfig(bias=True)).hidden_slices(n)


@pytest.mark.parametrize("dim", [8, 6], ids=["aligned", "odd-rows"])
def test_grouped_ffn_default_backend_fits_the_feature_sizes(gen, dim):
    """``grouped_ffn`` without a backend picks one that runs these sizes: torch's grouped GEMM
    needs every row stride (D, F and H elements) a multiple of 16 bytes, so D = 6 in fp32 must
    not go to it. The result is the per-expert loop's."""
    from moeflow.experts.ffn import grouped_ffn

    counts = torch.tensor([3, 0, 4])
    x, w_in, w_out = rand(gen, 7, dim).float(), rand(gen, 3, dim, 16).float(), rand(gen, 3, 8, dim).float()
    with torch.no_grad():
        got = grouped_ffn(x, counts, w_in, w_out, activation="swiglu")
        want = grouped_ffn(x, counts, w_in, w_out, activation="swiglu", backend="loop")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trained", ["x", "w_in", "w_out"])
def test_grouped_ffn_gives_a_gradient_to_whichever_operand_alone_needs_one(gen, trained):
    """The no-grad shortcut of ``grouped_ffn`` (nothing for autograd to record) must not be taken
    when any one of x, w_in, w_out requires a gradient (a frozen input and one frozen weight, as
    in partial fine-tuning): the lean Functions run (autograd through the shortcut's ops would
    save more), and that operand gets the loop reference's gradient."""
    from moeflow.experts.ffn import grouped_ffn

    counts = torch.tensor([3, 0, 4])
    ops = {"x": rand(gen, 7, 8).float(), "w_in": rand(gen, 3, 8, 16).float(), "w_out": rand(gen, 3, 8, 8).float()}
    ops[trained].requires_grad_(True)
    g = rand(gen, 7, 8).float()
    y = grouped_ffn(ops["x"], counts, ops["w_in"], ops["w_out"], activation="swiglu", backend="grouped_mm")
    assert type(y.grad_fn).__name__ == "_ActSecondGEMMBackward"  # the lean backward, not autograd's
    (got,) = torch.autograd.grad(y, [ops[trained]], g)
    (want,) = torch.autograd.grad(grouped_ffn(ops["x"], counts, ops["w_in"], ops["w_out"], activation="swiglu",
                                              backend="loop"), [ops[trained]], g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_ffn_recompute_keeps_the_named_backend(gen, monkeypatch):
    """With biases and ``recompute`` the FFN runs inside ``torch.utils.checkpoint`` with the
    backend the caller named (``"loop"`` here), not the automatic choice."""
    from moeflow.experts.ffn import grouped_ffn
    from moeflow.kernels.grouped_mm import GROUPED_MM_BACKENDS

    def refuse(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("the native grouped GEMM ran where the loop was asked for")

    monkeypatch.setitem(GROUPED_MM_BACKENDS, "grouped_mm", refuse)
    counts = torch.tensor([3, 0, 4])
    x = rand(gen, 7, 8).float().requires_grad_(True)
    w_in, w_out = rand(gen, 3, 8, 16).float(), rand(gen, 3, 8, 8).float()
    b_in, b_out = rand(gen, 3, 16).float(), rand(gen, 3, 8).float()
    y = grouped_ffn(x, counts, w_in, w_out, b_in, b_out, activation="swiglu", backend="loop", recompute=True)
    y.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("biases", ["b_in", "b_out", "both"])
@pytest.mark.parametrize("act", ["gelu", "callable"])
def test_grouped_ffn_with_either_bias_or_a_callable_activation(gen, biases, act):
    """The torch path of ``grouped_ffn`` (biases or a custom activation): ``act(x W_in[e] +
    b_in[e]) W_out[e] + b_out[e]`` per row's expert with either bias alone (expert parallelism's
    hidden shards pass ``b_in`` only), written out by hand here; with ``meta`` as the default
    device, so the rows' expert ids are built on x's device."""
    from moeflow.experts.ffn import grouped_ffn

    counts = torch.tensor([3, 0, 4])
    x, w_in, w_out = rand(gen, 7, 8), rand(gen, 3, 8, 6), rand(gen, 3, 6, 8)
    b_in = rand(gen, 3, 6) if biases in ("b_in", "both") else None
    b_out = rand(gen, 3, 8) if biases in ("b_out", "both") else None
    fn = torch.nn.functional.gelu if act == "gelu" else (lambda h: torch.tanh(h) * h)
    expert = [0, 0, 0, 2, 2, 2, 2]
    want = torch.stack([
        fn(x[r] @ w_in[e] + (0 if b_in is None else b_in[e])) @ w_out[e] + (0 if b_out is None else b_out[e])
        for r, e in enumerate(expert)])
    with torch.device("meta"):
        got = grouped_ffn(x, counts, w_in, w_out, b_in, b_out, activation="gelu" if act == "gelu" else fn,
                          backend="loop")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", ["grouped", "padded"])
def test_grouped_experts_without_rows_give_an_empty_output_and_zero_gradients(gen, layout):
    """A rank whose experts got no rows (expert parallelism) calls them on an empty input: an
    empty output of the input's shape, still in the graph, so every weight gets a zero gradient
    and all ranks run the same backward. One row is not "no rows"."""
    experts = moeflow.GroupedExperts(num_experts=3, dim=8, hidden=8, dtype=torch.float64)
    for rows in (0, 1):
        x = rand(gen, rows, 8) if layout == "grouped" else rand(gen, 3, rows, 8)
        x.requires_grad_(True)
        counts = torch.tensor([rows, 0, 0])
        y = experts(x, counts)
        assert y.shape == x.shape
        grads = torch.autograd.grad(y.sum(), [x, *experts.parameters()], allow_unused=False)
        if rows == 0:
            assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        else:
            assert float(grads[1].abs().sum()) > 0
    one = moeflow.GroupedExperts(num_experts=1, dim=1, hidden=4, dtype=torch.float64)  # one element: one row, D = 1
    x1 = rand(gen, 1, 1) if layout == "grouped" else rand(gen, 1, 1, 1)
    with torch.no_grad():
        assert float(one(x1, torch.tensor([1])).abs().sum()) > 0


def test_grouped_experts_shard_copies_a_range_of_experts(gen):
    """``shard(start, count)``: a module of experts ``[start, start + count)``, copies (not views)
    of every parameter; an empty or out-of-range shard is refused."""
    experts = moeflow.GroupedExperts(num_experts=4, dim=D, hidden=H, dtype=torch.float64,
                                     config=ExpertsConfig(bias=True))
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(rand(gen, *p.shape))
    part = experts.shard(1, 2)
    assert part.num_experts == 2 and part.config == experts.config
    for (name, p), (_, q) in zip(experts.named_parameters(), part.named_parameters(), strict=True):
        assert torch.equal(q, p[1:3]) and q.data_ptr() != p[1:3].data_ptr(), name
    for start, count in ((0, 0), (3, 2), (-1, 1)):
        with pytest.raises(ValueError, match="outside"):
            experts.shard(start, count)


@pytest.mark.parametrize("like_dtype", [torch.float64, torch.bfloat16])
def test_graph_zero_is_an_exact_zero_in_the_input_dtype_with_zero_gradients(gen, like_dtype):
    """``graph_zero`` (added where no expert computed anything, and under ``ModuleExperts``'
    rows) is exactly 0 in ``like``'s dtype whatever the module's dtype, and hands every
    parameter and ``like`` a zero gradient, not a NaN, on non-empty tensors too."""
    from moeflow.experts.ffn import graph_zero

    experts = _module_experts(D, H, 3).float()
    like = (rand(gen, 5, D) + 1).to(like_dtype).requires_grad_(True)
    zero = graph_zero(experts, like)
    assert zero.dtype == like_dtype and zero.dim() == 0 and float(zero.detach()) == 0.0
    grads = torch.autograd.grad(zero, [like, *experts.parameters()])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


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


# ----------------------------------------------------------------------------- invariants (no reference)


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


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5], ids=["capacity", "dropless", "capped"])
@pytest.mark.parametrize("losses", [True, False], ids=["losses", "no-losses"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_one_forward_counts_the_assignments_once(gen, monkeypatch, cf, losses, grad):
    """The assignments per expert are counted once per call (``RoutingResult.counts_E``) and that
    count is passed down to the balance losses (load balance and counted load), the bias
    counters, the slot assignment, the experts and ``last_counts_E``: ``count_ids`` (wherever a
    module imported it) and ``torch.bincount`` run once in all, training and under no_grad (the
    dropless no-grad path), with and without losses."""
    import sys

    from moeflow.kernels import counts as counts_module

    layer = make_layer(gen, dim=D, hidden=H, num_experts=6, top_k=2, capacity_factor=cf, eval_mode=False,
                       router=RouterConfig(load_balance_coef=0.01, load_coef=0.01, bias_update_rate=1e-3))
    calls: list[str] = []
    real_count_ids, real_bincount = counts_module.count_ids, torch.bincount

    def counted(ids, num_experts):  # type: ignore[no-untyped-def]
        calls.append("count_ids")
        return real_count_ids(ids, num_experts)

    for module in list(sys.modules.values()):
        if getattr(module, "count_ids", None) is real_count_ids and module.__name__.startswith("moeflow"):
            monkeypatch.setattr(module, "count_ids", counted)
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: calls.append("bincount") or real_bincount(*a, **k))
    x = rand(gen, 30, D)
    with torch.set_grad_enabled(grad):
        y = layer(x, losses=losses)
    assert calls == ["count_ids"], calls
    assert set(layer.aux_losses) == ({"load_balance", "load"} if losses else set())
    assert torch.equal(layer.router.load_counts, layer.last_counts_E)  # the bias counters got the count
    ids_TK = layer.eval().router(x, top_k=2, losses=False).ids_TK  # (eval: no count added)
    assert torch.equal(layer.last_counts_E, real_bincount(ids_TK.reshape(-1), minlength=6))
    assert y.shape == x.shape


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


# ----------------------------------------------------------------------------- found in review


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


def test_deepcopy_after_forward():
    import copy

    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2)
    layer(torch.randn(5, 8))
    clone = copy.deepcopy(layer)
    assert clone.aux_losses is None and layer.aux_losses is not None
    assert clone.last_counts_E is None and layer.last_counts_E is not None
    x = torch.randn(3, 8)
    assert torch.equal(clone(x), layer(x))
    # a copy made while recording is not attached to the tape, and starts an empty load window
    windowed = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, load_window=3)
    windowed(torch.randn(5, 8))
    with moeflow.record_routing(windowed) as tape:
        windowed(x)
        clone = copy.deepcopy(windowed)
    assert clone._routing_tape is None and windowed._routing_tape is None and len(tape.calls[""]) == 1
    assert len(clone._load_window) == 0 and clone._load_window.maxlen == 3 and len(windowed._load_window) == 2
    clone(x)
    assert len(tape.calls[""]) == 1


@pytest.mark.parametrize("cf", [0.0, 1.0, -0.5])
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize("policy", ["position", "score", "bpr"])
def test_every_tensor_the_layer_makes_names_its_device(gen, cf, weight_at, policy):
    """On a GPU a tensor built without a device lands on the CPU and fails there (or in an NCCL
    collective). Here the default device is ``meta`` while the inputs and weights are on the
    CPU: any constructor in the forward, the balance losses or the no-grad path that does not
    name its device makes a meta tensor, and mixing it with the CPU tensors fails. (Not inside a
    custom autograd Function's ``backward``: autograd runs it without Python's function modes,
    so the default device does not reach there; ``tests/test_gpu.py`` runs those on CUDA.)"""
    layer = make_layer(gen, capacity_factor=cf, dispatch=DispatchConfig(weight_at=weight_at, drop_policy=policy),
                       router=RouterConfig(load_balance_coef=0.01, importance_coef=0.1, z_loss_coef=1e-3),
                       eval_mode=False)
    x = rand(gen, 7, layer.config.dim).requires_grad_(True)
    with torch.device("meta"):
        y = layer(x)
        (y.sum() + moeflow.aux_loss(layer)).backward()
        with torch.no_grad():
            y_ng = layer.eval()(x)
    assert y.device.type == y_ng.device.type == x.grad.device.type == "cpu"
    assert all(p.grad is not None and p.grad.device.type == "cpu" for p in layer.parameters())


def test_one_expert_of_capacity_one_keeps_the_first_token_and_drops_the_rest(gen):
    """The smallest capacity layout, one row in all: the kept token goes through the expert,
    the dropped ones get zero output and gradient (their entries of the row map must not point
    past the one row), against the loop reference with gradients."""
    layer = make_layer(gen, num_experts=1, top_k=1, capacity_factor=1 / 3, eval_mode=False,
                       router=RouterConfig(load_balance_coef=0.0))
    x = rand(gen, 3, layer.config.dim)
    compare_layer_with(layer, lambda x: loop_moe(layer, x), x, gen)
    with torch.no_grad():
        y = layer(x)
    assert (y[0] != 0).any() and torch.equal(y[1:], torch.zeros_like(y[1:]))


def test_layout_accessors_and_repr_of_a_single_process_layer() -> None:
    """Without expert parallelism a layer holds every whole expert: range (0, E), every slot
    its own expert and saved, one hidden shard; a dispatcher whose slots are not a contiguous
    block has no range. The reprs name the layer's and the router's settings, and the load
    window reads zeros before any training call."""
    from moeflow.dispatch import LocalDispatcher
    from moeflow.types import ExpertLayout

    layer = moeflow.MoE(dim=8, hidden=16, num_experts=4, top_k=2, capacity_factor=1.25, load_window=2)
    assert layer.expert_range() == (0, 4)
    assert layer.expert_slots() == ([0, 1, 2, 3], [True, True, True, True])
    assert layer.hidden_shards() == (1, [0, 0, 0, 0])
    r = repr(layer)
    assert "dim=8, hidden=16, num_experts=4, top_k=2, capacity_factor=1.25" in r
    assert "kind=linear, scoring=softmax, num_experts=4, groups=" in r
    stats = layer.load_stats()
    assert stats.dtype == torch.long and torch.equal(stats, torch.zeros(4, dtype=torch.long))

    moved = LocalDispatcher(num_experts=4)
    moved.layout = ExpertLayout(num_experts=4, slot_experts=(2, 0, 1, 3), slot_primary=(True,) * 4)
    layer = moeflow.MoE(dim=8, hidden=16, num_experts=4, dispatcher=moved)
    with pytest.raises(ValueError, match="non-contiguous placement"):
        layer.expert_range()
    assert layer.expert_slots() == ([2, 0, 1, 3], [True] * 4)


def test_an_empty_batch_reports_the_same_losses_as_a_full_one(gen) -> None:
    """A call with no tokens (possible on one rank) reports a zero under the name of every loss
    a full call reports, and ``aux_loss()`` of a layer without losses is a zero in the router's
    precision (at least fp32: fp64 for an fp64 layer)."""
    router = RouterConfig(load_balance_coef=0.01, importance_coef=0.02, load_coef=0.03, z_loss_coef=0.04)
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, router=router).double()
    layer(torch.randn(5, 8, generator=gen, dtype=torch.float64))
    full = set(layer.aux_losses)
    assert full == {"load_balance", "importance", "load", "z_loss"}
    layer(torch.zeros(0, 8, dtype=torch.float64))
    assert set(layer.aux_losses) == full and all(float(v.detach()) == 0.0 for v in layer.aux_losses.values())
    layer(torch.randn(5, 8, generator=gen, dtype=torch.float64), losses=False)
    assert layer.aux_loss().dtype == torch.float64 and float(layer.aux_loss().detach()) == 0.0
    # only the losses with a coefficient, and the empty call's counts: int64 zeros on x's device
    some = moeflow.MoE(dim=8, hidden=8, num_experts=4, top_k=2, router=RouterConfig(load_balance_coef=0.0, z_loss_coef=0.1))
    some(torch.randn(5, 8, generator=gen))
    assert set(some.aux_losses) == {"z_loss"}
    with torch.device("meta"):  # the default device: a tensor that does not name x's lands there
        some(torch.zeros(0, 8, device="cpu"))
    assert set(some.aux_losses) == {"z_loss"}
    counts = some.last_counts_E
    assert counts.device.type == "cpu" and counts.dtype == torch.long and counts.tolist() == [0, 0, 0, 0]


class _Scale(nn.Module):
    """A parameter-free expert: ``x * factor``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def test_experts_without_parameters(gen) -> None:
    """Experts that hold no parameters (fixed functions) run: there is no parameter to compare
    the input's device and dtype with, and the output is the routed sum of the functions."""
    from moeflow.experts import ModuleExperts

    layer = moeflow.MoE(dim=8, hidden=8, num_experts=3, top_k=2, capacity_factor=0.0,
                        experts_module=ModuleExperts([_Scale(1.0), _Scale(2.0), _Scale(-3.0)])).double()
    x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    y = layer(x)
    routing = layer.router(x, top_k=2)
    factor_TK = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)[routing.ids_TK]
    torch.testing.assert_close(y, x * (routing.weights_TK * factor_TK).sum(1, keepdim=True), rtol=1e-12, atol=1e-12)


class _RowsOnly(nn.Module):
    """Experts that cannot run on zero rows (as some custom kernels): ``x * w[e]``."""

    def __init__(self, num_experts: int, dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w = nn.Parameter(torch.ones(num_experts, dim))

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        if expert_in.numel() == 0:
            raise RuntimeError("called with no rows")
        return expert_in * self.w.repeat_interleave(counts_E, dim=0, output_size=expert_in.shape[0])


def test_an_empty_batch_does_not_call_the_experts(gen) -> None:
    """A call with no tokens in a single process never reaches the experts module (custom
    experts need not handle zero rows): the output is empty and every parameter still gets a
    (zero) gradient."""
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=3, top_k=2, capacity_factor=0.0, experts_module=_RowsOnly(3, 8))
    x = torch.randn(4, 8, generator=gen)
    assert layer(x).shape == (4, 8)
    y = layer(torch.zeros(2, 0, 8))
    assert y.shape == (2, 0, 8)
    y.sum().backward()
    assert layer.experts.w.grad is not None and not layer.experts.w.grad.any()
