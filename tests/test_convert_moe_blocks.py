"""Each public family's MoE block as a ``moeflow.MoE`` (``moeflow.convert.moe_blocks``): the
config map and the tensor maps against transformers' own modules and files, and gpt-oss's
clamped SwiGLU (``swiglu_oai``) against ``GptOssExperts``.

Whole blocks (router, experts, shared experts) run on fresh random tokens with every HF
parameter (and DeepSeek-V3's selection bias) redrawn: outputs, the input's gradient and every
parameter's gradient (HF's gradients taken through the same tensor map). In fp32 against the
modules as they are (1e-5); in fp64 at 1e-10, with the fp32 casts transformers' softmax
routers make of fp64 logits lifted (``KeepFp64``, ``tests/helpers.py``): otherwise the comparison would measure those
casts (~1e-7) and not the map. DeepSeek-V3's router computes in fp32 in transformers and in
moeflow's map alike, so its fp64 case needs no lifting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import moeflow
from moeflow.config import ExpertsConfig, RouterConfig
from moeflow.convert.moe_blocks import (FAMILIES, FFN_FIELDS, MOE_KEYS, ffn_from_hf, ffn_to_hf, hf_ffn_shapes,
                                        moe_fields_from_hf, moe_fields_to_hf)
from moeflow.kernels.activation import activate_reference
from moeflow.models.blocks import Block
from moeflow.models.gpt_config import GPTConfig

from helpers import KeepFp64, rel_err

D = 16
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# family -> (transformers' config class, its MoE block class, the block's config fields)
BLOCKS: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock",
                dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=8)),
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
                  dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8, shared_expert_intermediate_size=12,
                       norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
                  dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=8, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
              dict(num_experts=6, num_experts_per_tok=2, intermediate_size=8)),
    "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE",
                    dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8, n_shared_experts=2, n_group=4,
                         topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=0)),
    "gpt_oss": ("GptOssConfig", "gpt_oss.modeling_gpt_oss.GptOssMLP",
                dict(num_local_experts=6, num_experts_per_tok=2, intermediate_size=8)),
}


def _transformers():  # type: ignore[no-untyped-def]
    return pytest.importorskip("transformers", reason="transformers is not installed: the HF families are not tested")


def _hf_class(dotted: str) -> type:
    import importlib

    module, name = dotted.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _block_and_layer(family: str, dtype: torch.dtype, gen: torch.Generator):  # type: ignore[no-untyped-def]
    """transformers' block with every parameter and buffer redrawn, and the ``moeflow.MoE`` of
    ``moe_fields_from_hf`` holding its tensors (read by ``ffn_from_hf`` from the block's own,
    fused, state dict)."""
    tf = _transformers()
    config_cls, block_cls, fields = BLOCKS[family]
    hf_config = getattr(tf, config_cls)(hidden_size=D, **fields)
    block = _hf_class(block_cls)(hf_config).to(dtype)
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64) * (0.5 if "bias" in name else 0.3))
    cfg = GPTConfig(vocab_size=8, dim=D, n_layers=1, n_heads=2, **moe_fields_from_hf(hf_config.to_dict()))
    layer = moeflow.MoE(config=cfg.moe_config(), dtype=dtype).eval()
    state = ffn_from_hf(family, {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}, cfg, 0)
    missing, unexpected = layer.load_state_dict({k.removeprefix("layers.0.ffn."): v for k, v in state.items()},
                                                strict=False)
    assert not unexpected and set(missing) <= {"router.load_counts", "router.expert_bias"}, (missing, unexpected)
    assert ("router.expert_bias" in missing) == (family != "deepseek_v3")
    return block, layer, cfg


@pytest.mark.integration
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_block_equals_transformers(family: str, dtype: torch.dtype, gen: torch.Generator) -> None:
    """Outputs, the input's gradient and every parameter's gradient of the whole block equal
    transformers' (module docstring); for DeepSeek-V3 the selection bias changes some token's
    experts, and for gpt-oss tokens reach beyond both clamps of its SwiGLU (so neither is a
    test of the easy case)."""
    block, layer, cfg = _block_and_layer(family, dtype, gen)
    x = torch.randn(3, 7, D, generator=gen, dtype=torch.float64).mul(4 if family == "gpt_oss" else 1).to(dtype)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    with KeepFp64():
        y_hf = block(x_hf)
    y_hf = y_hf[0] if isinstance(y_hf, tuple) else y_hf  # (GptOssMLP returns the router scores too)
    y = layer(x_ours)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    y_hf.backward(dy)
    y.backward(dy)
    tol = TOL[dtype]
    assert rel_err(y, y_hf) <= tol and rel_err(x_ours.grad, x_hf.grad) <= tol
    hf_grads = {f"model.layers.0.mlp.{n}": p.grad for n, p in block.named_parameters()}
    hf_grads.update({f"model.layers.0.mlp.{n}": torch.zeros_like(b) for n, b in block.named_buffers()})
    want = {k.removeprefix("layers.0.ffn."): g for k, g in ffn_from_hf(family, hf_grads, cfg, 0).items()}
    params = dict(layer.named_parameters())
    assert params.keys() <= want.keys()
    for name, p in params.items():
        assert rel_err(p.grad, want[name]) <= tol, name

    x_TD = x.reshape(-1, D)
    ids = layer.router(x_TD, top_k=cfg.top_k).ids_TK
    if family == "deepseek_v3":
        plain = moeflow.MoE(config=cfg.moe_config(), dtype=dtype)
        plain.load_state_dict(layer.state_dict())
        plain.router.expert_bias.zero_()
        assert not torch.equal(plain.router(x_TD, top_k=cfg.top_k).ids_TK.sort(1).values, ids.sort(1).values)
    if family == "gpt_oss":
        w_in, b_in = layer.experts.w_in, layer.experts.b_in
        h = torch.stack([x_TD[t] @ w_in[e] + b_in[e] for t in range(x_TD.shape[0]) for e in ids[t].tolist()]).detach()
        gate, up = h.chunk(2, dim=-1)
        assert (gate > 7).any() and (up.abs() > 7).any()


@pytest.mark.integration
def test_swiglu_oai_is_gpt_oss_gate_bit_for_bit(gen: torch.Generator) -> None:
    """``activate_reference(h, "swiglu_oai")`` on moeflow's layout (gate columns, then up) is
    ``GptOssExperts._apply_gate`` on gpt-oss's (interleaved), values and gradients, in fp64 and
    fp32, with values beyond both clamps and exactly at them."""
    tf = _transformers()
    experts = _hf_class("gpt_oss.modeling_gpt_oss.GptOssExperts")(
        tf.GptOssConfig(hidden_size=D, num_local_experts=2, intermediate_size=12))
    for dtype in (torch.float64, torch.float32):
        h = torch.randn(40, 24, generator=gen, dtype=torch.float64).mul(6).to(dtype)
        h[0, :3] = h[0, 12:15] = torch.tensor([7.0, -7.0, 0.5])
        ours = h.clone().requires_grad_()
        theirs = torch.stack([h[:, :12], h[:, 12:]], dim=-1).flatten(-2).requires_grad_()  # gate at even columns
        a, a_hf = activate_reference(ours, "swiglu_oai"), experts._apply_gate(theirs)
        assert torch.equal(a, a_hf)
        da = torch.randn(a.shape, generator=gen, dtype=torch.float64).to(dtype)
        (d_ours,), (d_theirs,) = torch.autograd.grad(a, ours, da), torch.autograd.grad(a_hf, theirs, da)
        assert torch.equal(d_ours, torch.cat([d_theirs[:, 0::2], d_theirs[:, 1::2]], dim=-1))
        assert (d_ours[:, :12][h[:, :12] > 7] == 0).all() and (d_ours[:, 12:][h[:, 12:].abs() > 7] == 0).all()
        assert (h[:, :12] > 7).any() and (h[:, 12:].abs() > 7).any()


# ------------------------------------------------------------------------------ whole models' files

# family -> (model class, config fields): tiny decoders with dense blocks where the family has them
MODELS: dict[str, tuple[str, dict]] = {
    "mixtral": ("MixtralForCausalLM", BLOCKS["mixtral"][2]),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(BLOCKS["qwen2_moe"][2], num_hidden_layers=4, decoder_sparse_step=2,
                                              mlp_only_layers=[3], intermediate_size=20)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(BLOCKS["qwen3_moe"][2], mlp_only_layers=[0], intermediate_size=20)),
    "olmoe": ("OlmoeForCausalLM", BLOCKS["olmoe"][2]),
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(BLOCKS["deepseek_v3"][2], first_k_dense_replace=1, intermediate_size=20,
                                                  q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                                  v_head_dim=4, num_key_value_heads=2)),
    "gpt_oss": ("GptOssForCausalLM", dict(BLOCKS["gpt_oss"][2], head_dim=8)),
}


def _hf_model(family: str, gen: torch.Generator):  # type: ignore[no-untyped-def]
    tf = _transformers()
    model_cls, fields = MODELS[family]
    hf_config = getattr(tf, BLOCKS[family][0])(**{"vocab_size": 32, "hidden_size": D, "num_hidden_layers": 2,
                                                  "num_attention_heads": 2, "num_key_value_heads": 1, **fields})
    model = getattr(tf, model_cls)(hf_config)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and "rotary" not in name:
                t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64) * 0.3)
    cfg = GPTConfig(vocab_size=32, dim=D, n_layers=hf_config.num_hidden_layers, n_heads=2,
                    **moe_fields_from_hf(hf_config.to_dict()))
    return model, cfg


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_maps_read_and_write_what_save_pretrained_writes(family: str, gen: torch.Generator,
                                                                tmp_path: Path) -> None:
    """On a tiny decoder of the family saved by ``save_pretrained`` (its file layout: one linear
    per expert, gpt-oss's interleaved fused tensors): ``hf_ffn_shapes`` names every FFN tensor
    of the file with its shape; ``ffn_from_hf`` reads from the file what it reads from the
    module's in-memory (fused) state dict, tensor for tensor; ``ffn_to_hf`` gives the file's
    tensors back exactly; which blocks are MoE is transformers' choice (decoder_sparse_step,
    mlp_only_layers, first_k_dense_replace)."""
    from safetensors.torch import load_file

    model, cfg = _hf_model(family, gen)
    model.save_pretrained(tmp_path)
    files: dict[str, torch.Tensor] = {}
    for path in sorted(tmp_path.glob("*.safetensors")):
        files.update(load_file(path))
    memory = model.state_dict()
    ffn_names = {k for k in files if k.startswith("model.layers.") and k.split(".")[3] in ("mlp", "block_sparse_moe")}
    named = set()
    for i, decoder_layer in enumerate(model.model.layers):
        assert cfg.is_moe_layer(i) == (type(decoder_layer.mlp).__name__ == BLOCKS[family][1].rsplit(".", 1)[1]), i
        shapes = hf_ffn_shapes(family, cfg, i)
        named |= {f"model.layers.{i}.{name}" for name in shapes}
        for name, shape in shapes.items():
            assert tuple(files[f"model.layers.{i}.{name}"].shape) == shape, name
        from_file, from_memory = ffn_from_hf(family, files, cfg, i), ffn_from_hf(family, memory, cfg, i)
        assert from_file.keys() == from_memory.keys()
        for name, t in from_file.items():
            assert torch.equal(t, from_memory[name]) and t.is_contiguous(), name
        back = ffn_to_hf(family, from_file, cfg, i)
        assert back.keys() == {f"model.layers.{i}.{name}" for name in shapes}
        for name, t in back.items():
            assert torch.equal(t, files[name]), name
    assert named == ffn_names  # every FFN tensor of the file, nothing else


@pytest.mark.integration
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen2_moe"])
def test_dense_blocks_ffn_equals_transformers_mlp(family: str, gen: torch.Generator) -> None:
    """A dense block's FFN as ``Block`` builds it (``DenseFFN``: width ``dense_hidden``, SwiGLU,
    no biases) equals the family's dense MLP (DeepSeek-V3's first blocks, Qwen's
    ``mlp_only_layers``) on its tensors, outputs and gradients in fp64."""
    model, cfg = _hf_model(family, gen)
    model = model.double()
    i = next(i for i in range(cfg.n_layers) if not cfg.is_moe_layer(i))
    mlp = model.model.layers[i].mlp
    ffn = Block(cfg, cfg.is_moe_layer(i), dtype=torch.float64).ffn
    assert isinstance(ffn, moeflow.experts.DenseFFN) and ffn.proj_out.weight.shape == (D, 20)
    state = ffn_from_hf(family, model.state_dict(), cfg, i)
    ffn.load_state_dict({k.removeprefix(f"layers.{i}.ffn."): v for k, v in state.items()})
    x = torch.randn(5, D, generator=gen, dtype=torch.float64)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_hf, y = mlp(x_hf), ffn(x_ours)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y_hf.backward(dy)
    y.backward(dy)
    assert rel_err(y, y_hf) <= 1e-12 and rel_err(x_ours.grad, x_hf.grad) <= 1e-12
    hf_grads = {f"model.layers.{i}.mlp.{n}": p.grad for n, p in mlp.named_parameters()}
    want = ffn_from_hf(family, hf_grads, cfg, i)
    for name, p in ffn.named_parameters():
        assert rel_err(p.grad, want[f"layers.{i}.ffn.{name}"]) <= 1e-12, name


# ------------------------------------------------------------------------------ the config map

BASE = {  # family -> a minimal config.json of it
    "mixtral": dict(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, intermediate_size=64),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    "olmoe": dict(model_type="olmoe", num_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "deepseek_v3": dict(model_type="deepseek_v3", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_group=4, topk_group=2, first_k_dense_replace=1, intermediate_size=64, n_shared_experts=1,
                        routed_scaling_factor=2.5, topk_method="noaux_tc", scoring_func="sigmoid"),
    "gpt_oss": dict(model_type="gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    swiglu_alpha=1.702, swiglu_limit=7.0),
}


@pytest.mark.unit
def test_config_map_per_family() -> None:
    """What each family's fields become, the router dtype decision included (DeepSeek-V3 fp32,
    as transformers computes it; the others the input's), and every field read is declared."""
    fields = {family: moe_fields_from_hf(hf) for family, hf in BASE.items()}
    assert all(set(f) == set(FFN_FIELDS) and f["capacity_factor"] == 0.0 for f in fields.values())
    for family, hf in BASE.items():
        assert set(hf) - {"model_type"} <= MOE_KEYS[family], family
    assert fields["mixtral"]["router"] == RouterConfig(scoring="topk_softmax", load_balance_coef=0.001)
    q2 = fields["qwen2_moe"]
    assert (q2["router"].scoring, q2["router"].normalize_topk, q2["num_shared_experts"], q2["shared_hidden"],
            q2["shared_gate"], q2["dense_layers"], q2["dense_hidden"]) == ("softmax", False, 1, 48, True, (), None)
    q3 = moe_fields_from_hf(dict(BASE["qwen3_moe"], norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3, 1],
                                 intermediate_size=64))
    assert (q3["router"].normalize_topk, q3["moe_every"], q3["dense_layers"], q3["dense_hidden"]) == (True, 2, (1, 3), 64)
    ds = fields["deepseek_v3"]
    assert ds["router"] == RouterConfig(scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5, num_groups=4,
                                        topk_groups=2, group_score="top2_sum", load_balance_coef=0.0,
                                        bias_update_rate=1e-3, dtype=torch.float32)
    assert (ds["num_shared_experts"], ds["shared_hidden"], ds["shared_gate"], ds["dense_layers"], ds["dense_hidden"]) \
        == (1, 32, False, (0,), 64)
    assert fields["gpt_oss"]["router"] == RouterConfig(scoring="topk_softmax", bias=True, load_balance_coef=0.001)
    assert fields["gpt_oss"]["experts"] == ExpertsConfig(activation="swiglu_oai", bias=True)
    assert all(fields[f]["router"].dtype is None for f in FAMILIES if f != "deepseek_v3")
    assert moe_fields_from_hf(dict(BASE["olmoe"], num_local_experts=8))["num_experts"] == 8  # (an alias, agreeing)


@pytest.mark.unit
@pytest.mark.parametrize(("family", "change", "words"), [
    ("deepseek_v3", dict(topk_method="greedy"), ["topk_method", "greedy"]),
    ("deepseek_v3", dict(scoring_func="softmax"), ["scoring_func", "softmax"]),
    ("deepseek_v3", dict(moe_layer_freq=2), ["moe_layer_freq", "2"]),
    ("deepseek_v3", dict(n_group=3), ["n_group", "3"]),
    ("gpt_oss", dict(swiglu_limit=8.0), ["swiglu_limit", "8.0"]),
    ("gpt_oss", dict(swiglu_alpha=1.5), ["swiglu_alpha", "1.5"]),
    ("mixtral", dict(router_jitter_noise=0.1), ["router_jitter_noise", "0.1"]),
    ("qwen3_moe", dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    ("qwen3_moe", dict(norm_topk_prob="yes"), ["norm_topk_prob", "yes"]),
    ("qwen3_moe", dict(mlp_only_layers=[-1]), ["mlp_only_layers", "-1"]),
    ("qwen3_moe", dict(decoder_sparse_step=0), ["decoder_sparse_step", "0"]),
    ("qwen3_moe", dict(num_local_experts=6), ["num_experts=8", "num_local_experts=6"]),
    ("qwen3_moe", dict(num_experts_per_tok=None), ["num_experts_per_tok", "missing"]),
    ("olmoe", dict(router_aux_loss_coef=-1.0), ["router_aux_loss_coef", "-1.0"]),
    ("olmoe", dict(model_type="llama"), ["model_type", "llama"]),
])
def test_config_map_refuses_what_moeflow_cannot_express(family: str, change: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        moe_fields_from_hf({**BASE[family], **change})
    assert all(w in str(err.value) for w in words), str(err.value)


def _gpt(family: str, **changes: object) -> GPTConfig:
    fields = {**moe_fields_from_hf(BASE[family]), **changes}
    return GPTConfig(vocab_size=8, dim=16, n_layers=4, n_heads=2, **fields)


@pytest.mark.unit
@pytest.mark.parametrize("family", FAMILIES)
def test_config_map_back_to_hf(family: str) -> None:
    """``moe_fields_to_hf`` writes fields that map back to the same model, and refuses, naming
    the field, a model the family cannot express."""
    cfg = _gpt(family)
    hf = moe_fields_to_hf(family, cfg)
    assert set(hf) - {"model_type"} <= MOE_KEYS[family]
    back = moe_fields_from_hf(hf)
    assert {k: v for k, v in back.items() if k != "router"} == {
        k: v for k, v in moe_fields_from_hf(BASE[family]).items() if k != "router"}
    assert back["router"] == moe_fields_from_hf(BASE[family])["router"]
    refused = [("capacity_factor", dict(capacity_factor=1.0)),
               ("experts", dict(experts=ExpertsConfig(activation="geglu"))),
               ("router", dict(router=RouterConfig(scoring="sigmoid", num_groups=2, group_score="max")))]
    if family != "qwen2_moe":
        refused.append(("shared", dict(num_shared_experts=1, shared_hidden=24, shared_gate=True)))
    if family not in ("qwen2_moe", "qwen3_moe", "deepseek_v3"):
        refused.append(("dense_layers", dict(dense_layers=(1,))))
    for name, change in refused:
        with pytest.raises(ValueError, match=f"cannot export to {family}: {name}"):
            moe_fields_to_hf(family, _gpt(family, **change))


@pytest.mark.unit
def test_equivalent_models_export() -> None:
    """What differs in the fields but not in the model exports: a Mixtral router written as
    softmax then renormalised top-k, shared experts split differently, training settings."""
    mixtral = _gpt("mixtral", router=RouterConfig(scoring="softmax", normalize_topk=True, z_loss_coef=0.1, noise_std=1.0))
    assert moe_fields_to_hf("mixtral", mixtral)["router_aux_loss_coef"] == 0.01
    qwen3 = _gpt("qwen3_moe", router=RouterConfig(scoring="topk_softmax"))
    assert moe_fields_to_hf("qwen3_moe", qwen3)["norm_topk_prob"] is True
    qwen2 = _gpt("qwen2_moe", num_shared_experts=2, shared_hidden=None, expert_hidden=24)
    assert moe_fields_to_hf("qwen2_moe", qwen2)["shared_expert_intermediate_size"] == 48
    with pytest.raises(ValueError, match="dense_layers=\\(2,\\)"):
        moe_fields_to_hf("deepseek_v3", _gpt("deepseek_v3", dense_layers=(2,)))
    assert math.isclose(moe_fields_to_hf("deepseek_v3", _gpt("deepseek_v3"))["routed_scaling_factor"], 2.5)
