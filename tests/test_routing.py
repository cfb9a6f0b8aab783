"""The router against the token-by-token reference, router dtypes, exploration, the
balance losses against hand formulas, and aux-loss-free balancing."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moeflow
from moeflow import RouterConfig
from moeflow.routing import (
    importance_loss,
    load_balance_loss,
    load_loss,
    router_z_loss,
    select_experts,
    smooth_load_E,
)
from moeflow.routing.losses import cv_squared
from moeflow.testing import reference_routing

from helpers import make_layer, rand

pytestmark = pytest.mark.reference

T, D, E = 40, 8, 8

ROUTERS = {
    "softmax": dict(scoring="softmax"),
    "softmax-norm": dict(scoring="softmax", normalize_topk=True),
    "topk_softmax": dict(scoring="topk_softmax"),
    "sigmoid-norm-2.5": dict(scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5),
    "sigmoid-plain": dict(scoring="sigmoid"),
    "softmax-groups-max": dict(scoring="softmax", num_groups=4, topk_groups=2, group_score="max"),
    "sigmoid-groups-top2": dict(
        scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5, num_groups=4, topk_groups=2, group_score="top2_sum"
    ),
    "softmax-bias": dict(scoring="softmax", bias=True),
}


def _router_cfg(kind: str, name: str, **extra) -> RouterConfig:
    return RouterConfig(kind=kind, cosine_proj_dim=8, **ROUTERS[name], **extra)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_router_matches_reference(gen, kind, name, k):
    layer = make_layer(gen, dim=D, num_experts=E, top_k=k, router=_router_cfg(kind, name))
    x = rand(gen, T, D)
    r = layer.router(x, top_k=k)
    w_ref, ids_ref = reference_routing(layer, x, k)
    assert r.ids_TK.dtype == torch.int64 and r.ids_TK.shape == (T, k)
    assert torch.equal(r.ids_TK, ids_ref)  # same order too: both sort by selection score
    assert r.weights_TK.dtype == torch.float64
    torch.testing.assert_close(r.weights_TK, w_ref, rtol=1e-12, atol=1e-12)
    # each token's ids are distinct
    assert all(len(set(row)) == k for row in r.ids_TK.tolist())
    # and the routing is not degenerate: several experts are used
    assert len(set(r.ids_TK.reshape(-1).tolist())) >= min(E, 3)


def _allowed_groups(sel_TE: torch.Tensor, num_groups: int, topk_groups: int, group_score: str) -> list[set[int]]:
    out = []
    for row in sel_TE.tolist():
        per = len(row) // num_groups
        groups = [sorted(row[g * per : (g + 1) * per], reverse=True) for g in range(num_groups)]
        value = [g[0] if group_score == "max" else g[0] + g[1] for g in groups]
        out.append(set(sorted(range(num_groups), key=lambda g: -value[g])[:topk_groups]))
    return out


@pytest.mark.parametrize("group_score", ["max", "top2_sum"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_group_limited_never_leaves_selected_groups(gen, scoring, group_score):
    G, TG = 4, 2
    k = 3
    cfg = RouterConfig(scoring=scoring, num_groups=G, topk_groups=TG, group_score=group_score)
    layer = make_layer(gen, dim=D, num_experts=E, top_k=k, router=cfg, std=1.0)
    x = rand(gen, 64, D)
    r = layer.router(x, top_k=k)
    allowed = _allowed_groups(r.scores_TE, G, TG, group_score)
    per = E // G
    for t, row in enumerate(r.ids_TK.tolist()):
        assert {e // per for e in row} <= allowed[t], f"token {t}: {row} outside groups {allowed[t]}"
        # the k picks are the best k scores among the allowed experts
        eligible = [e for e in range(E) if e // per in allowed[t]]
        best = sorted(eligible, key=lambda e: -r.scores_TE[t, e].item())[:k]
        assert row == best
    # group limiting matters for these inputs: plain top-k would leave the groups for some token
    plain = r.scores_TE.topk(k, dim=-1).indices
    assert not torch.equal(plain, r.ids_TK)


@pytest.mark.parametrize("name", ["softmax", "softmax-norm", "topk_softmax", "sigmoid-norm-2.5", "sigmoid-groups-top2"])
def test_expert_bias_changes_selection_not_weights(gen, name):
    k = 2
    cfg = _router_cfg("linear", name, bias_update_rate=0.01)
    layer = make_layer(gen, dim=D, num_experts=E, top_k=k, router=cfg)
    x = rand(gen, T, D)
    scale = 3.0 if name == "topk_softmax" else 0.5  # topk_softmax selects on raw logits
    layer.router.expert_bias.copy_(rand(gen, E, dtype=torch.float32, std=scale))
    r = layer.router(x, top_k=k)
    w_ref, ids_ref = reference_routing(layer, x, k)
    assert torch.equal(r.ids_TK, ids_ref)
    torch.testing.assert_close(r.weights_TK, w_ref, rtol=1e-12, atol=1e-12)

    # weights = unbiased scores of the chosen experts (then normalised / scaled as configured)
    logits = layer.router.logits(x)
    rc = layer.router.config
    scores = {"softmax": torch.softmax(logits, -1), "sigmoid": torch.sigmoid(logits), "topk_softmax": logits}[rc.scoring]
    picked = scores.gather(1, r.ids_TK)
    if rc.scoring == "topk_softmax":
        picked = torch.softmax(picked, -1)
    elif rc.normalize_topk:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(r.weights_TK, picked * rc.routed_scaling_factor, rtol=1e-12, atol=1e-12)

    # the bias did change the selection of some tokens ...
    unbiased = make_layer(gen, dim=D, num_experts=E, top_k=k, router=_router_cfg("linear", name))
    unbiased.load_state_dict(layer.state_dict())
    r0 = unbiased.router(x, top_k=k)
    assert not torch.equal(r0.ids_TK, r.ids_TK)
    # ... and a bias buffer is ignored when aux-loss-free balancing is off
    assert unbiased.router.expert_bias.abs().max() > 0  # copied over by load_state_dict
    _, ids_plain = reference_routing(unbiased, x, k)
    assert torch.equal(r0.ids_TK, ids_plain)


# ----------------------------------------------------------------------------- router dtype


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_layer_routes_in_fp32(gen, low):
    layer = make_layer(gen, dim=D, num_experts=4, hidden=8, dtype=low)
    x = rand(gen, 16, D, dtype=low)
    r = layer.router(x, top_k=2)
    assert r.logits_TE.dtype == torch.float32
    assert r.weights_TK.dtype == torch.float32 and r.scores_TE.dtype == torch.float32
    expected = F.linear(x.float(), layer.router.linear.weight.float())
    torch.testing.assert_close(r.logits_TE, expected, rtol=1e-6, atol=1e-6)
    assert layer(x).dtype == low


def test_router_dtype_fp64_and_explicit(gen):
    layer = make_layer(gen, dim=D, num_experts=4, dtype=torch.float64)
    r = layer.router(rand(gen, 8, D), top_k=2)
    assert r.logits_TE.dtype == torch.float64 and r.weights_TK.dtype == torch.float64

    layer = make_layer(gen, dim=D, num_experts=4, dtype=torch.float32, router=RouterConfig(dtype=torch.float64))
    x = rand(gen, 8, D, dtype=torch.float32)
    r = layer.router(x, top_k=2)
    assert r.logits_TE.dtype == torch.float64 and r.weights_TK.dtype == torch.float64
    torch.testing.assert_close(r.logits_TE, x.double() @ layer.router.linear.weight.double().t(), rtol=1e-13, atol=1e-13)
    assert layer(x).dtype == torch.float32

    layer = make_layer(gen, dim=D, num_experts=4, dtype=torch.bfloat16, router=RouterConfig(dtype=torch.bfloat16))
    assert layer.router(rand(gen, 8, D, dtype=torch.bfloat16), top_k=2).logits_TE.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_router_bias_is_cast_to_the_router_dtype(gen, kind):
    """With ``bias=True`` in a bf16 layer the router computes in fp32 (the default router dtype):
    weight and bias are both cast, and the logits are the fp32 computation from the bf16 values."""
    cfg = RouterConfig(kind=kind, cosine_proj_dim=8, bias=True)
    layer = make_layer(gen, dim=D, num_experts=4, dtype=torch.bfloat16, router=cfg)
    x = rand(gen, 8, D, dtype=torch.bfloat16)
    logits = layer.router.logits(x)
    assert logits.dtype == torch.float32
    lin = layer.router.linear if kind == "linear" else layer.router.proj
    assert lin.bias is not None and lin.bias.dtype == torch.bfloat16 and lin.bias.abs().max() > 0
    z = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    if kind == "cosine":
        m = F.normalize(layer.router.expert_embed.float(), dim=-1)
        scale = torch.clamp(layer.router.log_scale.float(), max=math.log(1 / cfg.cosine_min_temperature)).exp()
        z = (F.normalize(z, dim=-1) @ m.t()) * scale
    torch.testing.assert_close(logits, z, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- cosine router


def test_cosine_temperature_clamp(gen):
    cfg = RouterConfig(kind="cosine", cosine_proj_dim=8, cosine_init_temperature=0.5, cosine_min_temperature=0.05)
    layer = make_layer(gen, dim=D, num_experts=E, router=cfg)
    x = rand(gen, T, D)
    router = layer.router
    fresh = moeflow.MoE(dim=D, hidden=8, num_experts=E, router=cfg, dtype=torch.float64).router
    assert fresh.log_scale.item() == pytest.approx(math.log(1 / 0.5))  # initialised to 1 / init_temperature

    with torch.no_grad():
        router.log_scale.fill_(0.0)
    cos = router.logits(x)
    assert cos.abs().max() <= 1 + 1e-12
    with torch.no_grad():
        router.log_scale.fill_(math.log(3.0))
    torch.testing.assert_close(router.logits(x), 3 * cos, rtol=1e-12, atol=1e-12)

    with torch.no_grad():
        router.log_scale.fill_(50.0)  # temperature e^-50, far below the minimum
    clamped = router.logits(x)
    assert clamped.abs().max() <= 1 / 0.05 * (1 + 1e-12)
    torch.testing.assert_close(clamped, cos / 0.05, rtol=1e-12, atol=1e-12)
    # no gradient flows into a clamped scale
    (g,) = torch.autograd.grad(router.logits(x).sum(), [router.log_scale])
    assert g.item() == 0.0


# ----------------------------------------------------------------------------- exploration


@pytest.mark.parametrize(
    "explore", [dict(noise_std=1.0), dict(jitter_eps=0.2), dict(input_dropout=0.3)], ids=["noise", "jitter", "dropout"]
)
def test_exploration_only_in_training(gen, explore):
    layer = make_layer(gen, dim=D, num_experts=E, router=RouterConfig(**explore))
    x = rand(gen, T, D)
    clean = layer.router.logits(x)
    a, b = layer.router(x, top_k=2), layer.router(x, top_k=2)
    assert torch.equal(a.logits_TE, clean) and torch.equal(b.logits_TE, clean)
    assert torch.equal(a.ids_TK, b.ids_TK)
    layer.train()
    a, b = layer.router(x, top_k=2), layer.router(x, top_k=2)
    assert not torch.equal(a.logits_TE, b.logits_TE)
    assert not torch.equal(a.logits_TE, clean)
    ya, yb = layer(x), layer(x)
    assert not torch.equal(ya, yb)


def test_noise_has_configured_std(gen):
    layer = make_layer(gen, dim=D, num_experts=E, router=RouterConfig(noise_std=0.7), eval_mode=False)
    x = rand(gen, 256, D)
    noise = layer.router(x, top_k=2).logits_TE - layer.router.logits(x)
    # 2048 samples: the standard error of the std estimate is ~1.6%
    assert 0.6 < noise.std().item() < 0.8
    assert abs(noise.mean().item()) < 0.1


def test_jitter_is_multiplicative_and_bounded(gen):
    eps = 0.1
    layer = make_layer(gen, dim=1, num_experts=4, router=RouterConfig(jitter_eps=eps), eval_mode=False)
    x = rand(gen, 64, 1)
    # with D = 1 the logit of expert e is w_e * x * u, u ~ U(1-eps, 1+eps)
    ratio = layer.router(x, top_k=1).logits_TE / layer.router.logits(x)
    assert ((ratio >= 1 - eps - 1e-12) & (ratio <= 1 + eps + 1e-12)).all()
    assert torch.allclose(ratio, ratio[:, :1].expand_as(ratio), rtol=1e-12)  # one factor per token
    assert ratio.std() > 0


# ----------------------------------------------------------------------------- losses by hand


def test_load_balance_perfectly_uniform_is_one():
    for E_, K_ in [(4, 1), (4, 2), (8, 3)]:
        T_ = 2 * E_
        probs = torch.full((T_, E_), 1.0 / E_, dtype=torch.float64)
        ids = torch.stack([(torch.arange(K_) + t) % E_ for t in range(T_)])  # every expert T_*K_/E_ times
        assert torch.bincount(ids.reshape(-1), minlength=E_).unique().numel() == 1
        assert load_balance_loss(probs, ids).item() == pytest.approx(1.0, abs=1e-14)


def test_load_balance_hand_formula(gen):
    T_, E_, K_ = 7, 5, 2
    probs = torch.softmax(rand(gen, T_, E_), -1)
    ids = probs.topk(K_, -1).indices
    f = [sum(row.count(e) for row in ids.tolist()) / (T_ * K_) for e in range(E_)]
    P = [sum(probs[t, e].item() for t in range(T_)) / T_ for e in range(E_)]
    expected = E_ * sum(fe * pe for fe, pe in zip(f, P))
    assert load_balance_loss(probs, ids).item() == pytest.approx(expected, rel=1e-13)
    # fully collapsed routing: loss = E
    one_hot = F.one_hot(torch.zeros(T_, dtype=torch.long), E_).double()
    assert load_balance_loss(one_hot, torch.zeros(T_, 1, dtype=torch.long)).item() == pytest.approx(E_)
    # counts given (the layer passes the routing's): they are used as given, not recounted
    counts = torch.tensor([5, 0, 3, 4, 2])
    given = E_ * sum(c / (T_ * K_) * pe for c, pe in zip(counts.tolist(), P))
    assert load_balance_loss(probs, ids, counts).item() == pytest.approx(given, rel=1e-13)


def test_z_loss_hand_formula(gen):
    logits = rand(gen, 6, 5, std=3.0)
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 6
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-13)


def test_importance_and_load_cv_squared(gen):
    T_, E_, K_ = 9, 4, 2
    w = rand(gen, T_, K_).abs() + 0.1
    ids = torch.stack([torch.randperm(E_, generator=gen)[:K_] for _ in range(T_)])
    imp = [0.0] * E_
    for t in range(T_):
        for k in range(K_):
            imp[ids[t, k]] += w[t, k].item()
    expected = statistics.pvariance(imp) / statistics.mean(imp) ** 2
    assert importance_loss(w, ids, E_).item() == pytest.approx(expected, rel=1e-9)
    load = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=torch.float64)
    assert load_loss(load).item() == pytest.approx(statistics.pvariance([3, 1, 4, 2]) / 2.5**2, rel=1e-9)
    assert cv_squared(torch.full((5,), 2.0)).item() == 0.0
    assert cv_squared(torch.tensor([3.0])).item() == 0.0
    # two experts are enough for a spread; a zero mean with a spread is not "balanced" (> 0)
    assert cv_squared(torch.tensor([1.0, 3.0], dtype=torch.float64)).item() == pytest.approx(0.25, rel=1e-9)
    assert cv_squared(torch.tensor([1.0, -1.0], dtype=torch.float64)).item() > 1e9
    # half precision is summed in fp32 (the loss of a bf16 model keeps fp32 resolution)
    half = torch.tensor([3.0, 1.0, 4.0, 2.0], dtype=torch.bfloat16)
    assert cv_squared(half).dtype == torch.float32
    assert cv_squared(half).item() == pytest.approx(statistics.pvariance([3, 1, 4, 2]) / 2.5**2, rel=1e-6)


def test_smooth_load_hand_formula(gen):
    T_, E_, k, sigma = 6, 5, 2, 0.8
    clean = rand(gen, T_, E_).requires_grad_(True)
    noisy = clean.detach() + sigma * rand(gen, T_, E_)
    load = smooth_load_E(clean, noisy, sigma, k)
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731

    def expected(k_: int) -> torch.Tensor:
        """Per expert: P(its noisy logit beats the k-th best of the others), summed over tokens."""
        out = [0.0] * E_
        for t in range(T_):
            for e in range(E_):
                others = sorted((noisy[t, j].item() for j in range(E_) if j != e), reverse=True)
                out[e] += phi((clean[t, e].item() - others[k_ - 1]) / sigma)
        return torch.tensor(out, dtype=torch.float64)

    torch.testing.assert_close(load, expected(k), rtol=1e-12, atol=1e-12)
    assert (load >= 0).all() and (load <= T_).all()
    (g,) = torch.autograd.grad(load_loss(load), [clean])
    assert torch.isfinite(g).all() and g.abs().max() > 0
    # noise -> 0: the smooth load becomes the hard top-k count
    hard = smooth_load_E(clean.detach(), clean.detach(), 1e-9, k)
    counts = torch.bincount(clean.detach().topk(k, -1).indices.reshape(-1), minlength=E_).double()
    torch.testing.assert_close(hard, counts, rtol=0, atol=1e-12)
    # k = E - 1: one expert is out per token, the threshold of the ones in is the last logit
    torch.testing.assert_close(smooth_load_E(clean, noisy, sigma, E_ - 1), expected(E_ - 1), rtol=1e-12, atol=1e-12)
    # k >= E: every expert always in
    assert torch.equal(smooth_load_E(clean, noisy, sigma, E_), torch.full((E_,), float(T_), dtype=torch.float64))


COEFS = {
    "none": dict(load_balance_coef=0.0),
    "lb": dict(load_balance_coef=0.03),
    "all": dict(load_balance_coef=0.03, importance_coef=0.2, load_coef=0.5, z_loss_coef=0.007),
    "z-imp": dict(load_balance_coef=0.0, importance_coef=0.2, z_loss_coef=0.007),
}


def test_router_losses_of_one_token_and_of_none(gen):
    """The router called alone: one token gets its losses from the loss functions like any
    batch; an empty batch (one rank's share can be empty) gets every configured loss as an exact
    zero that backward reaches (zero gradients, not None), not the NaN of a mean over nothing."""
    cfg = RouterConfig(scoring="softmax", **COEFS["all"])
    layer = make_layer(gen, dim=D, num_experts=E, top_k=2, router=cfg)
    one = layer.router(rand(gen, 1, D), top_k=2)
    expected = {
        "load_balance": cfg.load_balance_coef * load_balance_loss(torch.softmax(one.logits_TE, -1), one.ids_TK),
        "importance": cfg.importance_coef * importance_loss(one.weights_TK, one.ids_TK, E),
        "load": cfg.load_coef * load_loss(torch.bincount(one.ids_TK.reshape(-1), minlength=E).double()),
        "z_loss": cfg.z_loss_coef * router_z_loss(one.logits_TE),
    }
    assert set(one.aux_losses) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(one.aux_losses[name], value, rtol=1e-12, atol=0, msg=name)
    assert one.aux_losses["z_loss"].item() > 0
    none = layer.router(rand(gen, 0, D), top_k=2)
    assert set(none.aux_losses) == set(expected)
    assert all(v.item() == 0.0 for v in none.aux_losses.values()), none.aux_losses
    (g,) = torch.autograd.grad(sum(none.aux_losses.values()), [layer.router.linear.weight])
    assert torch.equal(g, torch.zeros_like(g))
    lb_only = make_layer(gen, dim=D, num_experts=E, top_k=2, router=RouterConfig(**COEFS["lb"]))
    assert set(lb_only.router(rand(gen, 0, D), top_k=2).aux_losses) == {"load_balance"}  # only what is configured


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "topk_softmax"])
@pytest.mark.parametrize("coefs", list(COEFS))
@pytest.mark.parametrize("noisy", [False, True], ids=["clean", "noisy"])
def test_aux_losses_present_iff_coef_positive(gen, coefs, scoring, noisy):
    k = 2
    cfg = RouterConfig(scoring=scoring, noise_std=0.5 if noisy else 0.0, **COEFS[coefs])
    layer = make_layer(gen, dim=D, num_experts=E, top_k=k, router=cfg, eval_mode=not noisy)
    x = rand(gen, T, D)
    torch.manual_seed(123)
    layer(x)
    torch.manual_seed(123)  # the router draws the same noise again
    r = layer.router(x, top_k=k)
    expected = {}
    if cfg.load_balance_coef > 0:
        probs = r.scores_TE / r.scores_TE.sum(-1, keepdim=True) if scoring == "sigmoid" else torch.softmax(r.logits_TE, -1)
        expected["load_balance"] = cfg.load_balance_coef * load_balance_loss(probs, r.ids_TK)
    if cfg.importance_coef > 0:
        expected["importance"] = cfg.importance_coef * importance_loss(r.weights_TK, r.ids_TK, E)
    if cfg.load_coef > 0:
        if noisy:
            load = smooth_load_E(layer.router.logits(x), r.logits_TE, cfg.noise_std, k)
        else:
            load = torch.bincount(r.ids_TK.reshape(-1), minlength=E).double()
        expected["load"] = cfg.load_coef * load_loss(load)
    if cfg.z_loss_coef > 0:
        expected["z_loss"] = cfg.z_loss_coef * router_z_loss(r.logits_TE)
    assert set(layer.aux_losses) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(layer.aux_losses[name], value, rtol=1e-12, atol=0, msg=name)
    total = moeflow.aux_loss(layer)
    if expected:
        torch.testing.assert_close(total, sum(expected.values()), rtol=1e-12, atol=0)
        assert total.item() > 0
        (g,) = torch.autograd.grad(total, [next(layer.router.parameters())], allow_unused=True)
        if set(expected) != {"load"} or noisy:  # the counted load has no gradient
            assert g is not None and g.abs().max() > 0
    else:
        assert total.item() == 0.0


# ----------------------------------------------------------------------------- aux-loss-free


def _bias_layer(gen, rate=0.1, **kw):
    cfg = RouterConfig(scoring="sigmoid", normalize_topk=True, bias_update_rate=rate, load_balance_coef=0.0)
    return make_layer(gen, dim=D, num_experts=E, top_k=2, router=cfg, eval_mode=False, **kw)


def test_load_counts_accumulate_over_micro_batches(gen):
    layer = _bias_layer(gen)
    xs = [rand(gen, n, D) for n in (5, 17, 11)]
    total = torch.zeros(E, dtype=torch.long)
    for x in xs:
        layer(x)
        total += layer.last_counts_E
        assert torch.equal(layer.router.load_counts, total)
    assert total.sum() == 2 * 33
    bias_before = layer.router.expert_bias.clone()
    moeflow.update_expert_bias(layer)
    step = torch.sign(total.double().mean() - total.double()).float() * 0.1
    assert torch.equal(layer.router.expert_bias, bias_before + step)
    assert (layer.router.expert_bias[total > total.double().mean()] < bias_before[total > total.double().mean()]).all()
    assert (layer.router.expert_bias[total < total.double().mean()] > bias_before[total < total.double().mean()]).all()
    assert torch.equal(layer.router.load_counts, torch.zeros(E, dtype=torch.long))

    # gradient accumulation does not change the update: one batch with all the tokens gives the same bias
    other = _bias_layer(gen)
    other.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "router.expert_bias"}, strict=False)
    with torch.no_grad():
        other.router.expert_bias.copy_(bias_before)
    other(torch.cat(xs))
    assert torch.equal(other.router.load_counts, total)
    moeflow.update_expert_bias(other)
    assert torch.equal(other.router.expert_bias, layer.router.expert_bias)


def test_bias_update_details(gen):
    layer = _bias_layer(gen, rate=0.25)
    layer.eval()
    layer(rand(gen, 16, D))
    assert layer.router.load_counts.sum() == 0  # eval mode does not count
    # explicit counts (e.g. all-reduced over ranks); equal-to-mean experts do not move
    counts = torch.tensor([4, 4, 0, 8, 4, 4, 6, 2])
    layer.router.update_bias(counts)
    assert layer.router.expert_bias.tolist() == [0.0, 0.0, 0.25, -0.25, 0.0, 0.0, -0.25, 0.25]
    # no tokens since the last update: no change
    layer.router.update_bias()
    assert layer.router.expert_bias.tolist() == [0.0, 0.0, 0.25, -0.25, 0.0, 0.0, -0.25, 0.25]
    # one token's one choice counts too: the seven experts below the mean move up
    layer.router.update_bias(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0]))
    assert layer.router.expert_bias.tolist() == [-0.25, 0.25, 0.5, 0.0, 0.25, 0.25, 0.0, 0.5]


def test_bias_update_is_arithmetic_in_the_bias_dtype(gen):
    """The bias (fp32, also in a bf16 layer) steps by ``rate * sign`` in fp32, as a sum of fp32
    tensors would: bias 1 and a rate just above 2**-24 (fp32 2**-24, half the spacing at 1)
    round back to 1, where the sum taken in fp64 and rounded once is the next fp32 value up."""
    rate = 2.0**-24 + 2.0**-50
    layer = _bias_layer(gen, rate=rate).to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32
    with torch.no_grad():
        layer.router.expert_bias.fill_(1.0)
    layer.router.update_bias(torch.tensor([0, 8, 8, 8, 8, 8, 8, 8]))  # expert 0 below the mean
    assert layer.router.expert_bias.tolist() == [1.0] + [1.0 - 2.0**-24] * (E - 1)
    assert torch.tensor(1.0, dtype=torch.float64).add(rate).float().item() > 1.0  # what fp64 would give


def test_update_bias_requires_rate(gen):
    layer = make_layer(gen, dim=D, num_experts=E, eval_mode=False)
    layer(rand(gen, 8, D))
    with pytest.raises(RuntimeError, match="bias_update_rate"):
        layer.router.update_bias()
    model = nn.Sequential(layer, _bias_layer(gen))
    model(rand(gen, 8, D))
    moeflow.update_expert_bias(model)  # skips the layer without a rate, updates the other
    assert layer.router.expert_bias.abs().sum() == 0
    assert model[1].router.expert_bias.abs().sum() > 0


def test_select_experts_group_defaults_are_one_group_by_max(gen):
    """Without ``topk_groups`` and ``group_score``, grouped routing keeps the one best group by
    its max score (``RouterConfig``'s defaults)."""
    logits = rand(gen, 64, 16)
    kw = dict(top_k=2, scoring="softmax", num_groups=4)
    default = select_experts(logits, **kw)
    explicit = select_experts(logits, **kw, topk_groups=1, group_score="max")
    for a, b in zip(default, explicit):
        assert torch.equal(a, b)
    assert (default[1] // 4 == default[1][:, :1] // 4).all()  # both experts of a token in one group of 4
    # a scaling factor of 2 doubles the weights (the mutation run tried skipping exactly that one)
    doubled = select_experts(logits, **kw, routed_scaling_factor=2.0)
    torch.testing.assert_close(doubled[0], 2 * default[0], rtol=0, atol=0)
    # the inputs tell the defaults from the alternatives
    assert not torch.equal(default[1], select_experts(logits, **kw, group_score="top2_sum")[1])
    assert not torch.equal(default[1], select_experts(logits, **kw, topk_groups=2)[1])


def test_select_experts_rejects_unknown_scoring():
    with pytest.raises(ValueError, match="scoring"):
        select_experts(torch.randn(3, 4), top_k=1, scoring="relu")


def test_balancing_buffers_keep_their_precision_in_low_precision_layers(gen):
    """Built directly in bf16, the counting/bias buffers stay int64/fp32 and count exactly."""
    cfg = RouterConfig(bias_update_rate=1e-3)
    layer = moeflow.MoE(dim=D, hidden=8, num_experts=2, top_k=2, router=cfg, dtype=torch.bfloat16).train()
    assert layer.router.load_counts.dtype == torch.int64 and layer.router.expert_bias.dtype == torch.float32
    layer(rand(gen, 301, D, dtype=torch.bfloat16))  # k = E: every expert gets all 301 tokens
    assert layer.router.load_counts.tolist() == [301, 301]
    with torch.no_grad():
        layer.router.expert_bias.fill_(0.5)
    layer.router.update_bias(torch.tensor([10.0, 0.0]))
    torch.testing.assert_close(layer.router.expert_bias, torch.tensor([0.499, 0.501]), rtol=0, atol=1e-6)


def test_load_counts_exact_after_to_bf16(gen):
    """Module.to(bfloat16) must not round the load counts (int64) ..."""
    cfg = RouterConfig(bias_update_rate=1e-3)
    layer = moeflow.MoE(dim=D, hidden=8, num_experts=2, top_k=2, router=cfg).to(torch.bfloat16).train()
    layer(rand(gen, 301, D, dtype=torch.bfloat16))
    assert layer.router.load_counts.tolist() == [301, 301]


def test_bias_update_precise_after_to_bf16():
    """... nor the selection bias, whose 1e-3 steps would vanish in bf16 (0.5 + 1e-3 == 0.5)."""
    cfg = RouterConfig(bias_update_rate=1e-3)
    layer = moeflow.MoE(dim=D, hidden=8, num_experts=2, top_k=1, router=cfg).to(torch.bfloat16)
    with torch.no_grad():
        layer.router.expert_bias.fill_(0.5)
    layer.router.update_bias(torch.tensor([10.0, 0.0]))
    assert layer.router.expert_bias.dtype == torch.float32
    assert layer.router.expert_bias.tolist() == pytest.approx([0.499, 0.501], abs=1e-6)


def test_selection_bias_keeps_its_fp32_value_through_a_cast():
    """``to(bfloat16)`` of a layer whose bias already holds fine values keeps them exactly (a
    bias rounded to bf16 and widened again would lose the 1e-3 steps)."""
    layer = moeflow.MoE(dim=D, hidden=8, num_experts=4, top_k=1, router=RouterConfig(bias_update_rate=1e-3))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([0.501, -0.499, 0.123457, 1.001]))
    before = layer.router.expert_bias.clone()
    layer.to(torch.bfloat16)
    assert layer.router.expert_bias.dtype == torch.float32 and torch.equal(layer.router.expert_bias, before)
    layer.double()
    assert layer.router.expert_bias.dtype == torch.float32 and torch.equal(layer.router.expert_bias, before)
    # the override passes ``recurse`` on: a call that is not to recurse leaves the router's linear alone
    weight = layer.router.linear.weight.data_ptr()
    layer.router.to_empty(device="cpu", recurse=False)
    assert layer.router.linear.weight.data_ptr() == weight
    # a device move takes the bias along (meta stands in for another device)
    layer.to("meta")
    assert layer.router.expert_bias.device.type == "meta" and layer.router.expert_bias.dtype == torch.float32


def _one_dim_router(**cfg):  # type: ignore[no-untyped-def]
    """A training router over D=1 with weights (1, 2) and no bias: ``logits[t] = x'[t] * (1, 2)``
    shows what the router did to its input ``x'``."""
    from moeflow.layer.router import Router

    router = Router(dim=1, num_experts=2, config=RouterConfig(bias=False, **cfg)).double().train()
    with torch.no_grad():
        router.linear.weight.copy_(torch.tensor([[1.0], [2.0]]))
    return router


def test_router_input_jitter_and_dropout_are_the_configured_ones():
    """Jitter multiplies the input by U(1 - eps, 1 + eps); input dropout zeroes a fraction p of
    the inputs and scales the rest by 1/(1 - p); with every noise setting at 0 a training call
    draws no random numbers (and the load loss stays finite)."""
    x = torch.ones(4000, 1, dtype=torch.float64)
    torch.manual_seed(0)
    u = _one_dim_router(jitter_eps=0.5)(x, top_k=1).logits_TE[:, 0]
    assert 0.5 <= u.min() < 0.52 and 1.48 < u.max() <= 1.5
    d = _one_dim_router(input_dropout=0.1)(x, top_k=1).logits_TE[:, 0]
    kept = d != 0
    assert 0.08 < 1 - kept.double().mean() < 0.12
    torch.testing.assert_close(d[kept], torch.full_like(d[kept], 1 / 0.9), rtol=1e-12, atol=0)
    quiet = _one_dim_router(jitter_eps=0.0, input_dropout=0.0, noise_std=0.0, load_coef=0.1)
    state = torch.get_rng_state()
    out = quiet(x[:16], top_k=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(out.logits_TE[:, 0], x[:16, 0]) and torch.isfinite(out.aux_losses["load"])
