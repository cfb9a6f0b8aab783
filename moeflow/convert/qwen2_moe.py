"""The Qwen2-MoE family (``model_type`` ``"qwen2_moe"``): its ``config.json`` and tensors, both ways.

A Qwen2-MoE is a ``MoEGPT`` with grouped-query attention with biases on the query, key and
value projections (``qkv_bias``, on unless the config says otherwise; never on the output
projection), softmax top-k routing (renormalised with ``norm_topk_prob``), one shared expert
scaled by a sigmoid gate on every MoE block, and dense blocks where ``mlp_only_layers`` /
``decoder_sparse_step`` put them. The shared fields and tensor names are
``moeflow.convert.gqa``'s.

Sliding window, as transformers reads it: ``layer_types`` names the blocks that slide (when
absent: the even-numbered blocks below ``max_window_layers``, if ``use_sliding_window``);
they attend through ``sliding_window``, which counts only with ``use_sliding_window`` (without
it, a block named sliding is refused: transformers would give it a window of 0).

``QWEN2_MOE`` is the family ``moeflow.convert.hf`` registers.
"""

from __future__ import annotations

from moeflow.convert.family import Family
from moeflow.convert.gqa import (SLIDING, FULL, Defaults, check_exportable, config_from_fields, decoder_entries,
                                 hf_config_common, layer_types, open_fields, sliding_from_layer_types)
from moeflow.convert.tensor_map import Entry
from moeflow.models.gpt_config import GPTConfig

__all__ = ["QWEN2_MOE", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map"]

DEFAULTS = Defaults(kv_heads=16, head_dim=None, max_len=32768, eps=1e-6, theta=10000.0)


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a Qwen2-MoE ``config.json`` dict; ``CheckpointError``
    naming the field for a missing or mistyped field, a value moeflow cannot express, and any
    field it does not know."""
    f = open_fields(hf, "qwen2_moe", "Qwen2-MoE")
    n = f.get("num_hidden_layers", "count")
    slides = f.get("use_sliding_window", "bool", False)
    window = f.get("sliding_window", "index", None) if "sliding_window" in hf else 4096  # (null: no window)
    below = f.get("max_window_layers", "index", 28)
    types = f.get("layer_types", "list", None)
    if types is None:  # transformers' Qwen2MoeConfig default
        types = [SLIDING if (i + 1) % 2 and i < below and slides else FULL for i in range(n)]
    attention = dict(qkv_bias=f.get("qkv_bias", "bool", True),
                     **sliding_from_layer_types(f, types, window if slides else 0))
    return config_from_fields(f, "qwen2_moe", DEFAULTS, attention)


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """Qwen2-MoE ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field
    when the model is not Qwen2-MoE-shaped (no QK norms, biases on q/k/v only, Qwen2-MoE's
    FFN with its gated shared expert)."""
    a = cfg.attention
    check_exportable(cfg, "Qwen2-MoE", {
        "attention.qk_norm": (a.qk_norm, "none"), "attention.o_bias": (a.o_bias, False),
        "attention.clip_qkv": (a.clip_qkv, None), "attention.sinks": (a.sinks, False),
    })
    out = {**hf_config_common(cfg, "qwen2_moe", "Qwen2MoeForCausalLM"), "qkv_bias": a.qkv_bias,
           "use_sliding_window": a.sliding_window is not None, "sliding_window": a.sliding_window or 0,
           "max_window_layers": cfg.n_layers, "layer_types": layer_types(cfg)}
    if cfg.head_dim != cfg.dim // cfg.n_heads or cfg.dim % cfg.n_heads:
        out["head_dim"] = cfg.head_dim  # (transformers' Qwen2-MoE reads it where present)
    return out


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of a Qwen2-MoE and where it lives (``moeflow.convert.gqa``)."""
    return decoder_entries("qwen2_moe", cfg)


QWEN2_MOE = Family(model_type="qwen2_moe", name="Qwen2-MoE", config_from_hf=gpt_config_from_hf,
                   hf_config_from=hf_config_from_gpt, tensor_map=tensor_map)
