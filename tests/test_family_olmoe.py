"""The OLMoE family (``moeflow.convert.olmoe``) on moeflow's engine, against transformers'
``OlmoeForCausalLM`` (the checks are ``family_checks``'): a tiny model with query/key norms over
the whole projections, ``clip_qkv`` (active: values lie beyond it), biases on all four
projections and renormalised top-k routing; its config map and every refusal without
transformers.
"""

from __future__ import annotations

import dataclasses

import pytest

from moeflow.convert.olmoe import OLMOE, gpt_config_from_hf, hf_config_from_gpt

import family_checks as fc

FIELDS = dict(vocab_size=97, hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, attention_bias=True,
              clip_qkv=1.0, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
              router_aux_loss_coef=0.02, rms_norm_eps=1e-5, pad_token_id=None, bos_token_id=None, eos_token_id=None)
# what save_pretrained writes for FIELDS (the unit tests need no transformers)
SAVED = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_dropout": 0.0,
         "hidden_act": "silu", "initializer_range": 0.02, "output_router_logits": False, "use_cache": True,
         "tie_word_embeddings": False, "transformers_version": "5.23.0", "dtype": "float32", **FIELDS}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    tf = fc.transformers()
    return fc.save_random(tf.OlmoeConfig(**FIELDS), tmp_path_factory.mktemp("olmoe"), seed=33)


@pytest.mark.unit
def test_config_maps_every_field() -> None:
    cfg = gpt_config_from_hf(SAVED)
    a = cfg.attention
    assert (a.qk_norm, a.head_dim, a.qkv_bias, a.o_bias, a.clip_qkv, a.sliding_window) == \
        ("proj", None, True, True, 1.0, None)
    assert cfg.rope_scaling is None and cfg.rope_theta == 500.0 and cfg.head_dim == 8
    assert all(cfg.is_moe_layer(i) for i in range(2)) and cfg.num_shared_experts == 0
    assert (cfg.num_experts, cfg.top_k, cfg.expert_hidden, cfg.router.normalize_topk) == (4, 2, 8, True)
    assert (cfg.norm_eps, cfg.router.load_balance_coef, cfg.kv_heads) == (1e-5, 0.02, 2)
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg
    # transformers' defaults where a field is absent
    bare = gpt_config_from_hf(fc.edited(SAVED, {k: fc.DELETE for k in (
        "num_key_value_heads", "clip_qkv", "attention_bias", "router_aux_loss_coef", "rms_norm_eps", "rope_parameters",
        "max_position_embeddings", "norm_topk_prob")}))
    assert (bare.kv_heads, bare.attention.clip_qkv, bare.attention.qkv_bias, bare.router.load_balance_coef) == \
        (4, None, False, 0.01)
    assert (bare.norm_eps, bare.rope_theta, bare.max_seq_len, bare.router.normalize_topk) == \
        (1e-5, 10000.0, 4096, False)


@pytest.mark.unit
@pytest.mark.parametrize("edit,words", [
    ({"head_dim": 12}, "head_dim=12"),
    ({"hidden_size": 30}, "hidden_size=30"),
    ({"clip_qkv": -1.0}, "clip_qkv=-1.0"),
    ({"clip_qkv": 0}, "clip_qkv must be a finite number > 0"),
    ({"sliding_window": 4}, "sliding_window=4"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({"qk_layernorm": False}, "qk_layernorm=False"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor=0.5"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "disagree"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok=0"),
    ({"hidden_act": "relu"}, "hidden_act='relu'"),
    ({"model_type": "olmo"}, "is not 'olmoe'"),
])
def test_config_refuses_what_it_cannot_express(edit: dict, words: str) -> None:
    fc.check_refusal(gpt_config_from_hf, SAVED, edit, words)


@pytest.mark.unit
@pytest.mark.parametrize("change,words", [
    (dict(qk_norm="head"), "attention.qk_norm='head'"),
    (dict(o_bias=False), "attention.o_bias=False"),
    (dict(sinks=True), "attention.sinks=True"),
    (dict(sliding_window=4), "attention.sliding_window=4"),
    (dict(head_dim=12), "attention.head_dim=12"),
])
def test_export_refuses_what_olmoe_cannot_hold(change: dict, words: str) -> None:
    cfg = gpt_config_from_hf(SAVED)
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **change))
    with pytest.raises(ValueError, match="cannot export to OLMoE") as err:
        OLMOE.hf_config_from(cfg)
    assert words in str(err.value)


@pytest.mark.integration
def test_config_map_reads_what_transformers_reads() -> None:
    tf = fc.transformers()
    bare = tf.OlmoeConfig(num_experts=4, intermediate_size=8, num_experts_per_tok=2, hidden_size=32,
                          num_attention_heads=4, num_hidden_layers=2, vocab_size=97, eos_token_id=None,
                          pad_token_id=None)
    cfg = gpt_config_from_hf(bare.to_diff_dict())
    assert (cfg.kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len, cfg.attention.clip_qkv) == \
        (4, 1e-5, 10000.0, 4096, None)
    written = tf.OlmoeConfig.from_dict(hf_config_from_gpt(gpt_config_from_hf(SAVED)))
    assert (written.clip_qkv, written.attention_bias, written.num_experts, written.norm_topk_prob) == \
        (1.0, True, 4, True)


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


@pytest.mark.e2e
def test_cli_convert_round_trip(hf_dir, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    fc.check_cli_round_trip(hf_dir, tmp_path, capsys)


CASES = {"ep_step": fc.ep_step_case}


@pytest.mark.distributed
def test_expert_parallel_fine_tune_step_equals_one_process(hf_dir) -> None:  # type: ignore[no-untyped-def]
    from helpers import spawn_ranks

    spawn_ranks(2, __name__, "ep_step", str(hf_dir))
