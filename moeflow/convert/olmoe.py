"""The OLMoE family (``model_type`` ``"olmoe"``): its ``config.json`` and tensors, both ways.

An OLMoE is a ``MoEGPT`` whose queries and keys are RMS-normalised over the whole projection
before the head split (``qk_norm="proj"``, always), then queries, keys and values clamped to
``clip_qkv`` where it is set; biases on all four projections when ``attention_bias``; an MoE
on every block with softmax top-k routing (renormalised with ``norm_topk_prob``); no sliding
window. The shared fields and tensor names are ``moeflow.convert.gqa``'s.

transformers' OLMoE sizes its query norm ``hidden_size`` and its key norm ``hidden_size //
num_attention_heads * num_key_value_heads``, so a ``head_dim`` other than ``hidden_size //
num_attention_heads`` would not load there; it is refused.

``OLMOE`` is the family ``moeflow.convert.hf`` registers.
"""

from __future__ import annotations

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.family import Family
from moeflow.convert.gqa import (Defaults, check_exportable, config_from_fields, decoder_entries, hf_config_common,
                                 open_fields)
from moeflow.convert.tensor_map import Entry
from moeflow.models.gpt_config import GPTConfig

__all__ = ["OLMOE", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map"]

DEFAULTS = Defaults(kv_heads=None, head_dim=None, max_len=4096, eps=1e-5, theta=10000.0)


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to an OLMoE ``config.json`` dict; ``CheckpointError`` naming
    the field for a missing or mistyped field, a value moeflow cannot express, and any field it
    does not know."""
    f = open_fields(hf, "olmoe", "OLMoE")
    D, N = f.get("hidden_size", "count"), f.get("num_attention_heads", "count")
    head_dim = f.get("head_dim", "count", None)
    if D % N or head_dim not in (None, D // N):
        raise CheckpointError(f"config.json: head_dim={head_dim!r} with hidden_size={D} and num_attention_heads={N} "
                              "is not supported: OLMoE's query/key norms need head_dim = hidden_size / "
                              "num_attention_heads")
    bias = f.get("attention_bias", "bool", False)
    attention = dict(qk_norm="proj", qkv_bias=bias, o_bias=bias, clip_qkv=f.get("clip_qkv", "number", None))
    return config_from_fields(f, "olmoe", DEFAULTS, attention)


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """OLMoE ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field when
    the model is not OLMoE-shaped (whole-projection QK norms, the same bias on all four
    projections, no window or sinks, OLMoE's FFN)."""
    a = cfg.attention
    check_exportable(cfg, "OLMoE", {
        "attention.qk_norm": (a.qk_norm, "proj"), "attention.o_bias": (a.o_bias, a.qkv_bias),
        "attention.sinks": (a.sinks, False), "attention.sliding_window": (a.sliding_window, None),
        "attention.head_dim": (cfg.head_dim, cfg.dim // cfg.n_heads if cfg.dim % cfg.n_heads == 0 else None),
    })
    return {**hf_config_common(cfg, "olmoe", "OlmoeForCausalLM"), "attention_bias": a.qkv_bias,
            "clip_qkv": a.clip_qkv}


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of an OLMoE and where it lives (``moeflow.convert.gqa``)."""
    return decoder_entries("olmoe", cfg)


OLMOE = Family(model_type="olmoe", name="OLMoE", config_from_hf=gpt_config_from_hf,
               hf_config_from=hf_config_from_gpt, tensor_map=tensor_map)
