"""The inference shortcuts of a decode step, each against the path it replaces on fresh random
inputs: the router's and the layer's per-call ``losses=False`` (same routing, no losses; a
per-call switch, not grad mode), and the built-in experts' direct grouped GEMMs where autograd
records nothing (``lean_ffn_no_grad``, taken inside ``grouped_ffn``: bit-equal to the lean path,
equal to the loop reference, and not taken where it would skip something: biases, other
backends, a graph to record, recompute, autocast; hooks still run), and the decode step's attention with the query heads of a KV head folded into its
query rows (left-padded rows against each row alone)."""

from __future__ import annotations

import pytest
import torch

import moeflow
from moeflow import RouterConfig
import moeflow.experts.ffn as ffn
from moeflow.testing import loop_moe

from helpers import make_layer, rand, small_gpt

LOSSY = RouterConfig(load_balance_coef=0.1, importance_coef=0.2, load_coef=0.3, z_loss_coef=0.01)


@pytest.mark.reference
@pytest.mark.parametrize("training", [True, False])
def test_router_losses_false_routes_the_same_without_losses(gen, training) -> None:
    layer = make_layer(gen, dim=12, num_experts=6, top_k=2, router=LOSSY, eval_mode=not training)
    x_TD = rand(gen, 9, 12)
    with_losses = layer.router(x_TD, top_k=2)
    without = layer.router(x_TD, top_k=2, losses=False)
    for name in ("weights_TK", "ids_TK", "logits_TE", "scores_TE"):
        assert torch.equal(getattr(with_losses, name), getattr(without, name)), name
    assert set(with_losses.aux_losses) == {"load_balance", "importance", "load", "z_loss"}
    assert without.aux_losses == {}
    with torch.no_grad():  # the switch is per call: an evaluation under no_grad keeps its losses
        assert set(layer.router(x_TD, top_k=2).aux_losses) == set(with_losses.aux_losses)
    with pytest.raises(TypeError, match="losses must be a bool, got int 0"):
        layer.router(x_TD, top_k=2, losses=0)


@pytest.mark.reference
def test_router_losses_false_still_counts_load_for_bias_balancing(gen) -> None:
    layer = make_layer(gen, dim=12, num_experts=6, top_k=2, eval_mode=False,
                       router=RouterConfig(load_balance_coef=0.0, bias_update_rate=0.01))
    x_TD = rand(gen, 7, 12)
    routing = layer.router(x_TD, top_k=2, losses=False)
    assert torch.equal(layer.router.load_counts, routing.counts_E) and int(routing.counts_E.sum()) == 14


@pytest.mark.reference
def test_moe_losses_false_gives_the_same_output_and_empty_losses(gen) -> None:
    layer = make_layer(gen, dim=12, hidden=16, num_experts=6, top_k=2, router=LOSSY, num_shared_experts=1)
    x = rand(gen, 2, 5, 12)
    y = layer(x)
    assert set(layer.aux_losses) == {"load_balance", "importance", "load", "z_loss"} and float(layer.aux_loss().detach()) > 0
    assert torch.equal(layer(x, losses=False), y)
    assert layer.aux_losses == {} and float(layer.aux_loss()) == 0.0
    assert torch.equal(layer.last_counts_E, torch.bincount(layer.router(x.reshape(-1, 12), top_k=2).ids_TK.flatten(),
                                                           minlength=6))
    assert layer(x[:, :0], losses=False).shape == (2, 0, 12) and layer.aux_losses == {}
    with pytest.raises(TypeError, match="losses must be a bool, got str 'no'"):
        layer(x, losses="no")


@pytest.mark.reference
def test_cached_calls_skip_the_losses_and_the_plain_forward_keeps_them(gen) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=16, router=LOSSY).eval()
    layers = moeflow.moe_layers(model)
    seq = torch.randint(0, 61, (2, 10), generator=gen)
    with torch.no_grad():
        model(seq)
        assert all(set(m.aux_losses) == {"load_balance", "importance", "load", "z_loss"} for m in layers)
        cache = model.new_cache(torch.tensor([0, 3]), 12)  # row 1 left-padded: the FFN sees real tokens only
        model.forward_cached(seq, cache)
        assert all(m.aux_losses == {} for m in layers)
        model.forward_cached(seq[:, :1], cache)
        assert all(m.aux_losses == {} for m in layers)


def _experts_layer(gen, activation: str, dtype=torch.float32, **experts_kw) -> moeflow.MoE:
    return make_layer(gen, dim=16, hidden=12, num_experts=8, top_k=2, dtype=dtype, std=0.3, capacity_factor=0.0,
                      experts_cfg=moeflow.ExpertsConfig(activation=activation, **experts_kw))


def _direct(monkeypatch, experts, x_RD, counts_E=None, *, grad: bool = False) -> bool:
    """Whether calling ``experts`` on ``x_RD`` (under ``no_grad`` unless ``grad``) takes
    ``lean_ffn_no_grad`` (a spy counts its calls)."""
    calls: list[int] = []
    real = ffn.lean_ffn_no_grad
    monkeypatch.setattr(ffn, "lean_ffn_no_grad", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts_E = torch.full((experts.num_experts,), 0) if counts_E is None else counts_E
    if counts_E.sum() != x_RD.shape[0]:
        counts_E[0] = x_RD.shape[0]
    with torch.set_grad_enabled(grad):
        experts(x_RD, counts_E)
    monkeypatch.setattr(ffn, "lean_ffn_no_grad", real)
    return bool(calls)


@pytest.mark.reference
@pytest.mark.parametrize("activation", ["swiglu", "geglu", "relu", "gelu", "silu"])
@pytest.mark.parametrize("T", [1, 3, 8, 64])
def test_no_grad_grouped_ffn_equals_the_experts_module_and_the_loop(gen, activation, T, monkeypatch) -> None:
    layer = _experts_layer(gen, activation)
    x_TD = rand(gen, T, 16, dtype=torch.float32)
    with torch.no_grad():
        routing = layer.router(x_TD, top_k=2)
        ids_A = routing.ids_TK.flatten()
        rows_AD = x_TD[ids_A.sort(stable=True).indices // 2]  # rows grouped by expert, some experts empty
    assert _direct(monkeypatch, layer.experts, rows_AD, routing.counts_E)
    # the same two grouped products as the module's lean path (autograd on): equal to the bit
    with torch.no_grad():
        direct = layer.experts(rows_AD, routing.counts_E)
    assert torch.equal(direct, layer.experts(rows_AD, routing.counts_E).detach())
    with torch.no_grad():
        # and the whole layer (which takes this path without autograd) against the loop reference
        y_TD = layer(x_TD)
        ref_TD = loop_moe(layer, x_TD, routing=(routing.weights_TK, routing.ids_TK))
    torch.testing.assert_close(y_TD, ref_TD, rtol=1e-5, atol=1e-5)
    with torch.enable_grad():  # with autograd the layer takes dispatch -> experts -> combine
        torch.testing.assert_close(layer(x_TD).detach(), y_TD, rtol=1e-5, atol=1e-5)


@pytest.mark.reference
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize(("T", "K"), [(1, 2), (7, 1), (33, 3)])
def test_no_grad_dropless_layer_equals_the_loop_reference(gen, weight_at, activation, T, K, monkeypatch) -> None:
    """Generation, ``moeflow infer`` and the transformers drop-in under ``no_grad`` run the
    dispatcher's no-grad dropless path; in fp64 it gives the loop reference's output for either
    place of the router weights (at ``"dispatch"`` the expert input is scaled before a
    nonlinear FFN, so a path that forgets the weights there, or applies them twice, is off by
    far more than rounding), and the path is the one taken."""
    layer = make_layer(gen, dim=12, hidden=10, num_experts=5, top_k=K, capacity_factor=0.0,
                       dispatch=moeflow.DispatchConfig(weight_at=weight_at),
                       experts_cfg=moeflow.ExpertsConfig(activation=activation))
    x_TD = rand(gen, T, 12)
    taken = []
    real = type(layer.dispatcher).run_dropless_no_grad
    monkeypatch.setattr(type(layer.dispatcher), "run_dropless_no_grad",
                        lambda self, *a, **k: (taken.append(1), real(self, *a, **k))[1])
    with torch.no_grad():
        routing = layer.router(x_TD, top_k=K)
        y_TD = layer(x_TD)
        ref_TD = loop_moe(layer, x_TD, routing=(routing.weights_TK, routing.ids_TK))
    assert taken, "the no-grad dropless path was not taken"
    torch.testing.assert_close(y_TD, ref_TD, rtol=1e-12, atol=1e-12)


@pytest.mark.reference
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
def test_no_grad_dropless_layer_in_bf16_matches_the_autograd_path(gen, weight_at) -> None:
    """A bf16 layer routes in fp32 (the router's default): the no-grad dropless path casts the
    router weights to the rows' dtype, so its output is bf16 and equals, to bf16 rounding, what
    the autograd path gives."""
    layer = make_layer(gen, dim=16, hidden=16, num_experts=4, top_k=2, capacity_factor=0.0, dtype=torch.bfloat16,
                       dispatch=moeflow.DispatchConfig(weight_at=weight_at))
    x_TD = rand(gen, 9, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        y_TD = layer(x_TD)
    ref_TD = layer(x_TD.clone().requires_grad_(True)).detach()
    assert y_TD.dtype == torch.bfloat16
    torch.testing.assert_close(y_TD, ref_TD, rtol=2e-2, atol=2e-2)


@pytest.mark.reference
def test_no_grad_dropless_layer_on_no_tokens_gives_no_rows(gen) -> None:
    """An empty batch under ``no_grad`` (a decode step of a finished batch, an empty shard) gives
    ``[0, D]``; the no-grad dropless path is not taken for it."""
    layer = make_layer(gen, dim=8, hidden=8, num_experts=4, top_k=2, capacity_factor=0.0)
    with torch.no_grad():
        y = layer(rand(gen, 0, 8))
        # the dispatcher itself too (``forward_routed`` callers reach it with their own routing)
        x = rand(gen, 0, 8)
        y_direct = layer.dispatcher.run(x, layer.router(x, top_k=2), layer.experts, capacity_factor=0.0)
    assert y.shape == (0, 8) and y.dtype == torch.float64
    assert y_direct.shape == (0, 8)


@pytest.mark.reference
def test_no_grad_grouped_ffn_is_not_taken_where_it_would_skip_something(gen, monkeypatch) -> None:
    x_RD = rand(gen, 6, 16, dtype=torch.float32)
    assert _direct(monkeypatch, _experts_layer(gen, "swiglu").experts, x_RD)
    assert not _direct(monkeypatch, _experts_layer(gen, "swiglu", bias=True).experts, x_RD)
    assert not _direct(monkeypatch, _experts_layer(gen, "swiglu", backend="loop").experts, x_RD)
    assert not _direct(monkeypatch, _experts_layer(gen, "swiglu", dtype=torch.float64).experts, x_RD.double())
    assert not _direct(monkeypatch, _experts_layer(gen, "swiglu", recompute=True).experts, x_RD)
    assert not _direct(monkeypatch, _experts_layer(gen, "swiglu").experts, x_RD, grad=True)  # a graph to record
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not _direct(monkeypatch, _experts_layer(gen, "swiglu").experts, x_RD)

    # a forward hook on the experts still runs in a no-grad decode-shaped call (the module is called)
    layer = _experts_layer(gen, "swiglu")
    seen: list[int] = []
    handle = layer.experts.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    assert _direct(monkeypatch, layer.experts, x_RD)
    with torch.no_grad():
        layer(rand(gen, 3, 16, dtype=torch.float32))
    assert seen == [6, 6]
    handle.remove()


@pytest.mark.reference
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_decode_attention_with_left_padding_equals_each_row_alone(gen, n_kv_heads) -> None:
    """A decode step folds the query heads of a KV head into its query rows (GQA) under the
    left-padding mask; its logits equal each row's own full forward (MHA: the plain path)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=16, n_kv_heads=n_kv_heads).double().eval()
    rows = [torch.randint(0, 61, (n,), generator=gen) for n in (7, 3, 5)]
    pad_B = torch.tensor([7 - len(r) for r in rows])
    new_BS = torch.randint(0, 61, (3, 6), generator=gen)
    with torch.no_grad():
        cache = model.new_cache(pad_B, 13)
        model.forward_cached(torch.stack([torch.cat([r.new_zeros(7 - len(r)), r]) for r in rows]), cache)
        steps_BSV = torch.stack([model.forward_cached(new_BS[:, j:j + 1], cache) for j in range(6)], 1)
        for b, r in enumerate(rows):
            alone_SV = model(torch.cat([r, new_BS[b]]).unsqueeze(0))[0, len(r):]
            torch.testing.assert_close(steps_BSV[b], alone_SV, rtol=1e-12, atol=1e-12)
