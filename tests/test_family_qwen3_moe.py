"""The Qwen3-MoE family (``moeflow.convert.qwen3_moe``) on moeflow's engine, against transformers'
``Qwen3MoeForCausalLM`` (the checks are ``family_checks``'): a tiny model with per-head QK norms,
a ``head_dim`` of its own, biases on all four projections, a sliding window on every block,
YaRN, renormalised top-k routing and a dense block (``mlp_only_layers``); its config map and
every refusal without transformers.
"""

from __future__ import annotations

import pytest

from moeflow.convert.qwen3_moe import QWEN3_MOE, gpt_config_from_hf, hf_config_from_gpt
from moeflow.models.gpt_config import RopeScaling

import family_checks as fc

FIELDS = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
              norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1, attention_bias=True,
              use_sliding_window=True, sliding_window=5, max_position_embeddings=64, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                               "original_max_position_embeddings": 16},
              router_aux_loss_coef=0.02, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
              eos_token_id=None)
# what save_pretrained writes for FIELDS (the unit tests need no transformers)
SAVED = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_dropout": 0.0,
         "hidden_act": "silu", "initializer_range": 0.02, "output_router_logits": False, "use_cache": True,
         "transformers_version": "5.23.0", "dtype": "float32",
         **{k: v for k, v in FIELDS.items() if k != "num_experts"}, "num_local_experts": 4}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    tf = fc.transformers()
    return fc.save_random(tf.Qwen3MoeConfig(**FIELDS), tmp_path_factory.mktemp("qwen3_moe"), seed=31)


@pytest.mark.unit
def test_config_maps_every_field() -> None:
    cfg = gpt_config_from_hf(SAVED)
    a = cfg.attention
    assert (a.qk_norm, a.head_dim, a.qkv_bias, a.o_bias, a.sliding_window, a.sliding_layers) == \
        ("head", 12, True, True, 5, ())
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.vocab_size, cfg.max_seq_len) == (32, 3, 4, 2, 97, 64)
    assert cfg.rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16) and cfg.rope_theta == 500
    assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True] and cfg.dense_hidden == 24
    assert (cfg.num_experts, cfg.top_k, cfg.expert_hidden, cfg.router.normalize_topk) == (4, 2, 8, True)
    assert (cfg.norm_eps, cfg.router.load_balance_coef, cfg.tie_embeddings) == (1e-6, 0.02, False)
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg
    # the window counts only with use_sliding_window (transformers' Qwen3MoeConfig ignores it otherwise)
    off = gpt_config_from_hf({**SAVED, "use_sliding_window": False, "max_window_layers": 2})
    assert off.attention.sliding_window is None
    assert gpt_config_from_hf({**SAVED, "head_dim": 8, "attention_bias": False}).attention.head_dim is None


@pytest.mark.unit
@pytest.mark.parametrize("edit,words", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types="),
    ({"qk_layernorm": True}, "qk_layernorm=True"),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"use_sliding_window": "yes"}, "use_sliding_window='yes'"),
    ({"mlp_only_layers": [7]}, "dense_layers holds 7"),
    ({"num_key_value_heads": 3}, "n_kv_heads=3"),
    ({"num_experts_per_tok": 5}, "top_k"),
    ({"num_experts": 6}, "disagree"),
    ({"hidden_size": fc.DELETE}, "'hidden_size' is missing"),
    ({"model_type": "qwen2_moe"}, "is not 'qwen3_moe'"),
])
def test_config_refuses_what_it_cannot_express(edit: dict, words: str) -> None:
    fc.check_refusal(gpt_config_from_hf, SAVED, edit, words)


@pytest.mark.unit
@pytest.mark.parametrize("change,words", [
    (dict(qk_norm="proj"), "attention.qk_norm='proj'"),
    (dict(o_bias=False), "attention.o_bias=False"),
    (dict(sinks=True), "attention.sinks=True"),
    (dict(sliding_layers=(0,)), "attention.sliding_layers=(0,)"),
    (dict(rope_interleaved=True), "attention.rope_interleaved=True"),
])
def test_export_refuses_what_qwen3_moe_cannot_hold(change: dict, words: str) -> None:
    import dataclasses

    cfg = gpt_config_from_hf(SAVED)
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **change))
    with pytest.raises(ValueError, match="cannot export to Qwen3-MoE") as err:
        QWEN3_MOE.hf_config_from(cfg)
    assert words in str(err.value)


@pytest.mark.integration
def test_config_map_reads_what_transformers_reads() -> None:
    """The config transformers' class writes maps to the same model (class defaults too)."""
    tf = fc.transformers()
    bare = tf.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2, hidden_size=32,
                             num_attention_heads=4, num_hidden_layers=2, vocab_size=97).to_diff_dict()
    cfg = gpt_config_from_hf(bare)
    assert (cfg.kv_heads, cfg.norm_eps, cfg.rope_theta, cfg.max_seq_len) == (4, 1e-6, 10000.0, 32768)
    assert cfg.attention.sliding_window is None and cfg.attention.head_dim is None
    written = tf.Qwen3MoeConfig.from_dict(hf_config_from_gpt(gpt_config_from_hf(SAVED)))
    assert (written.head_dim, written.sliding_window, written.mlp_only_layers, written.num_experts) == (12, 5, [1], 4)


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
