"""The Qwen2-MoE family (``moeflow.convert.qwen2_moe``) on moeflow's engine, against transformers'
``Qwen2MoeForCausalLM`` (the checks are ``family_checks``'): a tiny model with query/key/value
biases, a ``head_dim`` of its own, sliding windows on the blocks ``max_window_layers`` picks,
linear RoPE scaling, a gated shared expert, dense blocks between MoE ones
(``decoder_sparse_step=2``) and tied embeddings; its config map and every refusal without
transformers.
"""

from __future__ import annotations

import dataclasses

import pytest

from moeflow.convert.qwen2_moe import QWEN2_MOE, gpt_config_from_hf, hf_config_from_gpt
from moeflow.models.gpt_config import RopeScaling

import family_checks as fc

S, F = "sliding_attention", "full_attention"
FIELDS = dict(vocab_size=97, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, moe_intermediate_size=8, shared_expert_intermediate_size=12,
              num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, qkv_bias=True,
              use_sliding_window=True, sliding_window=5, max_window_layers=3, max_position_embeddings=64,
              rope_parameters={"rope_type": "linear", "rope_theta": 300.0, "factor": 2.0}, tie_word_embeddings=True,
              router_aux_loss_coef=0.02, pad_token_id=None, bos_token_id=None, eos_token_id=None)
# what save_pretrained writes for FIELDS (the unit tests need no transformers)
SAVED = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
         "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6, "output_router_logits": False,
         "use_cache": True, "transformers_version": "5.23.0", "dtype": "float32", "mlp_only_layers": [],
         "layer_types": [S, F, S, F], **FIELDS}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):  # type: ignore[no-untyped-def]
    tf = fc.transformers()
    return fc.save_random(tf.Qwen2MoeConfig(**FIELDS), tmp_path_factory.mktemp("qwen2_moe"), seed=32)


@pytest.mark.unit
def test_config_maps_every_field() -> None:
    cfg = gpt_config_from_hf(SAVED)
    a = cfg.attention
    assert (a.qk_norm, a.head_dim, a.qkv_bias, a.o_bias, a.sliding_window, a.sliding_layers) == \
        ("none", 12, True, False, 5, (0, 2))
    assert cfg.rope_scaling == RopeScaling(kind="linear", factor=2.0) and cfg.rope_theta == 300.0
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True] and cfg.dense_hidden == 24
    assert (cfg.num_shared_experts, cfg.shared_hidden, cfg.shared_gate) == (1, 12, True)
    assert (cfg.num_experts, cfg.top_k, cfg.expert_hidden, cfg.router.normalize_topk) == (4, 2, 8, False)
    assert (cfg.tie_embeddings, cfg.norm_eps, cfg.router.load_balance_coef) == (True, 1e-6, 0.02)
    assert gpt_config_from_hf(hf_config_from_gpt(cfg)) == cfg
    # without layer_types: transformers' default (even blocks below max_window_layers, with the window on)
    assert gpt_config_from_hf({**SAVED, "layer_types": None}).attention.sliding_layers == (0, 2)
    off = gpt_config_from_hf({**SAVED, "layer_types": None, "use_sliding_window": False, "sliding_window": 0})
    assert off.attention.sliding_window is None
    assert gpt_config_from_hf({**SAVED, "layer_types": [S] * 4}).attention.sliding_layers == ()  # (every block)
    assert gpt_config_from_hf(fc.edited(SAVED, {"qkv_bias": fc.DELETE, "head_dim": 8})).attention.head_dim is None


@pytest.mark.unit
@pytest.mark.parametrize("edit,words", [
    ({"layer_types": [S, F, S, F], "use_sliding_window": False}, "the window is 0"),
    ({"layer_types": [S, F, S]}, "layer_types="),
    ({"layer_types": [S, F, "chunked_attention", F]}, "layer_types="),
    ({"sliding_window": None}, "the window is None"),
    ({"sliding_window": -1}, "sliding_window=-1"),
    ({"max_window_layers": "all"}, "max_window_layers='all'"),
    ({"attention_bias": True}, "attention_bias=True"),  # Qwen2-MoE's bias field is qkv_bias
    ({"clip_qkv": 1.0}, "clip_qkv=1.0"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ({"mlp_only_layers": "0"}, "mlp_only_layers='0'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_dropout": 0.5}, "attention_dropout=0.5"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_type='llama3'"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1"),
    ({"vocab_size": fc.DELETE}, "'vocab_size' is missing"),
])
def test_config_refuses_what_it_cannot_express(edit: dict, words: str) -> None:
    fc.check_refusal(gpt_config_from_hf, SAVED, edit, words)


@pytest.mark.unit
@pytest.mark.parametrize("change,words", [
    (dict(qk_norm="head"), "attention.qk_norm='head'"),
    (dict(o_bias=True), "attention.o_bias=True"),
    (dict(clip_qkv=2.0), "attention.clip_qkv=2.0"),
    (dict(sinks=True), "attention.sinks=True"),
])
def test_export_refuses_what_qwen2_moe_cannot_hold(change: dict, words: str) -> None:
    cfg = gpt_config_from_hf(SAVED)
    cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, **change))
    with pytest.raises(ValueError, match="cannot export to Qwen2-MoE") as err:
        QWEN2_MOE.hf_config_from(cfg)
    assert words in str(err.value)


@pytest.mark.unit
def test_export_refuses_an_ungated_shared_expert() -> None:
    """(The FFN's checks are ``moe_blocks.moe_fields_to_hf``'s.)"""
    with pytest.raises(ValueError, match="cannot export to qwen2_moe: shared_gate=False"):
        QWEN2_MOE.hf_config_from(dataclasses.replace(gpt_config_from_hf(SAVED), shared_gate=False))


@pytest.mark.integration
def test_config_map_reads_what_transformers_reads() -> None:
    """transformers' own defaults (its layer_types from max_window_layers, the window only with
    use_sliding_window) and the config moeflow writes, read back by transformers' class."""
    tf = fc.transformers()
    for use, below in ((True, 3), (True, 1), (False, 4)):
        hf = tf.Qwen2MoeConfig(**{**FIELDS, "use_sliding_window": use, "max_window_layers": below})
        ours = gpt_config_from_hf({k: v for k, v in hf.to_diff_dict().items() if k != "layer_types"})
        assert [ours.attention.slides(i) for i in range(4)] == [t == S for t in hf.layer_types], (use, below)
    bare = tf.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=8, num_experts_per_tok=2, hidden_size=32,
                             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=97)
    cfg = gpt_config_from_hf(bare.to_diff_dict())
    assert (cfg.attention.qkv_bias, cfg.attention.sliding_window, cfg.rope_theta) == (True, None, 10000.0)
    written = tf.Qwen2MoeConfig.from_dict(hf_config_from_gpt(gpt_config_from_hf(SAVED)))
    assert (written.layer_types, written.sliding_window, written.head_dim, written.decoder_sparse_step) == \
        ([S, F, S, F], 5, 12, 2)


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
