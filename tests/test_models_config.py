"""``GPTConfig``'s family fields (``AttentionConfig``, ``RopeScaling``, dense layers, shared
experts): validated on construction with the field and value named, saved and read back."""

from __future__ import annotations

import pytest

from moeflow.models.gpt_config import AttentionConfig, GPTConfig, RopeScaling

pytestmark = pytest.mark.unit

BASE = dict(vocab_size=32, dim=48, n_layers=3, n_heads=4)


def test_every_family_field_round_trips_through_the_saved_dict():
    cfg = GPTConfig(**BASE, attention=AttentionConfig(head_dim=16, qk_norm="head", qkv_bias=True, o_bias=True,
                                                       clip_qkv=8.0, sliding_window=8, sliding_layers=(0, 2),
                                                       sinks=True, rotary_fraction=0.5, rope_interleaved=True),
                    rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=64, mscale=1.0,
                                             mscale_all_dim=1.0, truncate=False),
                    dense_layers=(0,), num_shared_experts=1, shared_hidden=40, shared_gate=True)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    mla = GPTConfig(**BASE, attention=AttentionConfig(kind="mla", q_lora_rank=24, kv_lora_rank=16,
                                                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8))
    assert GPTConfig.from_dict(mla.to_dict()) == mla
    assert (cfg.head_dim, cfg.rotary_dim, mla.rotary_dim) == (16, 8, 4)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert [cfg.attention.slides(i) for i in range(3)] == [True, False, True]
    assert AttentionConfig(sliding_window=4).slides(7)  # no layers named: every block slides
    moe = cfg.moe_config()
    assert (moe.num_shared_experts, moe.shared_hidden, moe.shared_gate) == (1, 40, True)


def test_a_saved_config_from_before_the_family_fields_reads_with_their_defaults():
    old = GPTConfig(**BASE).to_dict()
    for key in ("attention", "rope_scaling", "dense_layers", "shared_hidden", "shared_gate"):
        old.pop(key)
    assert GPTConfig.from_dict(old) == GPTConfig(**BASE)


@pytest.mark.parametrize("fields, match", [
    (dict(attention=AttentionConfig(head_dim=15)), r"head_dim=15 x rotary_fraction=1.0 = 15\) must be even"),
    (dict(attention=AttentionConfig(head_dim=16, rotary_fraction=0.1)), "must be even and >= 2"),
    (dict(dim=50), "dim=50 must split into n_heads=4"),
    (dict(dense_layers=(3,)), "dense_layers holds 3"),
    (dict(attention=AttentionConfig(sliding_window=4, sliding_layers=(5,))), "sliding_layers holds 5"),
    (dict(shared_hidden=0), "shared_hidden"),
    (dict(attention={"head_dim": 16}), "attention must be an AttentionConfig"),
    (dict(rope_scaling={"kind": "yarn"}), "rope_scaling must be a RopeScaling"),
])
def test_bad_model_fields_are_named(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GPTConfig(**{**BASE, **fields})


@pytest.mark.parametrize("make, match", [
    (lambda: AttentionConfig(kind="sparse"), "kind must be 'gqa' or 'mla'"),
    (lambda: AttentionConfig(qk_norm="layer"), "qk_norm must be"),
    (lambda: AttentionConfig(sliding_layers=(1,)), r"sliding_layers=\(1,\) needs a sliding_window"),
    (lambda: AttentionConfig(clip_qkv=0.0), "clip_qkv must be a finite number > 0"),
    (lambda: AttentionConfig(rotary_fraction=1.5), "rotary_fraction must be in"),
    (lambda: AttentionConfig(sinks=1), "sinks must be a bool"),
    (lambda: AttentionConfig(kind="mla", qk_norm="head"), "qk_norm='head' is a grouped-query option"),
    (lambda: AttentionConfig(kind="mla", qk_rope_head_dim=5), "qk_rope_head_dim must be even"),
    (lambda: RopeScaling(kind="ntk", factor=2.0), "kind must be 'linear' or 'yarn'"),
    (lambda: RopeScaling(kind="yarn", factor=2.0), "needs original_max_seq_len"),
    (lambda: RopeScaling(kind="linear", factor=float("inf")), "factor must be a finite number > 0"),
    (lambda: RopeScaling(kind="linear", factor=2.0, mscale=-1.0), "mscale must be"),
])
def test_bad_attention_and_rope_fields_are_named(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()
