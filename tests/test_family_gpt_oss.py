"""The gpt-oss family (``moeflow.convert.gpt_oss``) on moeflow's engine, against transformers'
``GptOssForCausalLM`` (the checks are ``family_checks``'): a tiny model with attention sinks,
sliding windows on the blocks ``layer_types`` names, YaRN (untruncated), biases on all four
projections, a ``head_dim`` of its own, a router with a bias and experts with biases whose
clamped SwiGLU is reached (the expert weights are drawn wide enough that gate and up values pass
both clamps); an MXFP4 checkpoint made from it; its config map and every refusal without
transformers.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from moeflow.convert.gpt_oss import DEFAULT_ROPE, GPT_OSS, gpt_config_from_hf, hf_config_from_gpt
from moeflow.convert.hf import gpt_from_hf
from moeflow.convert.hf_model import state_dict_from_tensors
from moeflow.models.gpt_config import RopeScaling

import family_checks as fc
from helpers import rel_err

S, F = "sliding_attention", "full_attention"
FIELDS = dict(vocab_size=97, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2, attention_bias=True,
              sliding_window=5, max_position_embeddings=64, router_aux_loss_coef=0.02,
              rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                               "original_max_position_embeddings": 16, "truncate": False},
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
STD = {"experts.gate_up_proj": 0.8}  # (beyond swiglu_limit=7 for a share of the gate and up values)
# what save_pretrained writes for FIELDS (the unit tests need no transformers)
SAVED = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_dropout": 0.0,
         "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "output_router_logits": False,
         "use_cache": True, "tie_word_embeddings": False, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
         "layer_types": [S, F, S], "transformers_version": "5.23.0", "dtype": "float32", **FIELDS}
# the published checkpoints' (gpt-oss-20b): which modules stayed unquantised
NOT_QUANTISED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    tf = fc.transformers()
    return fc.save_random(tf.GptOssConfig(**FIELDS), tmp_path_factory.mktemp("gpt_oss"), seed=34, std=STD)


@pytest.mark.unit
def test_config_maps_every_field() -> None:
    cfg = gpt_config_from_hf(SAVED)
    a = cfg.attention
    assert (a.sinks, a.head_dim, a.qkv_bias, a.o_bias, a.qk_norm, a.sliding_window, a.sliding_layers) == \
        (True, 12, True, True, "none", 5, (0, 2))
    assert cfg.rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16, truncate=False)
    assert cfg.rope_theta == 500.0
    assert (cfg.experts.activation, cfg.experts.bias, cfg.router.bias, cfg.router.scoring) == \
        ("swiglu_oai", True, True, "topk_softmax")
    assert (cfg.num_experts, cfg.top_k, cfg.expert_hidden, cfg.router.load_balance_coef) == (4, 2, 32, 0.02)
    assert all(cfg.is_moe_layer(i) for i in range(3))
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg
    # transformers' defaults: YaRN without rope_parameters, sliding even blocks without layer_types,
    # head_dim 64, window 128; the original release's extra fields are read
    published = gpt_config_from_hf(fc.edited(SAVED, {
        "rope_parameters": fc.DELETE, "layer_types": fc.DELETE, "head_dim": fc.DELETE, "sliding_window": fc.DELETE,
        "rope_theta": 150000, "experts_per_token": 2, "initial_context_length": 4096}))
    assert published.rope_scaling == RopeScaling(kind="yarn", factor=32.0, original_max_seq_len=4096, truncate=False)
    assert (published.rope_theta, published.head_dim) == (150000.0, 64)
    assert (published.attention.sliding_window, published.attention.sliding_layers) == (128, (0, 2))
    old_style = gpt_config_from_hf(fc.edited(SAVED, {"rope_parameters": fc.DELETE, "rope_theta": 500.0,
                                                     "rope_scaling": FIELDS["rope_parameters"]}))
    assert (old_style.rope_scaling, old_style.rope_theta) == (cfg.rope_scaling, 500.0)
    full = gpt_config_from_hf({**SAVED, "layer_types": [F] * 3})
    assert full.attention.sliding_window is None and hf_config_from_gpt(full)["sliding_window"] == 128


@pytest.mark.unit
@pytest.mark.parametrize("edit,words", [
    ({"experts_per_token": 3}, "experts_per_token=3 and num_experts_per_tok=2 disagree"),
    ({"swiglu_limit": 5.0}, "swiglu_limit=5.0"),
    ({"swiglu_alpha": 1.0}, "swiglu_alpha=1.0"),
    ({"num_experts": 8}, "disagree"),
    ({"sliding_window": None}, "the window is None"),
    ({"layer_types": [S, F]}, "layer_types="),
    ({"attention_bias": "yes"}, "attention_bias='yes'"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
    ({"rope_parameters": {**FIELDS["rope_parameters"], "low_freq_factor": 1.0}}, "low_freq_factor"),
    ({"use_qk_norm": True}, "use_qk_norm=True"),
    ({"initial_context_length": "4k"}, "initial_context_length='4k'"),
    ({"head_dim": 0}, "head_dim=0"),
    ({"quantization_config": None, "attention_dropout": 0.2}, "attention_dropout=0.2"),
])
def test_config_refuses_what_it_cannot_express(edit: dict, words: str) -> None:
    fc.check_refusal(gpt_config_from_hf, SAVED, edit, words)


@pytest.mark.unit
@pytest.mark.parametrize("change,words", [
    (dict(sinks=False), "attention.sinks=False"),
    (dict(qk_norm="head"), "attention.qk_norm='head'"),
    (dict(o_bias=False), "attention.o_bias=False"),
    (dict(clip_qkv=3.0), "attention.clip_qkv=3.0"),
])
def test_export_refuses_what_gpt_oss_cannot_hold(change: dict, words: str) -> None:
    cfg = gpt_config_from_hf(SAVED)
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **change))
    with pytest.raises(ValueError, match="cannot export to gpt-oss") as err:
        GPT_OSS.hf_config_from(cfg)
    assert words in str(err.value)


@pytest.mark.integration
def test_config_map_reads_what_transformers_reads() -> None:
    tf = fc.transformers()
    bare = tf.GptOssConfig(num_local_experts=4, intermediate_size=32, num_experts_per_tok=2, hidden_size=32,
                           num_attention_heads=8, num_hidden_layers=3, vocab_size=97)
    assert {k: v for k, v in bare.rope_parameters.items() if k != "rope_theta"} == DEFAULT_ROPE
    cfg = gpt_config_from_hf(bare.to_diff_dict())
    assert [cfg.attention.slides(i) for i in range(3)] == [t == S for t in bare.layer_types]
    assert (cfg.head_dim, cfg.kv_heads, cfg.rope_theta, cfg.attention.sliding_window) == (64, 8, 150000.0, 128)
    written = tf.GptOssConfig.from_dict(hf_config_from_gpt(gpt_config_from_hf(SAVED)))
    assert (written.layer_types, written.sliding_window, written.head_dim, written.rope_parameters["truncate"]) == \
        ([S, F, S], 5, 12, False)


@pytest.mark.integration
@fc.DTYPES
def test_logits_of_a_left_padded_batch_equal_transformers(hf_dir, dtype) -> None:  # type: ignore[no-untyped-def]
    fc.check_logits(hf_dir, dtype, seed=1)


@pytest.mark.integration
@fc.DTYPES
def test_gradients_equal_transformers(hf_dir, dtype) -> None:  # type: ignore[no-untyped-def]
    fc.check_gradients(hf_dir, dtype, seed=2)


@pytest.mark.integration
def test_greedy_tokens_equal_transformers_eager_and_compiled(hf_dir) -> None:  # type: ignore[no-untyped-def]
    fc.check_generate(hf_dir, seed=3)


@pytest.mark.integration
def test_round_trip_through_transformers_changes_no_tensor(hf_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    fc.check_round_trip(hf_dir, tmp_path)


@pytest.mark.integration
def test_an_mxfp4_checkpoint_dequantises_to_the_reference(hf_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The tiny model's expert weights quantised to MXFP4 as the published checkpoints store them
    (``*_blocks [E, O, I/32, 16]``, ``*_scales [E, O, I/32]``, blocks along the input dimension;
    the test-side quantiser of test_convert_quant), with ``quantization_config``: the loaded
    model holds transformers' own dequantisation of them (``convert_moe_packed_tensors``) and
    every other tensor unchanged, and computes transformers' logits with those weights."""
    from safetensors.torch import save_file
    from test_convert_quant import quantise_mxfp4
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    files = fc.read_files(hf_dir)
    stored, reference = {}, {}
    for name, t in files.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, I, O]
            blocks, scales, _ = quantise_mxfp4(t.transpose(1, 2))
            stored.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
            reference[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert reference[name].shape == t.shape and 0 < rel_err(reference[name], t) < 0.25  # rounded, not lost
        else:
            stored[name] = t
    assert len(reference) == 2 * 3
    out = tmp_path / "mxfp4"
    out.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_QUANTISED}
    (out / "config.json").write_text(json.dumps(config))
    save_file(stored, str(out / "model.safetensors"))

    ours = gpt_from_hf(out)
    want = state_dict_from_tensors({**files, **reference}, GPT_OSS, ours.config)
    got = ours.state_dict()
    assert set(want) <= set(got)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    theirs = fc.load_hf(hf_dir, torch.float32).eval()
    with torch.no_grad():
        for name, t in reference.items():
            theirs.get_parameter(name).copy_(t)
        idx = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
        assert rel_err(ours.eval()(idx), theirs(input_ids=idx).logits) <= fc.TOL[torch.float32]


@pytest.mark.e2e
def test_cli_convert_round_trip(hf_dir, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    fc.check_cli_round_trip(hf_dir, tmp_path, capsys)


CASES = {"ep_step": fc.ep_step_case}


@pytest.mark.distributed
def test_expert_parallel_fine_tune_step_equals_one_process(hf_dir) -> None:  # type: ignore[no-untyped-def]
    from helpers import spawn_ranks

    spawn_ranks(2, __name__, "ep_step", str(hf_dir))
