"""Tier 1: model and training configs validate on construction (no compute)."""

from __future__ import annotations

import json

import pytest

from moeflow.models import GPT_PRESETS, GPTConfig, ViTMoEConfig, gpt_config
from moeflow.train import LMTrainConfig
from moeflow.train.vision import VisionTrainConfig


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
def test_every_preset_builds_a_valid_config(name: str) -> None:
    cfg = gpt_config(name, vocab_size=256)
    assert cfg.vocab_size == 256 and cfg.dim % cfg.n_heads == 0
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    # the dict is what a checkpoint gives back after JSON (resume compares the two)
    assert json.loads(json.dumps(cfg.to_dict())) == cfg.to_dict()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(n_heads=3), "n_heads"),
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(top_k=9), "top_k"),
        (dict(moe_every=-1), "moe_every"),
        (dict(dropout=1.0), "dropout"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(norm_eps=0.0), "norm_eps"),
    ],
)
def test_gpt_config_rejects_bad_values(fields: dict, match: str) -> None:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, num_experts=8)
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**base, **fields})


def test_gpt_config_from_dict_rejects_unknown_fields() -> None:
    d = gpt_config("tiny", vocab_size=10).to_dict()
    d["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        GPTConfig.from_dict(d)


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ValueError, match="preset.*'huge'"):
        gpt_config("huge")


def test_vit_config_checks_patch_and_heads() -> None:
    with pytest.raises(ValueError, match="patch_size"):
        ViTMoEConfig(image_size=8, patch_size=3, num_classes=10)
    with pytest.raises(ValueError, match="heads"):
        ViTMoEConfig(image_size=8, patch_size=2, num_classes=10, dim=30, heads=4)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(tokenizer="words"), "tokenizer"),
        (dict(batch_size=10, grad_accum=4), "grad_accum"),
        (dict(lr=-1.0), "lr"),
        (dict(min_lr=1.0), "min_lr"),
        (dict(amp="fp8"), "amp"),
        (dict(preset="nope"), "preset"),
        (dict(top_k=20), "top_k"),
        (dict(steps=0), "steps"),
    ],
)
def test_train_config_rejects_bad_values(tmp_path, fields: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LMTrainConfig(out_dir=tmp_path, **fields)


def test_train_config_round_trips_through_json_dict(tmp_path) -> None:
    cfg = LMTrainConfig(out_dir=tmp_path, steps=7, val_works=("hamlet",), load_balance_coef=0.0)
    assert LMTrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.model_config(vocab_size=256).router.load_balance_coef == 0.0


def test_vision_train_config_rejects_unknown_router() -> None:
    with pytest.raises(ValueError, match="router kind"):
        VisionTrainConfig(router="dot")
