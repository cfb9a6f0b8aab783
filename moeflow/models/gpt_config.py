"""The shape of a ``MoEGPT`` (``GPTConfig``) and the named presets (``GPT_PRESETS``,
``gpt_config``): what ``moeflow.models.gpt`` builds the model from and checkpoints save (as JSON,
``to_dict`` / ``from_dict``).

One decoder serves every family (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, gpt-oss): its
attention is an ``AttentionConfig`` (grouped-query or multi-head latent, head size, query/key
norms, biases, sliding windows, sinks), its rotary embedding a ``RopeScaling`` on top of
``rope_theta`` (linear or YaRN, a rotated fraction of each head), and which blocks are dense,
how wide the shared experts are and whether a gate scales them are fields of ``GPTConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig, _int

__all__ = ["GPTConfig", "AttentionConfig", "RopeScaling", "GPT_PRESETS", "gpt_config"]

AttentionKind = Literal["gqa", "mla"]
QKNorm = Literal["none", "head", "proj"]
RopeKind = Literal["linear", "yarn"]


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Rotary position scaling beyond ``rope_theta`` (Hugging Face's ``rope_parameters``):

    - ``kind="linear"``: positions divided by ``factor``;
    - ``kind="yarn"`` (DeepSeek-V3, gpt-oss): the frequencies blended between interpolation and
      extrapolation over ``[beta_slow, beta_fast]`` rotations at ``original_max_seq_len``
      (``truncate``: the correction range rounded to whole dimensions), and cos/sin scaled by
      ``attention_factor`` (default: from ``factor``, ``mscale`` and ``mscale_all_dim``, as
      transformers infers it).
    """

    kind: RopeKind
    factor: float
    original_max_seq_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("linear", "yarn"):
            raise ValueError(f"kind must be 'linear' or 'yarn', got {self.kind!r}")
        _positive("factor", self.factor)
        if self.original_max_seq_len is not None:
            _int("original_max_seq_len", self.original_max_seq_len, minimum=1)
        if self.kind == "yarn" and self.original_max_seq_len is None:
            raise ValueError("kind='yarn' needs original_max_seq_len (the context the model was trained at)")
        for name in ("beta_fast", "beta_slow"):
            _positive(name, getattr(self, name))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if not isinstance(self.truncate, bool):
            raise TypeError(f"truncate must be a bool, got {type(self.truncate).__name__}")


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """The attention of every block.

    ``kind="gqa"``: grouped-query attention with ``head_dim`` (default ``dim // n_heads``);
    ``qk_norm`` RMS-normalises queries and keys per head (``"head"``, Qwen3-MoE) or over the whole
    projection (``"proj"``, OLMoE); ``qkv_bias`` / ``o_bias`` add biases to the projections
    (Qwen2-MoE: ``qkv_bias``; gpt-oss: both); ``clip_qkv`` clamps queries, keys and values
    (OLMoE). ``sliding_window`` limits the blocks in ``sliding_layers`` (all blocks when empty)
    to the last ``sliding_window`` keys; ``sinks``: a learned logit per head that joins every
    softmax (gpt-oss). ``rotary_fraction``: the share of each head's dimensions that rotate
    (partial rotary); ``rope_interleaved``: rotate adjacent pairs instead of halves.

    ``kind="mla"``: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): queries through a
    rank-``q_lora_rank`` bottleneck (None: one projection), keys and values from a
    ``kv_lora_rank`` latent shared by every head plus a ``qk_rope_head_dim`` rotary part; heads
    of ``qk_nope_head_dim + qk_rope_head_dim`` (queries, keys) and ``v_head_dim`` (values); the
    KV cache keeps the latent.
    """

    kind: AttentionKind = "gqa"
    head_dim: int | None = None
    qk_norm: QKNorm = "none"
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    sinks: bool = False
    rotary_fraction: float = 1.0
    rope_interleaved: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ValueError(f"kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.qk_norm not in ("none", "head", "proj"):
            raise ValueError(f"qk_norm must be 'none', 'head' or 'proj', got {self.qk_norm!r}")
        if self.head_dim is not None:
            _int("head_dim", self.head_dim, minimum=2)
        for name in ("qkv_bias", "o_bias", "sinks", "rope_interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if self.clip_qkv is not None:
            _positive("clip_qkv", self.clip_qkv)
        if self.sliding_window is not None:
            _int("sliding_window", self.sliding_window, minimum=1)
        object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))
        for i in self.sliding_layers:
            _int("sliding_layers[i]", i, minimum=0)
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError(f"sliding_layers={self.sliding_layers} needs a sliding_window")
        if not (isinstance(self.rotary_fraction, (int, float)) and 0 < self.rotary_fraction <= 1):
            raise ValueError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction!r}")
        if self.q_lora_rank is not None:
            _int("q_lora_rank", self.q_lora_rank, minimum=1)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _int(name, getattr(self, name), minimum=1)
        _int("qk_rope_head_dim", self.qk_rope_head_dim, minimum=2)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.kind == "mla":
            gqa_only = {"head_dim": None, "qk_norm": "none", "qkv_bias": False, "clip_qkv": None,
                        "sliding_window": None, "sinks": False, "rotary_fraction": 1.0}
            for name, unset in gqa_only.items():
                if getattr(self, name) != unset:
                    raise ValueError(f"{name}={getattr(self, name)!r} is a grouped-query option; kind='mla' "
                                     f"takes {unset!r}")

    def slides(self, layer: int) -> bool:
        """Whether block ``layer`` attends through the sliding window."""
        return self.sliding_window is not None and (not self.sliding_layers or layer in self.sliding_layers)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a ``MoEGPT``; validated on construction (the MoE part through ``MoEConfig``).

    ``dense_hidden`` is the FFN width of the dense blocks (default ``expert_hidden``), and
    ``expert_hidden`` the width of each routed expert. Block ``i`` is MoE when ``(i + 1) %
    moe_every == 0`` and ``i`` is not in ``dense_layers`` (DeepSeek's first dense blocks, Qwen's
    ``mlp_only_layers``). ``shared_hidden``: the width of the shared experts (default
    ``num_shared_experts * expert_hidden``), ``shared_gate``: a sigmoid gate on their output
    (Qwen2-MoE). ``tie_embeddings`` shares the input embedding with the output projection
    (GPT-2/3); Mixtral unties them.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int | None = None
    max_seq_len: int = 256
    moe_every: int = 1
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 256
    dense_hidden: int | None = None
    capacity_factor: float = 0.0
    router: RouterConfig = field(default_factory=RouterConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)
    num_shared_experts: int = 0
    shared_hidden: int | None = None
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    dropout: float = 0.0
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len", "expert_hidden"):
            _int(name, getattr(self, name), minimum=1)
        _int("moe_every", self.moe_every, minimum=0)
        if self.n_kv_heads is not None:
            _int("n_kv_heads", self.n_kv_heads, minimum=1)
            if self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
        if not isinstance(self.attention, AttentionConfig):
            raise TypeError(f"attention must be an AttentionConfig, got {type(self.attention).__name__}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}")
        if self.attention.kind == "gqa":
            if self.attention.head_dim is None and self.dim % self.n_heads:
                raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads (or set attention.head_dim)")
            rotary = self.rotary_dim
            if rotary % 2 or rotary < 2:
                raise ValueError(f"the rotary part of a head (head_dim={self.head_dim} x rotary_fraction="
                                 f"{self.attention.rotary_fraction} = {rotary}) must be even and >= 2")
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        for i in self.dense_layers:
            _int("dense_layers[i]", i, minimum=0)
            if i >= self.n_layers:
                raise ValueError(f"dense_layers holds {i}, but the model has n_layers={self.n_layers}")
        for i in self.attention.sliding_layers:
            if i >= self.n_layers:
                raise ValueError(f"attention.sliding_layers holds {i}, but the model has n_layers={self.n_layers}")
        if self.shared_hidden is not None:
            _int("shared_hidden", self.shared_hidden, minimum=1)
        if not isinstance(self.shared_gate, bool):
            raise TypeError(f"shared_gate must be a bool, got {type(self.shared_gate).__name__}")
        if self.dense_hidden is not None:
            _int("dense_hidden", self.dense_hidden, minimum=1)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not (self.norm_eps > 0 and self.rope_theta > 0 and self.init_std > 0):
            raise ValueError(
                f"norm_eps, rope_theta and init_std must be > 0, got {self.norm_eps}, {self.rope_theta}, {self.init_std}"
            )
        if self.moe_every:
            self.moe_config()  # validates the MoE fields (k <= E, router groups, ...)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        """A grouped-query head's size (``attention.head_dim``, default ``dim // n_heads``)."""
        return self.attention.head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """How many of a head's dimensions rotate: ``qk_rope_head_dim`` (latent attention), else
        ``head_dim * rotary_fraction`` (rounded down)."""
        if self.attention.kind == "mla":
            return self.attention.qk_rope_head_dim
        return int(self.head_dim * self.attention.rotary_fraction)

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0 and i not in self.dense_layers

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            dim=self.dim, hidden=self.expert_hidden, num_experts=self.num_experts, top_k=self.top_k,
            capacity_factor=self.capacity_factor, router=self.router, dispatch=self.dispatch,
            experts=dataclasses.replace(self.experts, init_std=self.init_std),
            num_shared_experts=self.num_shared_experts, shared_hidden=self.shared_hidden,
            shared_gate=self.shared_gate,
        )

    def to_dict(self) -> dict:
        """JSON-able form (nested configs as dicts, dtypes as names); ``from_dict`` inverts it."""
        out = dataclasses.asdict(self)
        # unset deprecated parallel fields (moeflow.ParallelConfig) are not written
        out["dispatch"] = {k: v for k, v in out["dispatch"].items() if k not in _PARALLEL_KEYS or v is not None}
        if self.router.dtype is not None:
            out["router"]["dtype"] = str(self.router.dtype).removeprefix("torch.")
        # tuples as lists, as JSON gives them back: a saved config compares equal to a fresh one
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        if not isinstance(d, dict):
            raise TypeError(f"GPTConfig.from_dict needs a dict, got {type(d).__name__}")
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        router = dict(d.get("router", {}))
        if isinstance(router.get("dtype"), str):
            router["dtype"] = getattr(torch, router["dtype"])
        d["router"] = RouterConfig(**router)
        # configs written before ParallelConfig carry the run's parallel settings here: they
        # belong to the run (its training config), not to the model, and are dropped
        d["dispatch"] = DispatchConfig(**{k: v for k, v in d.get("dispatch", {}).items() if k not in _PARALLEL_KEYS})
        d["experts"] = ExpertsConfig(**d.get("experts", {}))
        attention = dict(d.get("attention", {}))
        attention["sliding_layers"] = tuple(attention.get("sliding_layers", ()))
        d["attention"] = AttentionConfig(**attention)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["dense_layers"] = tuple(d.get("dense_layers", ()))
        return cls(**d)


_PARALLEL_KEYS = ("parallel", "overlap_degree", "tuner")  # moved from DispatchConfig to ParallelConfig

# name -> shape. Sizes follow GPT-3's table (Brown et al. 2020) with 8 experts on every other
# block (GShard/Switch placement); "tiny" trains on a 2-core CPU in minutes and is Mixtral-shaped
# (exports to transformers with ``moeflow convert --to-hf``); "mixtral-8x7b" is Mixtral's published shape.
GPT_PRESETS: dict[str, dict] = {
    "tiny": dict(dim=128, n_layers=4, n_heads=4, max_seq_len=128, moe_every=1, num_experts=8, top_k=2,
                 expert_hidden=256, tie_embeddings=True, router=RouterConfig(scoring="topk_softmax")),
    "small": dict(dim=768, n_layers=12, n_heads=12, max_seq_len=2048, moe_every=2, num_experts=8,
                  expert_hidden=2048, tie_embeddings=True),
    "medium": dict(dim=1024, n_layers=24, n_heads=16, max_seq_len=2048, moe_every=2, num_experts=8,
                   expert_hidden=2816, tie_embeddings=True),
    "large": dict(dim=1536, n_layers=24, n_heads=16, max_seq_len=2048, moe_every=2, num_experts=8,
                  expert_hidden=4096, tie_embeddings=True),
    "xl": dict(dim=2048, n_layers=24, n_heads=16, max_seq_len=2048, moe_every=2, num_experts=8,
               expert_hidden=5632, tie_embeddings=True),
    "gpt3-13b": dict(dim=5120, n_layers=40, n_heads=40, max_seq_len=2048, moe_every=2, num_experts=16,
                     expert_hidden=13824, tie_embeddings=True),
    "gpt3-175b": dict(dim=12288, n_layers=96, n_heads=96, max_seq_len=2048, moe_every=2, num_experts=16,
                      expert_hidden=32768, tie_embeddings=True),
    "mixtral-8x7b": dict(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, max_seq_len=32768,
                         moe_every=1, num_experts=8, top_k=2, expert_hidden=14336, norm_eps=1e-5,
                         rope_theta=1e6, router=RouterConfig(scoring="topk_softmax", load_balance_coef=0.02)),
}


def gpt_config(preset: str, **overrides: object) -> GPTConfig:
    """``GPTConfig`` of a named preset with ``overrides`` applied (e.g. ``vocab_size=256``)."""
    if preset not in GPT_PRESETS:
        raise ValueError(f"preset must be one of {sorted(GPT_PRESETS)}, got {preset!r}")
    fields = {"vocab_size": 50304, **GPT_PRESETS[preset], **overrides}
    return GPTConfig(**fields)  # type: ignore[arg-type]
