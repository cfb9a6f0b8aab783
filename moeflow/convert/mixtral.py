"""Weights between a Hugging Face Mixtral checkpoint and moeflow's ``MoEGPT`` (exact both ways).

A Mixtral is a ``MoEGPT`` with an MoE on every block, SwiGLU experts, top-k-then-softmax routing
and untied embeddings, so conversion is a table of renames plus transposes. Mixtral checkpoints on
disk (the published ones, and what ``save_pretrained`` writes) keep one ``F.linear`` weight per
expert: ``block_sparse_moe.experts.{e}.w1`` (gate, ``[H, D]``), ``w3`` (up) and ``w2`` (down,
``[D, H]``), and the router as ``block_sparse_moe.gate``. transformers' in-memory layout
(``mlp.experts.gate_up_proj [E, 2H, D]``, ``down_proj [E, D, H]``, ``mlp.gate``) is read too.
moeflow stores ``w_in [E, D, 2H]`` (gate columns, then up) and ``w_out [E, H, D]``.

Reading and writing need only ``safetensors`` and JSON (not ``transformers``): an HF directory is
``config.json`` plus ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
(``moeflow.convert.hf_files``: it reads only files inside the directory). ``config.json`` is
checked before use (every required field present, each of its type, ``CheckpointError`` naming
it), and every tensor's shape against the config before a model is built.

Import direction: ``moeflow.convert`` sits above ``models`` and ``checkpoint``: this module
converts to and from one model class (``moeflow.models.gpt``) and reports damaged input as a
``CheckpointError``; neither of those packages imports it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from moeflow.checkpoint.io import CheckpointError
from moeflow.config import RouterConfig
from moeflow.convert.hf_files import read_hf, read_hf_config, tokenizer_files, write_hf
from moeflow.models.gpt import GPTConfig, MoEGPT

__all__ = ["gpt_config_from_hf", "hf_config_from_gpt", "state_dict_from_hf", "state_dict_to_hf",
           "read_hf", "read_hf_config", "write_hf", "gpt_from_hf", "gpt_to_hf"]

_DENSE = {  # moeflow name (per layer) -> HF name (per layer)
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


_REQUIRED = object()


def _field(hf: dict, name: str, kind: str, default: object = _REQUIRED, *, where: str = "") -> object:
    """``hf[name]`` checked to be ``kind`` (``"count"``: an int >= 1; ``"number"``: finite, >= 0;
    ``"bool"``, ``"str"``, ``"dict"``); absent or null gives ``default`` (absent and required:
    ``CheckpointError``)."""
    value = hf.get(name)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json: required field {where}{name!r} is missing" if name not in hf else
                                  f"config.json: {where}{name}=null, expected a value")
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"count": number and isinstance(value, int) and value >= 1,
          "number": number and math.isfinite(value) and value >= 0,
          "bool": isinstance(value, bool), "str": isinstance(value, str), "dict": isinstance(value, dict)}[kind]
    if not ok:
        want = {"count": "an int >= 1", "number": "a finite number >= 0", "dict": "a JSON object"}.get(kind, f"a {kind}")
        raise CheckpointError(f"config.json: {where}{name}={value!r:.60} ({type(value).__name__}), expected {want}")
    return value


def gpt_config_from_hf(hf: dict) -> GPTConfig:
    """The ``GPTConfig`` equivalent to a Mixtral ``config.json`` dict; ``CheckpointError`` naming
    the field for a missing or mistyped field and for anything moeflow's GPT does not express
    (another family, a head_dim that is not ``hidden_size / heads``, sliding windows, another
    activation or RoPE type)."""
    if not isinstance(hf, dict):
        raise CheckpointError(f"config.json: a JSON {type(hf).__name__}, expected an object")
    if hf.get("model_type") != "mixtral":
        raise CheckpointError(f"config.json: model_type {hf.get('model_type')!r:.60} is not supported; only 'mixtral'")
    D, N = _field(hf, "hidden_size", "count"), _field(hf, "num_attention_heads", "count")
    rope = _field(hf, "rope_parameters", "dict", None) or {"rope_theta": _field(hf, "rope_theta", "number", 1e6)}
    checks = {
        "hidden_act": (_field(hf, "hidden_act", "str", "silu"), "silu"),
        "head_dim": (_field(hf, "head_dim", "count", D // N), D // N),
        "sliding_window": (hf.get("sliding_window"), None),
        "rope_parameters.rope_type": (_field(rope, "rope_type", "str", "default", where="rope_parameters."), "default"),
    }
    for field, (got, want) in checks.items():
        if got != want:
            raise CheckpointError(f"config.json: {field}={got!r:.60} is not supported (moeflow's GPT needs {want!r})")
    try:
        return GPTConfig(
            vocab_size=_field(hf, "vocab_size", "count"), dim=D, n_layers=_field(hf, "num_hidden_layers", "count"),
            n_heads=N, n_kv_heads=_field(hf, "num_key_value_heads", "count", N),
            max_seq_len=_field(hf, "max_position_embeddings", "count", 4096), moe_every=1,
            num_experts=_field(hf, "num_local_experts", "count"), top_k=_field(hf, "num_experts_per_tok", "count"),
            expert_hidden=_field(hf, "intermediate_size", "count"), capacity_factor=0.0,
            router=RouterConfig(scoring="topk_softmax",
                                load_balance_coef=_field(hf, "router_aux_loss_coef", "number", 0.001),
                                jitter_eps=_field(hf, "router_jitter_noise", "number", 0.0)),
            norm_eps=_field(hf, "rms_norm_eps", "number", 1e-5),
            rope_theta=float(_field(rope, "rope_theta", "number", where="rope_parameters.")),
            tie_embeddings=_field(hf, "tie_word_embeddings", "bool", False),
            init_std=_field(hf, "initializer_range", "number", 0.02),
        )
    except (ValueError, TypeError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(f"config.json: describes no valid model: {err}") from None


def hf_config_from_gpt(cfg: GPTConfig) -> dict:
    """Mixtral ``config.json`` dict for a ``GPTConfig``; ``ValueError`` naming the field when the
    model is not Mixtral-shaped (MoE on every block, SwiGLU without biases, Mixtral routing, no
    shared experts, dropless)."""
    r = cfg.router
    mixtral_routing = r.scoring == "topk_softmax" or (r.scoring == "softmax" and r.normalize_topk)
    problems = {
        "moe_every": (cfg.moe_every, 1), "experts.activation": (cfg.experts.activation, "swiglu"),
        "experts.bias": (cfg.experts.bias, False), "num_shared_experts": (cfg.num_shared_experts, 0),
        "router.kind": (r.kind, "linear"), "router.bias": (r.bias, False), "router.num_groups": (r.num_groups, 1),
        "router.routed_scaling_factor": (r.routed_scaling_factor, 1.0), "capacity_factor": (cfg.capacity_factor, 0.0),
        "router.scoring": ("Mixtral-equivalent" if mixtral_routing else r.scoring, "Mixtral-equivalent"),
    }
    for field, (got, want) in problems.items():
        if got != want:
            raise ValueError(f"cannot export to Mixtral: {field}={got!r} (Mixtral has {want!r})")
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "intermediate_size": cfg.expert_hidden, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim // cfg.n_heads,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": None,
        "attention_dropout": 0.0, "num_experts_per_tok": cfg.top_k, "num_local_experts": cfg.num_experts,
        "router_aux_loss_coef": r.load_balance_coef, "router_jitter_noise": r.jitter_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"}, "dtype": "float32",
    }


def state_dict_from_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """HF Mixtral tensors -> ``MoEGPT.state_dict()`` names (every tensor accounted for)."""
    sd = dict(sd)
    out: dict[str, torch.Tensor] = {}

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"HF checkpoint has no tensor {key!r}")
        return sd.pop(key)

    out["embed.weight"] = take("model.embed_tokens.weight")
    out["norm.weight"] = take("model.norm.weight")
    if cfg.tie_embeddings:  # one tensor under both names, as MoEGPT.state_dict() has it
        sd.pop("lm_head.weight", None)
        out["lm_head.weight"] = out["embed.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.n_layers):
        pre = f"model.layers.{i}"
        for ours, theirs in _DENSE.items():
            out[f"layers.{i}.{ours}"] = take(f"{pre}.{theirs}")
        if f"{pre}.mlp.experts.gate_up_proj" in sd:  # transformers' fused in-memory layout
            out[f"layers.{i}.ffn.router.linear.weight"] = take(f"{pre}.mlp.gate.weight")
            out[f"layers.{i}.ffn.experts.w_in"] = take(f"{pre}.mlp.experts.gate_up_proj").transpose(1, 2).contiguous()
            out[f"layers.{i}.ffn.experts.w_out"] = take(f"{pre}.mlp.experts.down_proj").transpose(1, 2).contiguous()
            continue
        moe = f"{pre}.block_sparse_moe"
        out[f"layers.{i}.ffn.router.linear.weight"] = take(f"{moe}.gate.weight")
        experts = range(cfg.num_experts)
        out[f"layers.{i}.ffn.experts.w_in"] = torch.stack(
            [torch.cat([take(f"{moe}.experts.{e}.w1.weight"), take(f"{moe}.experts.{e}.w3.weight")]).T for e in experts]
        ).contiguous()
        out[f"layers.{i}.ffn.experts.w_out"] = torch.stack([take(f"{moe}.experts.{e}.w2.weight").T for e in experts]).contiguous()
    leftover = sorted(k for k in sd if not k.endswith("rotary_emb.inv_freq"))
    if leftover:
        raise CheckpointError(f"HF checkpoint has tensors the Mixtral mapping does not know: {leftover[:5]}")
    return out


def state_dict_to_hf(sd: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """``MoEGPT.state_dict()`` -> Mixtral's on-disk tensor names (per-expert ``w1/w2/w3``), the
    inverse of ``state_dict_from_hf``."""
    out = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    H = cfg.expert_hidden
    for i in range(cfg.n_layers):
        for ours, theirs in _DENSE.items():
            out[f"model.layers.{i}.{theirs}"] = sd[f"layers.{i}.{ours}"]
        moe = f"model.layers.{i}.block_sparse_moe"
        out[f"{moe}.gate.weight"] = sd[f"layers.{i}.ffn.router.linear.weight"]
        w_in, w_out = sd[f"layers.{i}.ffn.experts.w_in"], sd[f"layers.{i}.ffn.experts.w_out"]
        for e in range(cfg.num_experts):
            out[f"{moe}.experts.{e}.w1.weight"] = w_in[e, :, :H].T.contiguous()
            out[f"{moe}.experts.{e}.w3.weight"] = w_in[e, :, H:].T.contiguous()
            out[f"{moe}.experts.{e}.w2.weight"] = w_out[e].T.contiguous()
    return out


def _check_shapes(path: object, sd: dict[str, torch.Tensor], cfg: GPTConfig) -> None:
    """Every tensor floating point and of the shape ``cfg`` gives it, checked on a model built on
    the meta device (no memory) before a real one is allocated: a config.json that does not fit
    its weights is a ``CheckpointError`` naming the tensor, not torch's size-mismatch message."""
    with torch.device("meta"):
        want = MoEGPT(cfg).state_dict()
    for name, value in sd.items():
        if name in want and tuple(value.shape) != tuple(want[name].shape):
            raise CheckpointError(f"{path}: tensor for {name} has shape {tuple(value.shape)}, config.json gives "
                                  f"{tuple(want[name].shape)}")
        if not value.is_floating_point():
            raise CheckpointError(f"{path}: tensor for {name} is {value.dtype}, expected a floating-point dtype")


def gpt_from_hf(path: str | os.PathLike, *, dtype: torch.dtype | None = None) -> MoEGPT:
    """A ``MoEGPT`` holding the weights of the Mixtral model directory ``path`` (the router's
    balancing buffers, which Mixtral does not have, start fresh)."""
    cfg = gpt_config_from_hf(read_hf_config(path))  # refuse another family before reading weights
    _, tensors = read_hf(path)
    sd = state_dict_from_hf(tensors, cfg)
    _check_shapes(path, sd, cfg)
    model = MoEGPT(cfg, dtype=dtype if dtype is not None else sd["embed.weight"].dtype)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    buffers = {name for name, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise CheckpointError(f"{path}: tensors do not match the model: missing {sorted(set(missing) - buffers)[:5]}, "
                              f"unexpected {unexpected[:5]}")
    return model


def gpt_to_hf(model: MoEGPT, path: str | os.PathLike, *, special_tokens: dict | None = None,
              tokenizer: dict | None = None) -> Path:
    """Write ``model`` as a Mixtral directory that ``MixtralForCausalLM.from_pretrained`` loads,
    with ``generation_config.json`` (``special_tokens``: bos/eos/pad ids, ``None`` by default)
    and, given a moeflow tokenizer description (``Tokenizer.to_dict()``), the tokenizer files
    ``AutoTokenizer.from_pretrained`` reads."""
    if not isinstance(model, MoEGPT):
        raise TypeError(f"model must be a MoEGPT, got {type(model).__name__}")
    config = hf_config_from_gpt(model.config)
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias") and bool(buf.ne(0).any()):
            raise ValueError(f"cannot export to Mixtral: {name} is nonzero (aux-loss-free balancing changes which "
                             "experts are chosen, and Mixtral's router has no such bias)")
    files = tokenizer_files(tokenizer, config["vocab_size"], config["max_position_embeddings"]) if tokenizer else None
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    config["dtype"] = str(sd["embed.weight"].dtype).removeprefix("torch.")
    return write_hf(path, config, state_dict_to_hf(sd, model.config), special_tokens=special_tokens, tokenizer=files)
