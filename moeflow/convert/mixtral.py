"""The Mixtral family (``model_type`` ``"mixtral"``): its ``config.json`` and tensors, both ways.

A Mixtral is a ``MoEGPT`` with an MoE on every block, SwiGLU experts, top-k-then-softmax routing
and untied embeddings, so its tensor map is renames plus the expert stacks. Mixtral checkpoints
on disk (the published ones, and what transformers 5 ``save_pretrained`` writes) keep one
``F.linear`` weight per expert: ``block_sparse_moe.experts.{e}.w1`` (gate, ``[H, D]``), ``w3``
(up) and ``w2`` (down, ``[D, H]``), and the router as ``block_sparse_moe.gate``.
transformers' in-memory layout (``mlp.experts.gate_up_proj [E, 2H, D]``, ``down_proj [E, D,
H]``, ``mlp.gate``) is read too. moeflow stores ``w_in [E, D, 2H]`` (gate columns, then up)
and ``w_out [E, H, D]``.

``MIXTRAL`` is the family ``moeflow.convert.hf`` registers. ``gpt_from_hf`` / ``gpt_to_hf``
here read and write Mixtral directories only (``moeflow.convert.hf``'s take any registered
family); ``state_dict_from_hf`` / ``state_dict_to_hf`` convert in memory.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moeflow.checkpoint.schema import CheckpointError
from moeflow.config import RouterConfig
from moeflow.convert.family import Family, Fields, rope_from_hf, rope_to_hf
from moeflow.convert.hf_files import DEFAULT_SHARD_SIZE
from moeflow.convert.hf_model import load_hf, save_hf, state_dict_from_tensors, state_dict_to_tensors
from moeflow.convert.tensor_map import Entry, fused_experts, linear_experts, rename, same
from moeflow.models.gpt import GPTConfig, MoEGPT
from moeflow.models.gpt_config import AttentionConfig

__all__ = ["MIXTRAL", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map", "state_dict_from_hf",
           "state_dict_to_hf", "gpt_from_hf", "gpt_to_hf"]

_DENSE = {  # moeflow name (per layer) -> HF name (per layer)
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a Mixtral ``config.json`` dict; ``CheckpointError`` naming
    the field for a missing or mistyped field, a value moeflow's GPT does not express (another
    activation, attention dropout, a RoPE type), and any field it does not know. ``head_dim``,
    ``sliding_window`` and ``partial_rotary_factor`` map onto ``GPTConfig.attention``."""
    f = Fields(hf, "Mixtral")
    if hf.get("model_type") != "mixtral":
        raise CheckpointError(f"config.json: model_type {hf.get('model_type')!r:.60} is not 'mixtral'")
    D, N = f.get("hidden_size", "count"), f.get("num_attention_heads", "count")
    max_len = f.get("max_position_embeddings", "count", 4096)
    f.expect("hidden_act", "str", "silu", "silu")
    f.expect("attention_dropout", "number", 0.0, 0.0)
    theta, scaling, fraction = rope_from_hf(f, max_len, 1e6)
    head_dim = f.get("head_dim", "count", None)
    try:
        attention = AttentionConfig(head_dim=None if head_dim == D // N else head_dim, rotary_fraction=fraction,
                                    sliding_window=f.get("sliding_window", "count", None))
        cfg = GPTConfig(
            vocab_size=f.get("vocab_size", "count"), dim=D, n_layers=f.get("num_hidden_layers", "count"),
            n_heads=N, n_kv_heads=f.get("num_key_value_heads", "count", N), max_seq_len=max_len, moe_every=1,
            num_experts=f.get("num_local_experts", "count"), top_k=f.get("num_experts_per_tok", "count"),
            expert_hidden=f.get("intermediate_size", "count"), capacity_factor=0.0,
            router=RouterConfig(scoring="topk_softmax", load_balance_coef=f.get("router_aux_loss_coef", "number", 0.001),
                                jitter_eps=f.get("router_jitter_noise", "number", 0.0)),
            norm_eps=f.get("rms_norm_eps", "number", 1e-5), rope_theta=theta, rope_scaling=scaling,
            tie_embeddings=f.get("tie_word_embeddings", "bool", False), attention=attention,
            init_std=f.get("initializer_range", "number", 0.02),
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"config.json: describes no valid model: {err}") from None
    f.done()
    return cfg


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """Mixtral ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field when the
    model is not Mixtral-shaped (MoE on every block, SwiGLU without biases, Mixtral routing, no
    shared experts, dropless, Mixtral's attention)."""
    r, a = cfg.router, cfg.attention
    mixtral_routing = r.scoring == "topk_softmax" or (r.scoring == "softmax" and r.normalize_topk)
    problems = {
        "moe_every": (cfg.moe_every, 1), "dense_layers": (cfg.dense_layers, ()),
        "experts.activation": (cfg.experts.activation, "swiglu"), "experts.bias": (cfg.experts.bias, False),
        "num_shared_experts": (cfg.num_shared_experts, 0),
        "router.kind": (r.kind, "linear"), "router.bias": (r.bias, False), "router.num_groups": (r.num_groups, 1),
        "router.routed_scaling_factor": (r.routed_scaling_factor, 1.0), "capacity_factor": (cfg.capacity_factor, 0.0),
        "router.scoring": ("Mixtral-equivalent" if mixtral_routing else r.scoring, "Mixtral-equivalent"),
        "attention.kind": (a.kind, "gqa"), "attention.qk_norm": (a.qk_norm, "none"),
        "attention.qkv_bias": (a.qkv_bias, False), "attention.o_bias": (a.o_bias, False),
        "attention.clip_qkv": (a.clip_qkv, None), "attention.sinks": (a.sinks, False),
        "attention.sliding_layers": (a.sliding_layers, ()), "attention.rope_interleaved": (a.rope_interleaved, False),
    }
    for field, (got, want) in problems.items():
        if got != want:
            raise ValueError(f"cannot export to Mixtral: {field}={got!r} (Mixtral has {want!r})")
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.expert_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": a.sliding_window,
        "attention_dropout": 0.0, "num_experts_per_tok": cfg.top_k, "num_local_experts": cfg.num_experts,
        "router_aux_loss_coef": r.load_balance_coef, "router_jitter_noise": r.jitter_eps,
        "rope_parameters": rope_to_hf(cfg), "dtype": "float32",
    }


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of a Mixtral and where it lives (the module docstring)."""
    E = cfg.num_experts
    entries = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
    for i in range(cfg.n_layers):
        pre, ours = f"model.layers.{i}", f"layers.{i}"
        entries += [same(f"{ours}.{mine}", f"{pre}.{theirs}") for mine, theirs in _DENSE.items()]
        moe, mlp = f"{pre}.block_sparse_moe", f"{pre}.mlp"
        entries += [
            same(f"{ours}.ffn.router.linear.weight", f"{moe}.gate.weight", f"{mlp}.gate.weight"),
            Entry(f"{ours}.ffn.experts.w_in", (linear_experts([f"{moe}.experts.{{e}}.w1.weight",
                                                               f"{moe}.experts.{{e}}.w3.weight"], E),
                                               fused_experts(f"{mlp}.experts.gate_up_proj", transposed=True))),
            Entry(f"{ours}.ffn.experts.w_out", (linear_experts([f"{moe}.experts.{{e}}.w2.weight"], E),
                                                fused_experts(f"{mlp}.experts.down_proj", transposed=True))),
        ]
    entries.append(Entry("lm_head.weight", (rename("lm_head.weight"),), "embed.weight" if cfg.tie_embeddings else None))
    return entries


MIXTRAL = Family(model_type="mixtral", name="Mixtral", config_from_hf=gpt_config_from_hf,
                 hf_config_from=hf_config_from_gpt, tensor_map=tensor_map)


def state_dict_from_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors (on-disk or transformers' in-memory names) -> ``MoEGPT.state_dict()``
    names (every tensor accounted for)."""
    return state_dict_from_tensors(sd, MIXTRAL, cfg)


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``MoEGPT.state_dict()`` -> Mixtral's on-disk tensor names (per-expert ``w1/w2/w3``)."""
    return state_dict_to_tensors(sd, MIXTRAL, cfg)


def gpt_from_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> MoEGPT:
    """A ``MoEGPT`` holding the weights of the Mixtral model directory ``path`` (the router's
    balancing buffers, which Mixtral does not have, start fresh)."""
    return load_hf(path, MIXTRAL, dtype=dtype)


def gpt_to_hf(model: MoEGPT, path: str | os.PathLike, *, special_tokens: dict | None = None,
              tokenizer: dict | None = None, files: dict | None = None,
              max_shard_size: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write ``model`` as a Mixtral directory that ``MixtralForCausalLM.from_pretrained`` loads
    (``moeflow.convert.hf_model.save_hf``: special tokens, tokenizer, kept files, shards)."""
    return save_hf(model, path, MIXTRAL, special_tokens=special_tokens, tokenizer=tokenizer, files=files,
                   max_shard_size=max_shard_size)
