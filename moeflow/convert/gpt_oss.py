"""The gpt-oss family (``model_type`` ``"gpt_oss"``): its ``config.json`` and tensors, both ways.

A gpt-oss is a ``MoEGPT`` whose attention has a learned sink logit per head in every softmax
(``sinks``, always), biases on all four projections when ``attention_bias`` (on unless the
config says otherwise), its own ``head_dim`` (64 unless given) and a sliding window on the
blocks ``layer_types`` names (when absent: the even-numbered blocks, transformers' default);
an MoE on every block, routed by a router with a bias (softmax over the top-k logits) to
experts with biases and the clamped SwiGLU (``swiglu_oai``). The shared fields and tensor names
are ``moeflow.convert.gqa``'s.

RoPE: a config without ``rope_parameters`` (or the older ``rope_scaling``) is YaRN with
transformers' gpt-oss defaults (``DEFAULT_ROPE``) over ``rope_theta`` (150000 unless given).
Published configs also carry two fields of the original release that transformers does not
read: ``experts_per_token`` (checked to equal ``num_experts_per_tok``) and
``initial_context_length``.

The published checkpoints store the experts' two weights in MXFP4 (``*_blocks`` and
``*_scales``, ``quantization_config.quant_method="mxfp4"``): dequantised at load by
``moeflow.convert.quant``; ``--to-hf`` writes them unquantised.

``GPT_OSS`` is the family ``moeflow.convert.hf`` registers.
"""

from __future__ import annotations

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.family import Family
from moeflow.convert.gqa import (SLIDING, FULL, Defaults, check_exportable, config_from_fields, decoder_entries,
                                 hf_config_common, layer_types, open_fields, sliding_from_layer_types)
from moeflow.convert.tensor_map import Entry
from moeflow.models.gpt_config import GPTConfig

__all__ = ["GPT_OSS", "DEFAULT_ROPE", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map"]

DEFAULTS = Defaults(kv_heads=8, head_dim=64, max_len=131072, eps=1e-5, theta=150000.0)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_WINDOW = 128  # transformers' GptOssConfig.sliding_window


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a gpt-oss ``config.json`` dict; ``CheckpointError`` naming
    the field for a missing or mistyped field, a value moeflow cannot express, and any field it
    does not know."""
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf = {**hf, "rope_parameters": DEFAULT_ROPE}
    f = open_fields(hf, "gpt_oss", "gpt-oss")
    n = f.get("num_hidden_layers", "count")
    k, legacy_k = f.get("num_experts_per_tok", "count"), f.get("experts_per_token", "count", None)
    if legacy_k not in (None, k):
        raise CheckpointError(f"config.json: experts_per_token={legacy_k} and num_experts_per_tok={k} disagree")
    f.get("initial_context_length", "count", None)  # (not read by transformers: module docstring)
    window = f.get("sliding_window", "count", None) if "sliding_window" in hf else DEFAULT_WINDOW
    types = f.get("layer_types", "list", None)
    if types is None:  # transformers' GptOssConfig default
        types = [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    bias = f.get("attention_bias", "bool", True)
    attention = dict(qkv_bias=bias, o_bias=bias, sinks=True, **sliding_from_layer_types(f, types, window))
    return config_from_fields(f, "gpt_oss", DEFAULTS, attention)


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """gpt-oss ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field when
    the model is not gpt-oss-shaped (sinks, no QK norms, the same bias on all four projections,
    gpt-oss's FFN)."""
    a = cfg.attention
    check_exportable(cfg, "gpt-oss", {
        "attention.sinks": (a.sinks, True), "attention.qk_norm": (a.qk_norm, "none"),
        "attention.o_bias": (a.o_bias, a.qkv_bias), "attention.clip_qkv": (a.clip_qkv, None),
    })
    # transformers builds a sliding mask whether or not a block slides: it needs a window
    return {**hf_config_common(cfg, "gpt_oss", "GptOssForCausalLM"), "head_dim": cfg.head_dim,
            "attention_bias": a.qkv_bias, "sliding_window": a.sliding_window or DEFAULT_WINDOW,
            "layer_types": layer_types(cfg)}


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of a gpt-oss and where it lives (``moeflow.convert.gqa``)."""
    return decoder_entries("gpt_oss", cfg)


GPT_OSS = Family(model_type="gpt_oss", name="gpt-oss", config_from_hf=gpt_config_from_hf,
                 hf_config_from=hf_config_from_gpt, tensor_map=tensor_map)
