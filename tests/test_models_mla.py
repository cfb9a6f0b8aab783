"""Multi-head latent attention (``moeflow.models.mla``): ``LatentAttention`` against transformers'
``DeepseekV3Attention`` with copied weights (query bottleneck or one projection, adjacent-pair
or half rotation, YaRN with DeepSeek's mscale; outputs and every gradient, fp64 at 1e-10 under
``KeepFp64``, fp32 at 1e-5 with transformers' own rotary tables), the absorbed form against the
expanded one (outputs and gradients), and a whole ``MoEGPT`` with latent attention: the cache
holds the latent and nothing else, the cached prefill and decode and the static step give the
whole sequence's logits on a left-padded batch, the static step is one graph without host
reads, and compiled generation gives the eager tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import moeflow.models.mla as mla
from moeflow.models.compiled_decode import compiled_decoder
from moeflow.models.generation import generate
from moeflow.models.gpt import MoEGPT
from moeflow.models.gpt_config import AttentionConfig, GPTConfig, RopeScaling
from moeflow.models.mla import LatentAttention, absorbed_attention, expanded_attention
from moeflow.models.rope import rope_cos_sin, rotate, softmax_scale

from helpers import KeepFp64
from test_models_generation_compiled import SyncCounter

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])

# ours -> transformers' parameter names inside the attention (the rest are the same)
HF_NAMES = {"q_a_norm": "q_a_layernorm", "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm"}
# small, every size distinct: N=4 heads, P=8 unrotated, R=6 rotary, Hv=10 value dims, C=16 latent
SHAPE = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10)
YARN = RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16, mscale=0.9, mscale_all_dim=0.7)
YARN_HF = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.9,
           "mscale_all_dim": 0.7}
BASE = dict(vocab_size=61, dim=32, n_heads=4, max_seq_len=64, norm_eps=1e-5, rope_theta=500.0)


def _to_hf(name: str) -> str:
    head, _, rest = name.partition(".")
    return f"{HF_NAMES.get(head, head)}.{rest}"


def _randomize(module: torch.nn.Module, gen: torch.Generator, std: float = 0.3) -> None:
    """Every parameter drawn fresh (norm weights around one)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64) * std
            p.copy_((noise + (1.0 if "norm" in name else 0.0)).to(p.dtype))


def _hf_sin(sin_SR: torch.Tensor) -> torch.Tensor:
    """transformers' ``sin`` table (``cat(s, s)``) from ours (first half negated)."""
    half = sin_SR[..., sin_SR.shape[-1] // 2:]
    return torch.cat([half, half], dim=-1)


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    return list(torch.autograd.grad((out * g).sum(), inputs))


# ------------------------------------------------------------------------------------------
# the module against transformers' DeepseekV3Attention

CASES = {  # q_lora_rank, rope_interleave, scaled
    "lora-pairs-yarn": (12, True, True),
    "lora-halves": (12, False, False),
    "proj-pairs": (None, True, False),
    "proj-halves-yarn": (None, False, True),
}


@pytest.mark.integration
@DTYPES
@pytest.mark.parametrize("case", list(CASES))
def test_latent_attention_equals_deepseek_v3_attention(case, dtype, gen):
    """A whole sequence through ``LatentAttention`` and transformers' ``DeepseekV3Attention``
    (eager) with the same weights: outputs and the gradients of the input and every parameter.
    ``rms_norm_eps=1e-5`` on both sides: transformers' latent norms keep RMSNorm's default
    1e-6 regardless (so must ours); with YaRN the softmax scale carries DeepSeek's mscale."""
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import create_causal_mask
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    q_lora, interleave, scaled = CASES[case]
    rope = {"rope_type": "default", "rope_theta": 500.0, **(YARN_HF if scaled else {})}
    hf_config = transformers.DeepseekV3Config(vocab_size=61, hidden_size=32, num_attention_heads=4,
                                              num_key_value_heads=4, num_hidden_layers=1, max_position_embeddings=64,
                                              q_lora_rank=q_lora, rope_interleave=interleave, rms_norm_eps=1e-5,
                                              rope_parameters=rope, **SHAPE)
    hf_config._attn_implementation = "eager"
    hf = m.DeepseekV3Attention(hf_config, 0).to(dtype)
    _randomize(hf, gen)
    config = GPTConfig(**BASE, n_layers=1, moe_every=0, rope_scaling=YARN if scaled else None,
                       attention=AttentionConfig(kind="mla", q_lora_rank=q_lora, rope_interleaved=interleave, **SHAPE))
    ours = LatentAttention(config, dtype=dtype)
    ours.load_state_dict({n: hf.state_dict()[_to_hf(n)] for n in ours.state_dict()})  # strict: every name maps
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-15)
    if scaled:
        assert ours.scale != pytest.approx((8 + 6) ** -0.5)  # (the mscale correction is on)

    B, S, R = 2, 11, 6
    x = torch.randn(B, S, 32, generator=gen, dtype=torch.float64).to(dtype)
    xo, xh = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    pos = torch.arange(S).unsqueeze(0)
    mask = create_causal_mask(config=hf_config, inputs_embeds=xh, attention_mask=None, past_key_values=None,
                              position_ids=pos)
    assert mask is not None and mask.shape == (B, 1, S, S)
    cos_SR, sin_SR = rope_cos_sin(S, R, 500.0, "cpu", dtype, scaling=config.rope_scaling)
    if dtype == torch.float32:  # transformers' rotary embedding (its tables, its convention) = ours
        cos, sin = m.DeepseekV3RotaryEmbedding(hf_config)(xh, pos.expand(B, S))
        torch.testing.assert_close(cos[0], cos_SR, rtol=0, atol=0)
        torch.testing.assert_close(sin[0], _hf_sin(sin_SR), rtol=0, atol=0)
    else:  # (its tables are fp32-only)
        cos, sin = cos_SR.expand(B, S, R), _hf_sin(sin_SR).expand(B, S, R)
    with KeepFp64():
        y_ref, _ = hf(xh, position_embeddings=(cos, sin), attention_mask=mask)
    y = ours(xo)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    names = [n for n, _ in ours.named_parameters()]
    hf_params = dict(hf.named_parameters())
    assert sorted(map(_to_hf, names)) == sorted(hf_params)
    got = _grads(y, [xo, *[p for _, p in ours.named_parameters()]], 5)
    with KeepFp64():
        ref = _grads(y_ref, [xh, *[hf_params[_to_hf(n)] for n in names]], 5)
    for name, a, b in zip(["x", *names], got, ref):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda msg, name=name: f"{name}: {msg}")  # type: ignore[misc]


# ------------------------------------------------------------------------------------------
# the absorbed form against the expanded one


@pytest.mark.reference
@pytest.mark.parametrize("case", ["causal", "padded-prefill", "padded-decode", "decode"])
def test_absorbed_attention_equals_the_expanded_form(case, gen):
    """fp64: ``absorbed_attention`` (``kv_b_proj`` folded into the query and applied after the
    softmax) against ``expanded_attention`` (per-head keys and values, SDPA), outputs and the
    gradients of every input and of ``kv_b_proj``'s weight: a whole causal sequence (the
    training path), a left-padded prefill's mask, and one decode column over a cache (masked
    and not)."""
    B, N, P, R, Hv, C = 3, 4, 8, 6, 10, 16
    S, L = (1, 9) if "decode" in case else (7, 7)
    shapes = [(B, N, S, P), (B, N, S, R), (B, 1, L, C), (B, 1, L, R), (N * (P + Hv), C)]
    inputs = [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes]
    causal, mask = case == "causal", None
    pad = torch.tensor([0, 2, 4]).view(B, 1, 1, 1)
    col = torch.arange(L)
    if case == "padded-prefill":  # a real key at or before the query; a pad query sees itself
        mask = ((col >= pad) & (col <= col.view(-1, 1))) | (col == col.view(-1, 1))
    elif case == "padded-decode":
        mask = (col >= pad).expand(B, 1, 1, L)
    kw = dict(mask=mask, causal=causal, scale=softmax_scale(P + R, YARN))
    got, ref = absorbed_attention(*inputs, **kw), expanded_attention(*inputs, **kw)
    assert got.shape == ref.shape == (B, N, S, Hv)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(["q_nope", "q_rot", "latent", "k_rot", "w_kv_b"], _grads(got, inputs, 3),
                          _grads(ref, inputs, 3)):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11, msg=lambda msg, name=name: f"{name}: {msg}")  # type: ignore[misc]


# ------------------------------------------------------------------------------------------
# parameters, refusals

MLA = AttentionConfig(kind="mla", q_lora_rank=12, rope_interleaved=True, **SHAPE)


@pytest.mark.unit
@pytest.mark.parametrize("q_lora", [12, None], ids=["lora", "proj"])
def test_parameter_names_and_shapes_follow_the_design(q_lora):
    """Issue 47's names and shapes; norms start at one, the output bias at zero, every
    projection drawn, the output projection narrower (GPT-2's depth scaling)."""
    torch.manual_seed(0)
    att = dataclasses.replace(MLA, q_lora_rank=q_lora, o_bias=True)
    model = MoEGPT(GPTConfig(**BASE, n_layers=2, moe_every=0, attention=att))
    shapes = {n.removeprefix("layers.1.attn."): tuple(p.shape) for n, p in model.named_parameters()
              if n.startswith("layers.1.attn.")}
    query = {"q_a_proj.weight": (12, 32), "q_a_norm.weight": (12,), "q_b_proj.weight": (4 * 14, 12)} if q_lora else {
        "q_proj.weight": (4 * 14, 32)}
    assert shapes == {**query, "kv_a_proj.weight": (16 + 6, 32), "kv_a_norm.weight": (16,),
                      "kv_b_proj.weight": (4 * (8 + 10), 16), "o_proj.weight": (32, 4 * 10), "o_proj.bias": (32,)}
    a = model.layers[1].attn
    assert torch.equal(a.kv_a_norm.weight, torch.ones(16)) and torch.equal(a.o_proj.bias, torch.zeros(32))
    std = model.config.init_std
    for lin in (a.kv_a_proj, a.kv_b_proj, a.q_a_proj if q_lora else a.q_proj):
        assert 0.7 * std < lin.weight.std() < 1.3 * std
    assert a.o_proj.weight.std() < 0.7 * std


@pytest.mark.unit
def test_latent_attention_refuses_other_key_value_heads_and_other_kinds():
    with pytest.raises(ValueError, match="n_kv_heads=2 must be None or n_heads=4"):
        MoEGPT(GPTConfig(**BASE, n_layers=1, n_kv_heads=2, moe_every=0, attention=MLA))
    MoEGPT(GPTConfig(**BASE, n_layers=1, n_kv_heads=4, moe_every=0, attention=MLA))
    with pytest.raises(ValueError, match="LatentAttention builds attention.kind='mla', got 'gqa'"):
        LatentAttention(GPTConfig(**BASE, n_layers=1, moe_every=0))


# ------------------------------------------------------------------------------------------
# a whole model: the latent cache, cached and static steps

PROMPTS = [[5, 9, 2, 7, 1, 3, 8], [4, 8], [6, 6, 11, 30, 2]]
MODEL = dict(BASE, n_layers=3, moe_every=2, num_experts=4, top_k=2, expert_hidden=24, max_seq_len=32,
             rope_scaling=YARN, attention=MLA)


def mla_gpt(dtype: torch.dtype, gen: torch.Generator, **kw: object) -> MoEGPT:
    model = MoEGPT(GPTConfig(**{**MODEL, **kw}), dtype=dtype).eval()  # type: ignore[arg-type]
    _randomize(model, gen)
    return model


def _left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, prompts))
    return torch.tensor([[0] * (P - len(r)) + r for r in prompts]), torch.tensor([P - len(r) for r in prompts])


@pytest.mark.reference
def test_the_cache_holds_the_latent_and_the_rotary_key_part_only(gen):
    """Per block one ``[B, 1, L, kv_lora_rank]`` latent and one ``[B, 1, L, qk_rope_head_dim]``
    rotated key part, nothing per head: ``C + R`` numbers a column where expanded keys and
    values would take ``N * (P + R + Hv)``. What a prefill writes there is the normed latent
    and the rotated key part of each real column."""
    model = mla_gpt(torch.float64, gen)
    idx, pad_B = _left_padded(PROMPTS)
    cache = model.new_cache(pad_B, 16)
    assert len(cache.k) == len(cache.v) == 3
    for k, v in zip(cache.k, cache.v):
        assert k.shape == (3, 1, 16, 16) and v.shape == (3, 1, 16, 6)
    per_column = sum(t[0, :, 0].numel() for t in (*cache.k, *cache.v)) / 3
    assert per_column == 16 + 6 < 4 * (8 + 6 + 10)
    with torch.no_grad():
        model.forward_cached(idx, cache)
        attn, x = model.layers[0].attn, model.layers[0].attn_norm(model.embed(torch.tensor([PROMPTS[0]])))
        latent, k_rot = attn.kv_a_proj(x).split([16, 6], dim=-1)
        torch.testing.assert_close(cache.k[0][0, 0, :7], attn.kv_a_norm(latent)[0], rtol=1e-12, atol=1e-12)
        cos, sin = rope_cos_sin(7, 6, 500.0, "cpu", torch.float64, scaling=YARN)
        rotated = rotate(k_rot.unsqueeze(1), cos, sin, interleaved=True)[0, 0]
        torch.testing.assert_close(cache.v[0][0, 0, :7], rotated, rtol=1e-12, atol=1e-12)


@pytest.mark.reference
@pytest.mark.parametrize("q_lora,interleave", [(12, True), (None, False)], ids=["lora-pairs", "proj-halves"])
def test_cached_and_static_steps_equal_the_whole_sequence(q_lora, interleave, gen, monkeypatch):
    """fp64, a left-padded batch: the cached prefill and five greedy decode steps give each
    row's logits of the whole sequence alone, and the static step on a zeroed cache gives the
    cached step's; the prefill runs the expanded form, every one-column step the absorbed form
    (no per-head keys over the cache)."""
    model = mla_gpt(torch.float64, gen, attention=dataclasses.replace(MLA, q_lora_rank=q_lora,
                                                                       rope_interleaved=interleave))
    calls: list[tuple[str, int]] = []
    for name in ("expanded_attention", "absorbed_attention"):
        real = getattr(mla, name)
        monkeypatch.setattr(mla, name, lambda *a, real=real, name=name, **k: calls.append((name, a[0].shape[2]))
                            or real(*a, **k))
    idx, pad_B = _left_padded(PROMPTS)
    rows = [list(r) for r in PROMPTS]
    with torch.no_grad():
        cache, static = model.new_cache(pad_B, 16), model.new_cache(pad_B, 16, zeroed=True)
        logits = model.forward_cached(idx, cache)
        model.forward_cached(idx, static)
        assert calls == [("expanded_attention", 7)] * 6
        calls.clear()
        pos = torch.tensor(idx.shape[1])
        for step in range(6):
            for b, row in enumerate(rows):
                torch.testing.assert_close(logits[b], model(torch.tensor([row]))[0, -1], rtol=1e-10, atol=1e-10)
            if step == 5:
                break
            next_B = logits.argmax(-1)
            for b in range(len(rows)):
                rows[b].append(int(next_B[b]))
            calls.clear()
            logits = model.forward_cached(next_B.unsqueeze(1), cache)
            torch.testing.assert_close(model.decode_step(next_B, pos, static), logits, rtol=1e-10, atol=1e-10)
            assert calls == [("absorbed_attention", 1)] * 6
            pos += 1


@pytest.mark.reference
def test_training_gradients_reach_every_latent_attention_parameter(gen):
    """A training step's loss (attention dropout on) reaches every projection and norm of every
    block's latent attention."""
    model = mla_gpt(torch.float64, gen, dropout=0.1).train()
    idx = torch.randint(0, 61, (2, 10), generator=gen)
    model.loss(idx[:, :-1], idx[:, 1:]).backward()
    names = [n for n, _ in model.named_parameters() if ".attn." in n]
    assert len(names) == 3 * 7
    for name, p in model.named_parameters():
        if ".attn." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.fixture(scope="module")
def fp32_model() -> MoEGPT:
    """An fp32 MLA model with weights drawn wide (std 0.3) so greedy picks are far from ties."""
    return mla_gpt(torch.float32, torch.Generator().manual_seed(11))


@pytest.mark.reference
def test_static_step_is_one_graph_without_host_reads(fp32_model):
    """The static step with latent attention reads nothing on the host and traces as one graph
    (``torch.compile(fullgraph=True)`` needs both); equal to the eager cached step."""
    m = fp32_model
    idx, pad_B = _left_padded(PROMPTS)
    with torch.no_grad():
        cache, ref_cache = m.new_cache(pad_B, 32, zeroed=True), m.new_cache(pad_B, 32)
        logits, _ = m.forward_cached(idx, cache), m.forward_cached(idx, ref_cache)
        next_B, pos = logits.argmax(-1), torch.tensor(idx.shape[1])
        with SyncCounter() as counter:
            got = m.decode_step(next_B, pos, cache)
        assert counter.seen == []
        torch.testing.assert_close(got, m.forward_cached(next_B.unsqueeze(1), ref_cache), rtol=1e-5, atol=1e-5)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m.decode_step)(next_B, pos, cache)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.e2e
def test_compiled_generation_gives_the_eager_steps_and_tokens(fp32_model):
    """Compiled, on a left-padded batch: the compiled step's logits equal the eager cached
    step's over six steps (fp32 rounding), and greedy generation gives the eager loop's tokens,
    in one compilation."""
    m = fp32_model
    eager = generate(m, PROMPTS, 20, temperature=0)
    assert generate(m, PROMPTS, 20, temperature=0, compile=True).tokens == eager.tokens
    decoder = compiled_decoder(m)
    assert decoder.compilations == 1  # (3 rows, 32 columns)
    idx, pad_B = _left_padded(PROMPTS)
    with torch.no_grad(), decoder.generation(m):
        cache, ref_cache = decoder.cache(m, pad_B, 32), m.new_cache(pad_B, 32)
        logits, ref_logits = m.forward_cached(idx, cache), m.forward_cached(idx, ref_cache)
        assert cache.k[0].shape == (3, 1, 32, 16) and cache.v[0].shape == (3, 1, 32, 6)
        pos = torch.tensor(idx.shape[1])
        for step in range(6):
            next_B = ref_logits.argmax(-1)
            logits = decoder.run(next_B, pos, cache, guarded=step == 0)
            ref_logits = m.forward_cached(next_B.unsqueeze(1), ref_cache)
            # fp32 rounding relative to the logits' scale: the compiled step's products (packed
            # projections and head) sum in another order than the eager step's BLAS head, and the
            # cache carries each path's own keys into the next steps; a wrong column or position
            # differs by the logits' own scale
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * float(ref_logits.abs().max()))
            pos += 1
    assert decoder.compilations == 1
