"""The shape of a ``MoEGPT`` (``GPTConfig``) and the named presets (``GPT_PRESETS``,
``gpt_config``): what ``moeflow.models.gpt`` builds the model from and checkpoints save (as JSON,
``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import torch

from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig, _int

__all__ = ["GPTConfig", "GPT_PRESETS", "gpt_config"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a ``MoEGPT``; validated on construction (the MoE part through ``MoEConfig``).

    ``dense_hidden`` is the FFN width of the dense blocks (default ``expert_hidden``), and
    ``expert_hidden`` the width of each routed expert. ``tie_embeddings`` shares the input
    embedding with the output projection (GPT-2/3); Mixtral unties them.
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
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
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
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"dim={self.dim} must split into n_heads={self.n_heads} heads of even size")
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

    def is_moe_layer(self, i: int) -> bool:
        return self.moe_every > 0 and (i + 1) % self.moe_every == 0

    def moe_config(self) -> MoEConfig:
        return MoEConfig(
            dim=self.dim, hidden=self.expert_hidden, num_experts=self.num_experts, top_k=self.top_k,
            capacity_factor=self.capacity_factor, router=self.router, dispatch=self.dispatch,
            experts=dataclasses.replace(self.experts, init_std=self.init_std),
            num_shared_experts=self.num_shared_experts,
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
