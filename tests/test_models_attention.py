"""The grouped-query attention pieces of ``MoEGPT`` (``moeflow.models.attention``) and its rotary
embeddings (``moeflow.models.rope``): against transformers' own functions and modules with
copied weights (outputs and every gradient, fp64 at 1e-10 and fp32 at 1e-5), the SDPA path
against the readable softmax, and a whole model with every option on: full sequence vs cached
prefill and decode vs the static step, on a left-padded batch.

transformers' RMSNorms and eager softmax compute in fp32 whatever the input (``.to(float32)``,
``softmax(dtype=float32)``): for fp64 inputs a downcast. The fp64 comparisons run its modules
under ``KeepFp64`` (``tests/helpers.py``), which keeps those computations in fp64, so they check the formulas at
fp64's precision; its rotary tables are fp32-only too, so in fp64 both sides take ours (their
convention is checked against transformers' rotary modules in fp32).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moeflow.models.attention import Attention, attend, attention_reference, window_mask
from moeflow.models.gpt import MoEGPT
from moeflow.models.gpt_config import AttentionConfig, GPTConfig, RopeScaling
from moeflow.models.kv_cache import KVCache, static_step, step_inputs
from moeflow.models.rope import (apply_rope, apply_rope_interleaved, rope_cos_sin, rope_frequencies, softmax_scale,
                                 yarn_mscale)

from helpers import KeepFp64

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])


def _randomize(module: torch.nn.Module, gen: torch.Generator, std: float = 0.3) -> None:
    """Every parameter drawn fresh (norm weights around one, biases and sinks nonzero)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * std
            p.copy_((noise + (1.0 if "norm" in name else 0.0)).to(p.dtype))


def _hf_sin(sin_SR: torch.Tensor) -> torch.Tensor:
    """transformers' ``sin`` table (``cat(s, s)``) from ours (first half negated)."""
    half = sin_SR[..., sin_SR.shape[-1] // 2:]
    return torch.cat([half, half], dim=-1)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out.dtype)
    return list(torch.autograd.grad((out * g).sum(), inputs))


# ------------------------------------------------------------------------------------------
# rotary tables and rotations against transformers


def _hf_rope_config(scaling: dict | None, partial: float = 1.0):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    params = {"rope_type": "default", "rope_theta": 500.0, **(scaling or {})}
    if partial != 1.0:
        params["partial_rotary_factor"] = partial
    return transformers.Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=128, rope_parameters=params)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
ROPE_CASES = {
    "default": (None, None),
    "linear": ({"rope_type": "linear", "factor": 2.5}, RopeScaling(kind="linear", factor=2.5)),
    "yarn": (YARN, RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32)),
    "yarn-no-truncate-betas": ({**YARN, "truncate": False, "beta_fast": 8.0, "beta_slow": 2.0},
                               RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32, truncate=False,
                                           beta_fast=8.0, beta_slow=2.0)),
    "yarn-mscale": ({**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
                    RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32, mscale=1.0, mscale_all_dim=0.707)),
    "yarn-mscale-only": ({**YARN, "mscale": 0.9}, RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32,
                                                              mscale=0.9)),
    "yarn-attention-factor": ({**YARN, "attention_factor": 1.3},
                              RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32, attention_factor=1.3)),
}


@pytest.mark.integration
@pytest.mark.parametrize("partial", [1.0, 0.5], ids=["full", "partial"])
@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_tables_equal_transformers(case, partial):
    """Frequencies and attention factor equal transformers' rope init function (the default
    one: a family's ``compute_default_rope_parameters`` that knows partial rotary, GLM-4-MoE's);
    the fp32 tables equal its rotary embedding's ``cos``/``sin`` (with our sign convention),
    positions 0..40; the fp64 tables agree to fp32's rounding."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding

    hf_params, scaling = ROPE_CASES[case]
    config = _hf_rope_config(hf_params, partial)
    R = int(16 * partial)
    if scaling is None:
        inv_ref, factor_ref = Glm4MoeRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_ref, factor_ref = ROPE_INIT_FUNCTIONS[hf_params["rope_type"]](config)
    inv, factor = rope_frequencies(R, 500.0, scaling)
    assert inv.dtype == torch.float32 and inv.shape == (R // 2,)
    torch.testing.assert_close(inv, inv_ref, rtol=0, atol=0)
    assert factor == pytest.approx(factor_ref, rel=1e-15)
    if case != "default":
        assert not torch.equal(inv, rope_frequencies(R, 500.0, None)[0])  # (the scaling is not a no-op)

    rotary = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeRotaryEmbedding(config)
    rotary.inv_freq, rotary.attention_scaling = inv_ref, factor_ref  # (its own init knows no partial default)
    x = torch.zeros(1, 41, R)
    cos_ref, sin_ref = rotary(x, torch.arange(41).unsqueeze(0))
    cos, sin = rope_cos_sin(41, R, 500.0, "cpu", torch.float32, scaling=scaling)
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(_hf_sin(sin), sin_ref[0], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, : R // 2], -sin_ref[0, :, : R // 2], rtol=0, atol=0)
    cos64, sin64 = rope_cos_sin(41, R, 500.0, "cpu", torch.float64, scaling=scaling)
    assert cos64.dtype == torch.float64
    torch.testing.assert_close(cos64, cos.double(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin64, sin.double(), rtol=0, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("case", ["yarn", "yarn-mscale", "linear", "default"])
def test_softmax_scale_is_deepseeks_mscale_rule(case):
    """``softmax_scale`` equals DeepSeek-V3's ``yarn_apply_mscale`` on ``qk_head_dim ** -0.5``,
    ``yarn_mscale`` its ``yarn_get_mscale``."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale, yarn_get_mscale

    hf_params, scaling = ROPE_CASES[case]
    params = {"rope_type": "default", **(hf_params or {})}
    assert softmax_scale(24, scaling) == pytest.approx(yarn_apply_mscale(params, 24 ** -0.5), rel=1e-15)
    if case == "yarn-mscale":
        assert softmax_scale(24, scaling) != pytest.approx(24 ** -0.5)
    for scale, m in ((0.5, 1.0), (1.0, 2.0), (4.0, 0.707), (40.0, 1.0)):
        assert yarn_mscale(scale, m) == yarn_get_mscale(scale, m)


@pytest.mark.integration
@DTYPES
@pytest.mark.parametrize("form", ["half", "partial", "interleaved", "interleaved-partial"])
def test_rotations_equal_transformers(form, dtype, gen):
    """``apply_rope`` (whole head, and the first ``R`` dims: GLM-4-MoE's partial rotary) and
    ``apply_rope_interleaved`` (DeepSeek-V3's ``apply_rotary_pos_emb_interleave``, the whole
    rotary part) against transformers' functions: outputs and gradients, at each row's own
    positions (a left-padded batch's tables ``[B, 1, S, R]``)."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    Hd = 16
    R = Hd if form in ("half", "interleaved") else 6
    cos_LR, sin_LR = rope_cos_sin(20, R, 100.0, "cpu", dtype, scaling=RopeScaling(kind="linear", factor=1.5))
    pos_BS = torch.randint(0, 20, (2, 7), generator=gen)
    cos, sin = cos_LR[pos_BS], sin_LR[pos_BS]  # [B, S, R]
    q = torch.randn(2, 4, 7, Hd, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    k = torch.randn(2, 2, 7, Hd, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    if form.startswith("interleaved"):
        q_ref, k_ref = apply_rotary_pos_emb_interleave(q[..., :R], k[..., :R], cos, _hf_sin(sin))
        q_ref, k_ref = torch.cat([q_ref, q[..., R:]], -1), torch.cat([k_ref, k[..., R:]], -1)
        q_got = apply_rope_interleaved(q, cos.unsqueeze(1), sin.unsqueeze(1))
        k_got = apply_rope_interleaved(k, cos.unsqueeze(1), sin.unsqueeze(1))
    else:
        q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, _hf_sin(sin))
        q_got = apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
        k_got = apply_rope(k, cos.unsqueeze(1), sin.unsqueeze(1))
    torch.testing.assert_close(q_got, q_ref, rtol=0, atol=0)  # the same ops: bit for bit
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=0)
    out_got, out_ref = torch.cat([q_got, k_got], 1), torch.cat([q_ref, k_ref], 1)
    g = torch.randn(out_got.shape, generator=gen, dtype=torch.float64).to(dtype)
    for a, b in zip(torch.autograd.grad((out_got * g).sum(), [q, k]), torch.autograd.grad((out_ref * g).sum(), [q, k])):
        torch.testing.assert_close(a, b, **TOL[dtype])
    if R < Hd:  # the unrotated dims pass through
        assert torch.equal(q_got[..., R:], q[..., R:])


@pytest.mark.unit
def test_rope_frequencies_refuses_an_odd_rotary_dim():
    with pytest.raises(ValueError, match="rotary_dim must be an even int >= 2, got 5"):
        rope_frequencies(5, 10000.0)


# ------------------------------------------------------------------------------------------
# SDPA against the readable softmax


@pytest.mark.reference
@pytest.mark.parametrize("case", ["causal", "window", "padded-window", "decode-fold", "sinks-causal",
                                  "sinks-window", "sinks-decode"])
def test_attend_equals_the_readable_softmax(case, gen):
    """``attend`` (SDPA, the grouped decode fold; with sinks the readable path itself) against
    ``attention_reference`` and, for sinks, against the softmax of the logits with the sink
    column written out: outputs and gradients in fp64 (grouped heads: N=4 over G=2)."""
    S, L = (1, 9) if "decode" in case else (8, 8)
    q = torch.randn(2, 4, S, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    k = torch.randn(2, 2, L, 6, generator=gen, dtype=torch.float64).requires_grad_(True)
    v = torch.randn(2, 2, L, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_(True) if "sinks" in case else None
    causal, mask = False, None
    if case in ("causal", "sinks-causal"):
        causal = True
    elif case in ("window", "sinks-window"):
        mask = window_mask(S, 3, "cpu")
    elif case == "padded-window":  # row 1: 3 pad columns, a pad query attends to itself
        col = torch.arange(L)
        visible = (col >= torch.tensor([0, 3]).view(2, 1, 1)) & (col <= col.view(-1, 1)) & (col.view(-1, 1) - col < 3)
        mask = (visible | (col == col.view(-1, 1))).unsqueeze(1)
    else:  # one decode column behind 9 keys, row 1 padded
        mask = (torch.arange(L) >= torch.tensor([0, 2]).view(2, 1)).view(2, 1, 1, L)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    got = attend(q, k, v, mask=mask, causal=causal, sinks_N=sinks)
    ref_mask = torch.ones(S, L, dtype=torch.bool).tril() if causal else mask
    ref = attention_reference(q, k, v, mask=ref_mask, sinks_N=sinks)
    assert got.shape == (2, 4, S, 5)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    g_got, g_ref = (_grads(out, inputs, torch.Generator().manual_seed(1)) for out in (got, ref))
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)
    if sinks is not None:  # the sink takes mass but brings no value: written out with repeat_kv
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        logits = (q @ kr.transpose(-1, -2)) / math.sqrt(6)
        if ref_mask is not None:
            logits = logits.masked_fill(~ref_mask.expand(2, 1, S, L), float("-inf"))
        full = torch.cat([logits, sinks.view(1, 4, 1, 1).expand(2, 4, S, 1)], -1).softmax(-1)
        torch.testing.assert_close(got, full[..., :L] @ vr, rtol=1e-12, atol=1e-12)
        assert (full[..., L] > 0).all()


# ------------------------------------------------------------------------------------------
# the attention module against transformers' modules


def _ours(config: GPTConfig, layer: int, hf: torch.nn.Module, dtype: torch.dtype) -> Attention:
    ours = Attention(config, layer, dtype=dtype)
    ours.load_state_dict(hf.state_dict())  # the same parameter names, strict
    return ours


def _compare(hf_attention, ours: Attention, hf_config, layer: int, dtype: torch.dtype, gen: torch.Generator,
             *, rotary_cls, half_tables: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Outputs and gradients (input, every parameter) of one whole sequence through both, the
    mask from transformers' own mask functions (sliding on its sliding layers). ``half_tables``:
    the family's tables hold each angle once (gpt-oss), ours twice."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    B, S = 2, 11
    x = torch.randn(B, S, hf_config.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    xo, xh = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    sliding = getattr(hf_config, "layer_types", None) and hf_config.layer_types[layer] == "sliding_attention"
    make_mask = create_sliding_window_causal_mask if sliding else create_causal_mask
    mask = make_mask(config=hf_config, inputs_embeds=xh, attention_mask=None, past_key_values=None,
                     position_ids=torch.arange(S).unsqueeze(0))
    assert mask is not None and mask.shape == (B, 1, S, S)
    R = ours.rotary_dim
    cos_SR, sin_SR = rope_cos_sin(S, R, ours.theta, "cpu", dtype, scaling=ours.rope_scaling)
    mine = (cos_SR[:, : R // 2], sin_SR[:, R // 2:]) if half_tables else (cos_SR, _hf_sin(sin_SR))
    if dtype == torch.float32:  # transformers' rotary embedding (its tables, its convention) = ours
        cos, sin = rotary_cls(hf_config)(xh, torch.arange(S).unsqueeze(0).expand(B, S))
        torch.testing.assert_close(cos[0], mine[0], rtol=0, atol=0)
        torch.testing.assert_close(sin[0], mine[1], rtol=0, atol=0)
    else:
        cos, sin = mine[0].expand(B, S, -1), mine[1].expand(B, S, -1)
    with KeepFp64():
        y_ref, _ = hf_attention(xh, position_embeddings=(cos, sin), attention_mask=mask)
    y = ours(xo)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    names = [n for n, _ in ours.named_parameters()]
    hf_params = dict(hf_attention.named_parameters())
    assert sorted(names) == sorted(hf_params)
    got = _grads(y, [xo, *[p for _, p in ours.named_parameters()]], torch.Generator().manual_seed(5))
    with KeepFp64():
        ref = _grads(y_ref, [xh, *[hf_params[n] for n in names]], torch.Generator().manual_seed(5))
    for name, a, b in zip(["x", *names], got, ref):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")  # type: ignore[misc]


def _hf(family: str, **fields):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, family)(vocab_size=61, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                           num_hidden_layers=2, max_position_embeddings=64, **fields)
    config._attn_implementation = "eager"
    return config


BASE = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64, moe_every=0)


@pytest.mark.integration
@DTYPES
def test_qwen3_moe_attention_per_head_qk_norm(dtype, gen):
    """Qwen3-MoE: RMSNorm over each head's dims before the rotation, head_dim 12 != 32/4."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as m

    hf_config = _hf("Qwen3MoeConfig", head_dim=12, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 300.0})
    hf = m.Qwen3MoeAttention(hf_config, 0).to(dtype)
    _randomize(hf, gen)
    config = GPTConfig(**BASE, norm_eps=1e-6, rope_theta=300.0, attention=AttentionConfig(head_dim=12, qk_norm="head"))
    ours = _ours(config, 0, hf, dtype)
    assert ours.q_norm.weight.shape == (12,) and ours.q_proj.weight.shape == (48, 32)
    _compare(hf, ours, hf_config, 0, dtype, gen, rotary_cls=m.Qwen3MoeRotaryEmbedding)


@pytest.mark.integration
@DTYPES
def test_olmoe_attention_whole_projection_qk_norm_and_clip(dtype, gen):
    """OLMoE: RMSNorm over the whole q / k projection before the head split, then q, k, v
    clamped to ``clip_qkv`` (the clamp is active: some values lie beyond it)."""
    from transformers.models.olmoe import modeling_olmoe as m

    hf_config = _hf("OlmoeConfig", clip_qkv=0.8, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1000.0})
    hf = m.OlmoeAttention(hf_config, 0).to(dtype)
    _randomize(hf, gen)
    config = GPTConfig(**BASE, rope_theta=1000.0, attention=AttentionConfig(qk_norm="proj", clip_qkv=0.8))
    ours = _ours(config, 0, hf, dtype)
    assert ours.q_norm.weight.shape == (32,) and ours.k_norm.weight.shape == (16,)
    x = torch.randn(2, 5, 32, generator=gen, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        assert (ours.v_proj(x).abs() > 0.8).any() and (ours.q_norm(ours.q_proj(x)).abs() > 0.8).any()
    _compare(hf, ours, hf_config, 0, dtype, gen, rotary_cls=m.OlmoeRotaryEmbedding)


@pytest.mark.integration
@DTYPES
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_qwen2_moe_attention_biases_and_sliding_layers(layer, dtype, gen):
    """Qwen2-MoE: q/k/v biases, no output bias; with ``use_sliding_window`` its ``layer_types``
    slide every other layer below ``max_window_layers`` (layer 0 here, over 4 columns; layer 1
    attends to everything), our ``sliding_layers=(0,)``."""
    from transformers.models.qwen2_moe import modeling_qwen2_moe as m

    hf_config = _hf("Qwen2MoeConfig", qkv_bias=True, use_sliding_window=True, sliding_window=4, max_window_layers=2,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    assert hf_config.layer_types == ["sliding_attention", "full_attention"]
    hf = m.Qwen2MoeAttention(hf_config, layer).to(dtype)
    _randomize(hf, gen)
    config = GPTConfig(**BASE, rope_theta=1000.0, attention=AttentionConfig(qkv_bias=True, sliding_window=4,
                                                                           sliding_layers=(0,)))
    ours = _ours(config, layer, hf, dtype)
    assert ours.o_proj.bias is None and (ours.window == 4) == (layer == 0)
    _compare(hf, ours, hf_config, layer, dtype, gen, rotary_cls=m.Qwen2MoeRotaryEmbedding)


@pytest.mark.integration
@DTYPES
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_gpt_oss_attention_sinks_window_biases_and_yarn(layer, dtype, gen):
    """gpt-oss: a sink per head, q/k/v and output biases, sliding window on its sliding layers
    (0 here), YaRN rotary tables (scaled cos/sin), head_dim 12; against its eager attention."""
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    yarn = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
            "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False}
    hf_config = _hf("GptOssConfig", head_dim=12, attention_bias=True, sliding_window=4, rope_parameters=yarn,
                    num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)
    assert hf_config.layer_types == ["sliding_attention", "full_attention"]
    hf = m.GptOssAttention(hf_config, layer).to(dtype)
    _randomize(hf, gen)
    scaling = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16, beta_fast=8.0, truncate=False)
    config = GPTConfig(**BASE, rope_theta=500.0, rope_scaling=scaling,
                       attention=AttentionConfig(head_dim=12, qkv_bias=True, o_bias=True, sliding_window=4,
                                                 sliding_layers=(0,), sinks=True))
    ours = _ours(config, layer, hf, dtype)
    assert ours.sinks.shape == (4,) and ours.o_proj.bias is not None

    _compare(hf, ours, hf_config, layer, dtype, gen, rotary_cls=m.GptOssRotaryEmbedding, half_tables=True)


# ------------------------------------------------------------------------------------------
# the options inside MoEGPT: layouts, init, refusals


@pytest.mark.reference
def test_interleaved_rotation_is_the_half_rotation_of_permuted_query_and_key_rows(gen):
    """``rope_interleaved`` rotates adjacent pairs: the same attention as the half rotation with
    each head's query/key rows reordered evens-then-odds within the rotary part (what a
    converter does to move between the two layouts), on a partial rotary head; outputs in
    fp64."""
    att = dict(head_dim=12, rotary_fraction=0.5)
    pairs = MoEGPT(GPTConfig(**BASE, attention=AttentionConfig(**att, rope_interleaved=True)), dtype=torch.float64)
    halves = MoEGPT(GPTConfig(**BASE, attention=AttentionConfig(**att)), dtype=torch.float64)
    _randomize(pairs, gen)
    order = torch.cat([torch.arange(0, 6, 2), torch.arange(1, 6, 2), torch.arange(6, 12)])
    state = dict(pairs.state_dict())
    for name in list(state):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = state[name].view(-1, 12, 32)
            state[name] = w[:, order].reshape(-1, 32)
    idx = torch.randint(0, 61, (2, 9), generator=gen)
    halves.load_state_dict(pairs.state_dict())
    assert not torch.allclose(pairs(idx), halves(idx))  # the same weights: other rotations
    halves.load_state_dict(state)
    torch.testing.assert_close(pairs(idx), halves(idx), rtol=1e-10, atol=1e-10)


@pytest.mark.unit
def test_new_parameters_start_as_transformers_starts_them():
    """Biases zero, query/key norm weights one, sinks ``N(0, init_std)`` (nonzero, small)."""
    torch.manual_seed(0)
    cfg = GPTConfig(**BASE, attention=AttentionConfig(qk_norm="head", qkv_bias=True, o_bias=True, sinks=True))
    model = MoEGPT(cfg)
    for block in model.layers:
        a = block.attn
        for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
            assert torch.equal(lin.bias, torch.zeros_like(lin.bias))
        assert torch.equal(a.q_norm.weight, torch.ones(8)) and torch.equal(a.k_norm.weight, torch.ones(8))
        assert (a.sinks != 0).all() and a.sinks.abs().max() < 6 * cfg.init_std
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.attn.sinks", "layers.0.attn.q_norm.weight", "layers.1.attn.o_proj.bias"} <= names


@pytest.mark.unit
def test_every_attention_kind_builds_and_latent_attention_refuses_grouped_key_value_heads():
    mla = AttentionConfig(kind="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ValueError, match="attention.kind='mla' has a key/value head per query head: n_kv_heads=2"):
        MoEGPT(GPTConfig(**BASE, attention=mla))
    MoEGPT(GPTConfig(**{**BASE, "n_kv_heads": None}, attention=mla))
    MoEGPT(GPTConfig(**BASE, **EVERY_OPTION["yarn-head"]))
    MoEGPT(GPTConfig(**BASE, **EVERY_OPTION["linear-proj-pairs"]))


@pytest.mark.unit
def test_kv_cache_keys_and_values_may_differ_in_size_and_bad_arguments_are_named():
    """``k_dim`` / ``v_dim`` per cache (latent attention stores a latent and a rotary part):
    both writes keep each its own size; bad sizes, tables and windows are named."""
    cos, sin = rope_cos_sin(6, 4, 10000.0, "cpu", torch.float32)
    cache = KVCache(n_layers=2, batch=2, kv_heads=1, k_dim=5, v_dim=3, capacity=6, pad_B=torch.tensor([0, 1]),
                    cos_LR=cos, sin_LR=sin, zeroed=True)
    assert cache.k[1].shape == (2, 1, 6, 5) and cache.v[1].shape == (2, 1, 6, 3)
    k, v = cache.write(1, 0, torch.ones(2, 1, 2, 5), torch.ones(2, 1, 2, 3))
    assert k.shape == (2, 1, 2, 5) and v.shape == (2, 1, 2, 3)
    k, v = cache.write_at(1, torch.tensor(4), torch.full((2, 1, 1, 5), 2.0), torch.full((2, 1, 1, 3), 2.0))
    assert k.shape == (2, 1, 6, 5) and v[:, :, 4].eq(2).all() and v[:, :, 2:4].eq(0).all()
    kw = dict(n_layers=1, batch=2, kv_heads=1, k_dim=4, v_dim=4, capacity=6, pad_B=torch.tensor([0, 1]), cos_LR=cos,
              sin_LR=sin)
    for bad, match in ((dict(v_dim=0), "v_dim must be"), (dict(window=0), "window must be"),
                       (dict(cos_LR=cos[:5]), r"cos_LR and sin_LR must both be \[6, R\]"),
                       (dict(sin_LR=sin[:, :2]), r"must both be \[6, R\] with R even")):
        with pytest.raises(ValueError, match=match):
            KVCache(**{**kw, **bad})  # type: ignore[arg-type]


@pytest.mark.reference
def test_a_sliding_block_refuses_a_cache_without_its_window(gen):
    model = MoEGPT(GPTConfig(**BASE, attention=AttentionConfig(sliding_window=3)))
    c = model.config
    cos, sin = rope_cos_sin(8, 8, c.rope_theta, "cpu", torch.float32)
    cache = KVCache(n_layers=2, batch=1, kv_heads=2, k_dim=8, v_dim=8, capacity=8,
                    pad_B=torch.zeros(1, dtype=torch.long), cos_LR=cos, sin_LR=sin)
    with pytest.raises(ValueError, match="block 0 slides over 3 columns but the cache's masks are for window=None"):
        model.forward_cached(torch.randint(0, 61, (1, 4), generator=gen), cache)


@pytest.mark.reference
def test_step_window_masks_hide_what_lies_a_window_behind(gen):
    """The cached call's and the static step's window masks: a real key ``k`` is visible to the
    query in column ``c`` when ``k <= c``, ``c - k < window`` and ``k`` is no pad column; the
    plain masks stay as they were."""
    cos, sin = rope_cos_sin(10, 4, 10000.0, "cpu", torch.float32)
    pad = torch.tensor([0, 2])
    cache = KVCache(n_layers=1, batch=2, kv_heads=1, k_dim=4, v_dim=4, capacity=10, pad_B=pad, cos_LR=cos,
                    sin_LR=sin, window=3, zeroed=True)
    col = torch.arange(6)
    real_before = (col >= pad.view(2, 1, 1)) & (col <= col.view(-1, 1))  # [B, S, L]
    itself = col == col.view(-1, 1)  # (a pad query attends to itself)
    step = step_inputs(cache, 6)
    assert torch.equal(step.window_mask, ((real_before & (col.view(-1, 1) - col < 3)) | itself).unsqueeze(1))
    assert torch.equal(step.mask, (real_before | itself).unsqueeze(1))
    static = static_step(cache, torch.tensor(7))
    key = torch.arange(10)
    assert torch.equal(static.window_mask.view(2, 10), (key >= pad.view(2, 1)) & (key <= 7) & (key > 4))
    cache.pad_B.zero_()
    cache.max_pad = 0
    step = step_inputs(cache, 6)
    assert step.mask is None and torch.equal(step.window_mask, window_mask(6, 3, "cpu"))


# ------------------------------------------------------------------------------------------
# a whole model with every option on: full sequence, cached, static step

EVERY_OPTION = {
    "yarn-head": dict(attention=AttentionConfig(head_dim=12, qk_norm="head", qkv_bias=True, o_bias=True, clip_qkv=1.5,
                                                sliding_window=3, sliding_layers=(0,), sinks=True, rotary_fraction=0.5),
                      rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8, beta_fast=8.0,
                                               truncate=False)),
    "linear-proj-pairs": dict(attention=AttentionConfig(head_dim=12, qk_norm="proj", qkv_bias=True, o_bias=True,
                                                        clip_qkv=1.5, sliding_window=3, sinks=True,
                                                        rope_interleaved=True),
                              rope_scaling=RopeScaling(kind="linear", factor=2.0)),
}
PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [6, 6, 11, 30, 2]]


def every_option_gpt(case: str, dtype: torch.dtype, gen: torch.Generator) -> MoEGPT:
    model = MoEGPT(GPTConfig(**{**BASE, "n_layers": 3, "moe_every": 2, "num_experts": 4, "top_k": 2,
                                "expert_hidden": 24, "max_seq_len": 32}, **EVERY_OPTION[case]), dtype=dtype).eval()
    _randomize(model, gen)
    return model


@pytest.mark.reference
@pytest.mark.parametrize("case", list(EVERY_OPTION))
def test_every_option_cached_and_static_steps_equal_the_whole_sequence(case, gen):
    """fp64, a left-padded batch (prompts longer and shorter than the window of 3): the cached
    prefill and five greedy decode steps give each row's logits of the whole sequence alone,
    and the static step on a zeroed cache gives the cached step's; the window and the sinks
    matter (without them the logits differ)."""
    model = every_option_gpt(case, torch.float64, gen)
    P = max(map(len, PROMPTS))
    pad_B = torch.tensor([P - len(r) for r in PROMPTS])
    idx = torch.tensor([[0] * (P - len(r)) + r for r in PROMPTS])
    rows = [list(r) for r in PROMPTS]
    with torch.no_grad():
        cache, static = model.new_cache(pad_B, 16), model.new_cache(pad_B, 16, zeroed=True)
        logits = model.forward_cached(idx, cache)
        model.forward_cached(idx, static)
        pos = torch.tensor(P)
        for step in range(6):
            for b, row in enumerate(rows):
                torch.testing.assert_close(logits[b], model(torch.tensor([row]))[0, -1], rtol=1e-10, atol=1e-10)
            if step == 5:
                break
            next_B = logits.argmax(-1)
            for b in range(len(rows)):
                rows[b].append(int(next_B[b]))
            logits = model.forward_cached(next_B.unsqueeze(1), cache)
            torch.testing.assert_close(model.decode_step(next_B, pos, static), logits, rtol=1e-10, atol=1e-10)
            pos += 1
        a = model.config.attention
        for changed in (dict(sliding_window=None, sliding_layers=()), dict(sinks=False)):
            config = dataclasses.replace(model.config, attention=dataclasses.replace(a, **changed))
            other = MoEGPT(config, dtype=torch.float64).eval()
            other.load_state_dict(model.state_dict(), strict=False)
            assert not torch.allclose(other(torch.tensor([rows[0]])), model(torch.tensor([rows[0]])))


@pytest.mark.reference
def test_every_option_gradients_flow_to_every_new_parameter(gen):
    """A training step's loss reaches the norms, biases and sinks of every block (none is left
    out of the graph)."""
    model = every_option_gpt("yarn-head", torch.float64, gen).train()
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    for name, p in model.named_parameters():
        if "attn" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
