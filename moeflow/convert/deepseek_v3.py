"""The DeepSeek-V3 family (``model_type`` ``"deepseek_v3"``): its ``config.json`` and tensors, both
ways.

A DeepSeek-V3 is a ``MoEGPT`` with multi-head latent attention (``AttentionConfig(kind="mla")``,
``moeflow.models.mla``: a query bottleneck ``q_lora_rank`` or one projection, a ``kv_lora_rank``
latent, rotary parts of ``qk_rope_head_dim`` rotated as adjacent pairs with ``rope_interleave``,
DeepSeek's YaRN softmax scale), dense FFNs on the first ``first_k_dense_replace`` blocks and MoE
blocks after them: sigmoid scores, group-limited top-k with the score-correction bias, routed
scaling, shared experts without a gate (``moeflow.convert.moe_blocks``, which maps those fields).

``config.json`` (``gpt_config_from_hf``): an absent field takes transformers'
``DeepseekV3Config`` default (DeepSeek-V3's published sizes), the MoE fields included; the four
sizes (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``) are
required. Refused, by name and value: ``attention_bias`` (biases on ``q_a_proj`` and
``kv_a_proj_with_mqa``, which moeflow's latent attention has not), ``attention_dropout`` other
than 0, ``num_key_value_heads`` other than ``num_attention_heads`` (latent attention expands a
key and a value head per query head; transformers' repeats them ``N / num_key_value_heads``
times, which only 1 makes a model), a ``partial_rotary_factor`` (the rotary part is
``qk_rope_head_dim``), RoPE types but default, linear and yarn, and every field nothing reads.
Read and changing nothing: ``head_dim`` and ``qk_head_dim`` (transformers derives both from the
head sizes whatever the file says), ``pretraining_tp`` (transformers' DeepSeek-V3 does not read
it), ``num_nextn_predict_layers`` (the multi-token-prediction modules: transformers builds none
and the logits do not depend on them; a checkpoint that stores them, as block
``num_hidden_layers``, has them left out with a warning: ``left_out``), ``auto_map`` (the class
names of DeepSeek's own Python code). DeepSeek's softmax scale reads ``mscale_all_dim`` even
where ``mscale`` is absent (transformers' ``yarn_apply_mscale``), so it is kept then too.

Written (``hf_config_from_gpt``): the family's own config, loadable by ``DeepseekV3ForCausalLM``,
with ``num_nextn_predict_layers=0`` (moeflow holds no MTP module).

Tensors, per block ``model.layers.{i}.``: ``input_layernorm`` / ``post_attention_layernorm``;
``self_attn.`` ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``,
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj`` (moeflow's ``attn.``
``q_a_norm``, ``kv_a_proj``, ``kv_a_norm``: issue 47's names); a dense block's
``mlp.{gate,up,down}_proj``; an MoE block's ``mlp.gate`` (the router) and
``mlp.gate.e_score_correction_bias`` (``router.expert_bias``), ``mlp.experts.{e}.{gate,up,
down}_proj`` per expert as the files hold them (or transformers' in-memory
``mlp.experts.gate_up_proj [E, 2H, D]`` / ``down_proj [E, D, H]``), and
``mlp.shared_experts.{gate,up,down}_proj``. The rotary rows are stored as the rotation reads
them, pairs or halves, so no tensor is permuted. The published checkpoints' block-wise FP8
weights (``quantization_config`` ``quant_method: fp8``, ``weight_scale_inv``) are dequantised
at load by ``moeflow.convert.quant``, as for any family.

``DEEPSEEK_V3`` is the family ``moeflow.convert.hf`` registers.
"""

from __future__ import annotations

import dataclasses

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.family import IGNORED, Family, Fields, rope_from_hf, rope_to_hf
from moeflow.convert.moe_blocks import MOE_IGNORED, MOE_KEYS, moe_fields_from_hf, moe_fields_to_hf
from moeflow.convert.tensor_map import Entry, dense_ffn, fused_experts, linear_experts, same
from moeflow.models.gpt_config import AttentionConfig, GPTConfig

__all__ = ["DEEPSEEK_V3", "gpt_config_from_hf", "hf_config_from_gpt", "tensor_map"]

# transformers' DeepseekV3Config defaults of the fields moe_blocks reads (its own defaults are
# other families'): an absent field means what transformers makes of it
_MOE_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                 "intermediate_size": 18432, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "n_group": 8,
                 "topk_group": 4, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu"}
_NOTHING_CHANGED = ("head_dim", "qk_head_dim", "pretraining_tp", "num_nextn_predict_layers", "num_mtp_layers",
                    "auto_map")
# moeflow's attention names -> the checkpoint's (under self_attn.)
_ATTENTION = {"kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
              "o_proj": "o_proj"}
_QUERY_LORA = {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj"}


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a DeepSeek-V3 ``config.json`` dict; ``CheckpointError``
    naming the field for a missing or mistyped field, a value moeflow cannot express, and any
    field it does not know (module docstring)."""
    f = Fields(hf, "DeepSeek-V3")
    if hf.get("model_type") != "deepseek_v3":
        raise CheckpointError(f"config.json: model_type {hf.get('model_type')!r:.60} is not 'deepseek_v3'")
    D, N = f.get("hidden_size", "count"), f.get("num_attention_heads", "count")
    max_len = f.get("max_position_embeddings", "count", 4096)
    f.expect("attention_bias", "bool", False, False)
    f.expect("attention_dropout", "number", 0.0, 0.0)
    f.expect("num_key_value_heads", "count", N, 128)
    theta, scaling, fraction = rope_from_hf(f, max_len, 10000.0)
    if fraction != 1.0:
        raise CheckpointError(f"config.json: partial_rotary_factor={fraction} is not supported: DeepSeek-V3 rotates "
                              "the qk_rope_head_dim part of each head whole")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    mscale_all = rope.get("mscale_all_dim") if isinstance(rope, dict) else None
    if scaling is not None and scaling.mscale_all_dim is None and mscale_all:
        scaling = dataclasses.replace(scaling, mscale_all_dim=float(mscale_all))  # (the softmax scale's alone)
    f.mark(_NOTHING_CHANGED)
    try:
        moe = moe_fields_from_hf({**_MOE_DEFAULTS, **f.mark(MOE_KEYS["deepseek_v3"])})
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    try:
        # q_lora_rank: null is one query projection; absent, transformers' 1536
        q_lora = f.get("q_lora_rank", "count", None) if "q_lora_rank" in hf else 1536
        attention = AttentionConfig(
            kind="mla", q_lora_rank=q_lora,
            kv_lora_rank=f.get("kv_lora_rank", "count", 512), qk_nope_head_dim=f.get("qk_nope_head_dim", "count", 128),
            qk_rope_head_dim=f.get("qk_rope_head_dim", "count", 64), v_head_dim=f.get("v_head_dim", "count", 128),
            rope_interleaved=f.get("rope_interleave", "bool", True))
        cfg = GPTConfig(
            vocab_size=f.get("vocab_size", "count"), dim=D, n_layers=f.get("num_hidden_layers", "count"), n_heads=N,
            max_seq_len=max_len, norm_eps=f.get("rms_norm_eps", "number", 1e-6), rope_theta=theta,
            rope_scaling=scaling, tie_embeddings=f.get("tie_word_embeddings", "bool", False),
            init_std=f.get("initializer_range", "number", 0.02), attention=attention, **moe,  # type: ignore[arg-type]
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"config.json: describes no valid model: {err}") from None
    f.done(ignored=IGNORED | set(MOE_IGNORED))
    return cfg


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """DeepSeek-V3 ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field when
    the model is not DeepSeek-V3-shaped (latent attention without an output bias, one key/value
    head per query head, no dropout, DeepSeek-V3's FFN: ``moe_blocks.moe_fields_to_hf``)."""
    a = cfg.attention
    for field, (got, want) in {"attention.kind": (a.kind, "mla"), "attention.o_bias": (a.o_bias, False),
                               "n_kv_heads": (cfg.kv_heads, cfg.n_heads), "dropout": (cfg.dropout, 0.0)}.items():
        if got != want:
            raise ValueError(f"cannot export to DeepSeek-V3: {field}={got!r} (DeepSeek-V3 has {want!r})")
    rope = rope_to_hf(cfg)
    if cfg.rope_scaling is not None and cfg.rope_scaling.mscale_all_dim is not None:
        rope["mscale_all_dim"] = cfg.rope_scaling.mscale_all_dim  # (linear scaling's softmax scale too)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], **moe_fields_to_hf("deepseek_v3", cfg),
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_heads,
        "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "attention_dropout": 0.0,
        "q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
        "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim, "rope_interleave": a.rope_interleaved,
        "num_nextn_predict_layers": 0, "rope_parameters": rope,
    }


def tensor_map(cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of a DeepSeek-V3 and where it lives (the module docstring)."""
    E = cfg.num_experts
    attention = {**({"q_proj": "q_proj"} if cfg.attention.q_lora_rank is None else _QUERY_LORA), **_ATTENTION}
    entries = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        entries += [same(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
                    same(f"{ours}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight")]
        entries += [same(f"{ours}.attn.{mine}.weight", f"{hf}.self_attn.{theirs}.weight")
                    for mine, theirs in attention.items()]
        ffn, mlp = f"{ours}.ffn", f"{hf}.mlp"
        if not cfg.is_moe_layer(i):
            entries += dense_ffn(ffn, mlp)
            continue
        per_expert = f"{mlp}.experts.{{e}}"
        entries += [
            same(f"{ffn}.router.linear.weight", f"{mlp}.gate.weight"),
            same(f"{ffn}.router.expert_bias", f"{mlp}.gate.e_score_correction_bias"),
            Entry(f"{ffn}.experts.w_in", (linear_experts([f"{per_expert}.gate_proj.weight",
                                                          f"{per_expert}.up_proj.weight"], E),
                                          fused_experts(f"{mlp}.experts.gate_up_proj", transposed=True))),
            Entry(f"{ffn}.experts.w_out", (linear_experts([f"{per_expert}.down_proj.weight"], E),
                                           fused_experts(f"{mlp}.experts.down_proj", transposed=True))),
        ]
        if cfg.num_shared_experts:
            entries += dense_ffn(f"{ffn}.shared", f"{mlp}.shared_experts")
    entries.append(same("lm_head.weight", "lm_head.weight", tied_to="embed.weight" if cfg.tie_embeddings else None))
    return entries


def left_out(hf: dict) -> dict[str, str]:
    """The multi-token-prediction blocks a published checkpoint stores after the decoder's
    (``model.layers.{num_hidden_layers + j}.``, ``num_nextn_predict_layers`` of them): moeflow's
    decoder has none, transformers does not load them either, the logits do not depend on them,
    and ``--to-hf`` writes the model without them."""
    layers, mtp = hf.get("num_hidden_layers"), hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
    if not isinstance(layers, int) or not isinstance(mtp, int) or mtp < 0:
        return {}
    return {f"model.layers.{layers + j}.": "DeepSeek-V3's multi-token-prediction block (num_nextn_predict_layers): "
            "moeflow's decoder has none, as transformers' has none" for j in range(mtp)}


DEEPSEEK_V3 = Family(model_type="deepseek_v3", name="DeepSeek-V3", config_from_hf=gpt_config_from_hf,
                     hf_config_from=hf_config_from_gpt, tensor_map=tensor_map, left_out=left_out)
