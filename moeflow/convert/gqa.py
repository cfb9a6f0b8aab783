"""What the grouped-query families (``qwen3_moe``, ``qwen2_moe``, ``olmoe``, ``gpt_oss``) share:
the ``config.json`` fields that mean the same in each, the checks before writing one, and the
tensor names. Each family's module reads what is its own (its attention's options) and hands
them to ``config_from_fields``; its ``tensor_map`` is ``decoder_entries``.

Shared fields (transformers' defaults where absent, ``Defaults``, per family): the sizes
(``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads`` required;
``num_key_value_heads``, ``head_dim``, ``max_position_embeddings``), ``rms_norm_eps``,
``initializer_range``, ``tie_word_embeddings``, ``attention_dropout`` (0 only: moeflow has no
attention dropout), RoPE (``moeflow.convert.family.rope_from_hf``; a ``partial_rotary_factor``
other than 1 is refused: these families' default RoPE ignores it and their rotation takes the
whole head), and the FFN (``moeflow.convert.moe_blocks.moe_fields_from_hf``, whose refusals
become ``CheckpointError`` s). Sliding windows per block are ``layer_types`` in Qwen2-MoE and
gpt-oss (``sliding_layers`` here).

Tensors, per block ``model.layers.{i}.``: ``input_layernorm`` / ``post_attention_layernorm``
(``attn_norm`` / ``ffn_norm``), ``self_attn.{q,k,v,o}_proj`` (weights, and biases where the
config has them), ``self_attn.{q,k}_norm``, ``self_attn.sinks``; the FFN (``ffn_entries``):

- Qwen and OLMoE: ``mlp.gate`` (the router), ``mlp.experts.{e}.{gate,up,down}_proj`` per
  expert as the files (published, and transformers 5's ``save_pretrained``) hold them, or
  transformers' in-memory ``mlp.experts.gate_up_proj [E, 2H, D]`` / ``down_proj [E, D, H]``;
  Qwen2-MoE's ``mlp.shared_expert.{gate,up,down}_proj`` and ``mlp.shared_expert_gate``; a dense
  block's ``mlp.{gate,up,down}_proj``;
- gpt-oss: ``mlp.router`` (weight and bias), ``mlp.experts.gate_up_proj [E, D, 2H]`` (gate and
  up columns interleaved) with its bias, ``down_proj [E, H, D]`` with its bias; published
  checkpoints store the two expert weights as MXFP4 (``moeflow.convert.quant``).

The names and layouts are those of ``moe_blocks.ffn_from_hf`` (tests hold the two together).
"""

from __future__ import annotations

from dataclasses import dataclass

from moeflow.checkpoint.schema import CheckpointError
from moeflow.convert.family import Fields, rope_from_hf, rope_to_hf
from moeflow.convert.moe_blocks import MOE_KEYS, moe_fields_from_hf, moe_fields_to_hf
from moeflow.convert.tensor_map import Entry, dense_ffn, fused_experts, linear_experts, same
from moeflow.models.gpt_config import AttentionConfig, GPTConfig

__all__ = ["SLIDING", "FULL", "Defaults", "open_fields", "config_from_fields", "sliding_from_layer_types",
           "layer_types",
           "check_exportable", "hf_config_common", "decoder_entries", "ffn_entries"]

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class Defaults:
    """A family's transformers defaults for the shared fields absent from ``config.json``:
    ``kv_heads`` (None: ``num_attention_heads``), ``head_dim`` (None: ``hidden_size //
    num_attention_heads``), ``max_len``, ``eps`` and ``theta`` (RoPE's base)."""

    kv_heads: int | None
    head_dim: int | None
    max_len: int
    eps: float
    theta: float


def open_fields(hf: dict, model_type: str, name: str) -> Fields:
    """``Fields`` over ``hf``, after checking that it is ``model_type`` 's config."""
    fields = Fields(hf, name)
    if hf.get("model_type") != model_type:
        raise CheckpointError(f"config.json: model_type {hf.get('model_type')!r:.60} is not {model_type!r}")
    return fields


def config_from_fields(f: Fields, model_type: str, defaults: Defaults, attention: dict[str, object]) -> GPTConfig:
    """The ``GPTConfig`` of a grouped-query family's ``config.json`` (read through ``f``): the
    shared fields (module docstring), the FFN through ``moe_blocks``, and ``attention`` (the
    family's ``AttentionConfig`` options, read by the family); then every field nothing read
    is refused (``Fields.done``)."""
    D, N = f.get("hidden_size", "count"), f.get("num_attention_heads", "count")
    max_len = f.get("max_position_embeddings", "count", defaults.max_len)
    f.expect("attention_dropout", "number", 0.0, 0.0)
    theta, scaling, fraction = rope_from_hf(f, max_len, defaults.theta)
    if fraction != 1.0:
        raise CheckpointError(f"config.json: partial_rotary_factor={fraction} is not supported: transformers' "
                              f"{f.family} rotates whole heads (its default RoPE ignores the factor)")
    head_dim = f.get("head_dim", "count", defaults.head_dim)
    try:
        moe = moe_fields_from_hf(f.mark(MOE_KEYS[model_type]))
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    try:
        cfg = GPTConfig(
            vocab_size=f.get("vocab_size", "count"), dim=D, n_layers=f.get("num_hidden_layers", "count"), n_heads=N,
            n_kv_heads=f.get("num_key_value_heads", "count", defaults.kv_heads or N), max_seq_len=max_len,
            norm_eps=f.get("rms_norm_eps", "number", defaults.eps), rope_theta=theta, rope_scaling=scaling,
            tie_embeddings=f.get("tie_word_embeddings", "bool", False),
            init_std=f.get("initializer_range", "number", 0.02),
            attention=AttentionConfig(head_dim=None if head_dim in (None, D // N) and D % N == 0 else head_dim,
                                      **attention),  # type: ignore[arg-type]
            **moe,  # type: ignore[arg-type]
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"config.json: describes no valid model: {err}") from None
    f.done()
    return cfg


def sliding_from_layer_types(f: Fields, types: object, window: int | None) -> dict[str, object]:
    """``AttentionConfig``'s ``sliding_window`` and ``sliding_layers`` of ``layer_types`` (a list
    of ``"full_attention"`` / ``"sliding_attention"``, one per block) sliding over ``window``:
    no window when no block slides; ``sliding_layers=()`` (every block) when all do."""
    n = f.get("num_hidden_layers", "count")
    if not (isinstance(types, list) and len(types) == n and all(t in (SLIDING, FULL) for t in types)):
        raise CheckpointError(f"config.json: layer_types={types!r:.80} must list {FULL!r} or {SLIDING!r} for each of "
                              f"the {n} blocks")
    layers = tuple(i for i, t in enumerate(types) if t == SLIDING)
    if not layers:
        return {"sliding_window": None, "sliding_layers": ()}
    if not window:
        raise CheckpointError(f"config.json: layer_types has sliding blocks {list(layers)} but the window is "
                              f"{window!r} (sliding_window, use_sliding_window)")
    return {"sliding_window": window, "sliding_layers": () if len(layers) == n else layers}


def layer_types(cfg: GPTConfig) -> list[str]:
    """``layer_types`` of ``cfg``: which blocks slide (``AttentionConfig.slides``)."""
    return [SLIDING if cfg.attention.slides(i) else FULL for i in range(cfg.n_layers)]


def check_exportable(cfg: GPTConfig, name: str, wants: dict[str, tuple[object, object]]) -> None:
    """``ValueError`` naming the first field of ``cfg`` that the family ``name`` cannot hold:
    ``wants`` maps a field to ``(its value, the family's)``, beside the options none of these
    families has (latent attention, partial or interleaved rotation)."""
    a = cfg.attention
    common = {"attention.kind": (a.kind, "gqa"), "attention.rotary_fraction": (a.rotary_fraction, 1.0),
              "attention.rope_interleaved": (a.rope_interleaved, False)}
    for field, (got, want) in {**common, **wants}.items():
        if got != want:
            raise ValueError(f"cannot export to {name}: {field}={got!r} ({name} has {want!r})")


def hf_config_common(cfg: GPTConfig, model_type: str, architecture: str) -> dict:
    """The shared fields of a family's ``config.json`` for ``cfg`` (the FFN's through
    ``moe_blocks.moe_fields_to_hf``, which refuses what the family's FFN cannot express)."""
    return {
        "architectures": [architecture], **moe_fields_to_hf(model_type, cfg), "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads, "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std, "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0, "rope_parameters": rope_to_hf(cfg),
    }


def ffn_entries(model_type: str, cfg: GPTConfig, layer: int) -> list[Entry]:
    """Block ``layer``'s FFN tensors in ``model_type`` 's checkpoints (module docstring)."""
    ours, mlp, E = f"layers.{layer}.ffn", f"model.layers.{layer}.mlp", cfg.num_experts
    if not cfg.is_moe_layer(layer):
        return dense_ffn(ours, mlp)
    if model_type == "gpt_oss":
        return [same(f"{ours}.router.linear.weight", f"{mlp}.router.weight"),
                same(f"{ours}.router.linear.bias", f"{mlp}.router.bias"),
                Entry(f"{ours}.experts.w_in", (fused_experts(f"{mlp}.experts.gate_up_proj", transposed=False,
                                                             interleaved=True),)),
                Entry(f"{ours}.experts.b_in", (fused_experts(f"{mlp}.experts.gate_up_proj_bias", transposed=False,
                                                             interleaved=True),)),
                same(f"{ours}.experts.w_out", f"{mlp}.experts.down_proj"),
                same(f"{ours}.experts.b_out", f"{mlp}.experts.down_proj_bias")]
    per_expert = f"{mlp}.experts.{{e}}"
    gate_up = [f"{per_expert}.gate_proj.weight", f"{per_expert}.up_proj.weight"]
    entries = [
        same(f"{ours}.router.linear.weight", f"{mlp}.gate.weight"),
        Entry(f"{ours}.experts.w_in", (linear_experts(gate_up, E),
                                       fused_experts(f"{mlp}.experts.gate_up_proj", transposed=True))),
        Entry(f"{ours}.experts.w_out", (linear_experts([f"{per_expert}.down_proj.weight"], E),
                                        fused_experts(f"{mlp}.experts.down_proj", transposed=True))),
    ]
    if model_type == "qwen2_moe":
        entries += dense_ffn(f"{ours}.shared", f"{mlp}.shared_expert")
        entries.append(same(f"{ours}.shared.gate.weight", f"{mlp}.shared_expert_gate.weight"))
    return entries


def decoder_entries(model_type: str, cfg: GPTConfig) -> list[Entry]:
    """Every ``MoEGPT`` tensor of ``cfg`` and where ``model_type`` keeps it; the output
    projection tied to the embedding when ``cfg`` ties them."""
    a = cfg.attention
    entries = [same("embed.weight", "model.embed_tokens.weight"), same("norm.weight", "model.norm.weight")]
    for i in range(cfg.n_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        entries += [same(f"{ours}.attn_norm.weight", f"{hf}.input_layernorm.weight"),
                    same(f"{ours}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight")]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            entries.append(same(f"{ours}.attn.{proj}.weight", f"{hf}.self_attn.{proj}.weight"))
            if (a.o_bias if proj == "o_proj" else a.qkv_bias):
                entries.append(same(f"{ours}.attn.{proj}.bias", f"{hf}.self_attn.{proj}.bias"))
        if a.qk_norm != "none":
            entries += [same(f"{ours}.attn.{n}.weight", f"{hf}.self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
        if a.sinks:
            entries.append(same(f"{ours}.attn.sinks", f"{hf}.self_attn.sinks"))
        entries += ffn_entries(model_type, cfg, i)
    entries.append(same("lm_head.weight", "lm_head.weight", tied_to="embed.weight" if cfg.tie_embeddings else None))
    return entries
