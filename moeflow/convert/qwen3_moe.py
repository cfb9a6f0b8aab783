"""The Qwen3-MoE family (``model_type`` ``"qwen3_moe"``): its ``config.json`` and tensors, both ways.

A Qwen3-MoE is a ``MoEGPT`` with grouped-query attention whose queries and keys are
RMS-normalised per head before the rotation (``qk_norm="head"``, always), a ``head_dim`` of its
own, biases on all four projections when ``attention_bias``, softmax top-k routing (renormalised
with ``norm_topk_prob``) and dense blocks where ``mlp_only_layers`` / ``decoder_sparse_step``
put them. The shared fields and tensor names are ``moeflow.convert.gqa``'s.

Sliding window: with ``use_sliding_window``, transformers' Qwen3-MoE makes every block attend
through ``sliding_window``; ``max_window_layers`` (published configs carry it) is not read by
transformers' Qwen3-MoE and so changes nothing here either. Without ``use_sliding_window`` the
window is ignored, as transformers ignores it.

``QWEN3_MOE`` is the family ``moeflow.convert.hf`` registers.
"""

from __future__ import annotations

from moeflow.convert.family import Family
from moeflow.convert.gqa import (Defaults, check_exportable, config_from_fields, decoder_entries, hf_config_common,
                                 open_fields)
from moeflow.convert.tensor_map import Entry
from moeflow.models.gpt_config import GPTConfig

__all__ = ["QWEN3_MOE", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map"]

DEFAULTS = Defaults(kv_heads=4, head_dim=None, max_len=32768, eps=1e-6, theta=10000.0)


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a Qwen3-MoE ``config.json`` dict; ``CheckpointError``
    naming the field for a missing or mistyped field, a value moeflow cannot express, and any
    field it does not know."""
    f = open_fields(hf, "qwen3_moe", "Qwen3-MoE")
    bias = f.get("attention_bias", "bool", False)
    slides = f.get("use_sliding_window", "bool", False)
    window = f.get("sliding_window", "count", None) if "sliding_window" in hf else 4096  # (null: no window)
    f.get("max_window_layers", "index", None)  # (not read by transformers' Qwen3-MoE: module docstring)
    attention = dict(qk_norm="head", qkv_bias=bias, o_bias=bias, sliding_window=window if slides else None)
    return config_from_fields(f, "qwen3_moe", DEFAULTS, attention)


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """Qwen3-MoE ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field
    when the model is not Qwen3-MoE-shaped (per-head QK norms, the same bias on all four
    projections, a window on every block or none, Qwen3-MoE's FFN)."""
    a = cfg.attention
    check_exportable(cfg, "Qwen3-MoE", {
        "attention.qk_norm": (a.qk_norm, "head"), "attention.o_bias": (a.o_bias, a.qkv_bias),
        "attention.clip_qkv": (a.clip_qkv, None), "attention.sinks": (a.sinks, False),
        "attention.sliding_layers": (a.sliding_layers, ()),
    })
    return {**hf_config_common(cfg, "qwen3_moe", "Qwen3MoeForCausalLM"), "head_dim": cfg.head_dim,
            "attention_bias": a.qkv_bias, "use_sliding_window": a.sliding_window is not None,
            "sliding_window": a.sliding_window}


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of a Qwen3-MoE and where it lives (``moeflow.convert.gqa``)."""
    return decoder_entries("qwen3_moe", cfg)


QWEN3_MOE = Family(model_type="qwen3_moe", name="Qwen3-MoE", config_from_hf=gpt_config_from_hf,
                   hf_config_from=hf_config_from_gpt, tensor_map=tensor_map)
