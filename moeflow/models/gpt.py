"""A decoder-only MoE language model you can read on one screen (legend below).

Llama/Mixtral-style blocks: RMSNorm, rotary position embeddings, grouped-query attention,
gated FFNs. Every ``moe_every``-th block (fairseq's ``moe_freq``: block ``i`` is MoE when
``(i + 1) % moe_every == 0``) replaces its FFN with a ``moeflow.MoE`` layer; ``moe_every=1``
makes every block MoE (Mixtral), 0 makes a dense model. Parameter names follow Hugging Face's
Llama/Mixtral naming where there is one (``q_proj``, ``o_proj``), which keeps
``moeflow.convert.mixtral`` (Mixtral import/export) a table of renames.

Legend: ``B`` batch, ``S`` sequence length, ``D`` model dim, ``V`` vocabulary, ``N`` heads,
``G`` key/value heads, ``Hd`` head dim, ``T = B*S`` tokens seen by the MoE layers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig, _int
from moeflow.experts import DenseFFN
from moeflow.layer import MoE
from moeflow.models.kv_cache import KVCache, StaticStep, StepInputs, static_step, step_inputs

__all__ = ["GPTConfig", "MoEGPT", "RMSNorm", "GPT_PRESETS", "gpt_config"]


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


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 (as Llama/Mixtral do) and cast back."""

    def __init__(self, dim: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype):
    """``cos, sin [S, Hd]`` of rotary embeddings, computed in fp32 (fp64 stays fp64), halves
    duplicated (the "rotate half" convention of GPT-NeoX/Llama); the first half of ``sin``
    is negated, which is the sign ``apply_rope`` needs (it then rotates with one ``roll``)."""
    cdt = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).to(cdt) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.int64).to(cdt), inv_freq)
    sin_SH = angles_SH.sin()
    emb = torch.cat([angles_SH, angles_SH], dim=-1)
    return emb.cos().to(dtype), torch.cat([-sin_SH, sin_SH], dim=-1).to(dtype)


def apply_rope(x_BNSH: torch.Tensor, cos_SH: torch.Tensor, sin_SH: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written as
    ``roll(x, Hd/2) * sin`` with ``sin``'s first half negated (``rope_cos_sin``): the same
    values bit for bit, two ops fewer per call (a decode step calls it twice per block)."""
    return x_BNSH * cos_SH + x_BNSH.roll(x_BNSH.shape[-1] // 2, dims=-1) * sin_SH


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings."""

    def __init__(self, config: GPTConfig, **kw: object) -> None:
        super().__init__()
        self.n_heads, self.n_kv = config.n_heads, config.kv_heads
        self.head_dim = config.dim // config.n_heads
        self.theta, self.dropout = config.rope_theta, config.dropout
        self.q_proj = nn.Linear(config.dim, self.n_heads * self.head_dim, bias=False, **kw)
        self.k_proj = nn.Linear(config.dim, self.n_kv * self.head_dim, bias=False, **kw)
        self.v_proj = nn.Linear(config.dim, self.n_kv * self.head_dim, bias=False, **kw)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.dim, bias=False, **kw)

    def forward(self, x_BSD: torch.Tensor, step: StepInputs | StaticStep | None = None, layer: int = 0
                ) -> torch.Tensor:
        """Without ``step``: the whole sequence, causal, positions ``0 .. S-1``. With ``step``
        (incremental decoding): the new columns' keys/values go into ``step.cache`` at block
        ``layer`` and the queries attend over every cached column, at each row's positions; a
        ``StaticStep`` (one column) writes column ``step.pos`` and attends over the whole cache
        through its mask (the same shapes at every step)."""
        B, S, _ = x_BSD.shape
        q = self.q_proj(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSD).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSD).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        if step is None:
            cos, sin = rope_cos_sin(S, self.head_dim, self.theta, x_BSD.device, q.dtype)
            mask, causal = None, True
        elif isinstance(step, StaticStep):
            cos, sin, mask, causal = step.cos, step.sin, step.mask, False
        else:
            cos, sin, mask, causal = step.cos, step.sin, step.mask, step.causal
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(step, StaticStep):
            k, v = step.cache.write_at(layer, step.pos, k, v)
        elif step is not None:
            k, v = step.cache.write(layer, step.start, k, v)
        gqa = self.n_kv != self.n_heads
        if gqa and S == 1 and not causal:
            # one query per row (a decode step): the query heads sharing a KV head become its
            # query rows, so SDPA reads each cached key/value once per KV head, not once per
            # query head (a mask [B, 1, 1, L] broadcasts): ~13% less attention time at B=8
            q, gqa = q.reshape(B, self.n_kv, -1, self.head_dim), False
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0, enable_gqa=gqa,
        )
        return self.o_proj(y.reshape(B, self.n_heads, S, self.head_dim).transpose(1, 2).reshape(B, S, -1))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; the FFN
    is a ``moeflow.MoE`` on MoE blocks and a ``DenseFFN`` otherwise."""

    def __init__(self, config: GPTConfig, moe: bool, **kw: object) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.attn = Attention(config, **kw)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.ffn: nn.Module
        if moe:
            self.ffn = MoE(config=config.moe_config(), **kw)  # type: ignore[arg-type]
        else:
            self.ffn = DenseFFN(dim=config.dim, hidden=config.dense_hidden or config.expert_hidden,
                                activation=config.experts.activation, bias=config.experts.bias,
                                init_std=config.init_std, **kw)  # type: ignore[arg-type]
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()  # no op per call

    def forward(self, x_BSD: torch.Tensor, step: StepInputs | StaticStep | None = None, layer: int = 0
                ) -> torch.Tensor:
        """``step`` given: a cached call (generation, ``MoEGPT.forward_cached`` and
        ``decode_step``), whose MoE balance losses nobody reads, so the MoE skips them
        (``MoE.forward(losses=False)``)."""
        x_BSD = x_BSD + self.drop(self.attn(self.attn_norm(x_BSD), step, layer))
        h_BSD = self.ffn_norm(x_BSD)
        if step is None:
            return x_BSD + self.drop(self.ffn(h_BSD))
        ffn = partial(self.ffn, losses=False) if isinstance(self.ffn, MoE) else self.ffn
        if isinstance(step, StaticStep) or step.real_T is None:  # (a decode column is real in every row)
            return x_BSD + self.drop(ffn(h_BSD))
        # left padding: the FFN (the MoE's routing and capacity) sees the real tokens only
        h_TD = h_BSD.reshape(-1, h_BSD.shape[-1])
        y_TD = torch.zeros_like(h_TD).index_copy_(0, step.real_T, ffn(h_TD.index_select(0, step.real_T)))
        return x_BSD + self.drop(y_TD.view_as(x_BSD))


class MoEGPT(nn.Module):
    """Decoder-only MoE language model: ``logits [B, S, V] = model(idx [B, S])``.

    ``model.loss(idx, targets)`` is the mean next-token cross-entropy (fp32); add
    ``moeflow.aux_loss(model)`` for the balance losses of the same call.
    """

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.embed = nn.Embedding(config.vocab_size, config.dim, **kw)
        self.layers = nn.ModuleList(Block(config, config.is_moe_layer(i), **kw) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, **kw)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, **kw)
        self.drop = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()  # no op per call
        self._init_dense(config.init_std)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def _init_dense(self, std: float) -> None:
        # GPT-2's scheme: N(0, std) everywhere, output projections scaled by 1/sqrt(2 * layers)
        # so the residual stream's variance does not grow with depth. Experts init themselves.
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.layers:
            attn = block.attn
            for lin in (attn.q_proj, attn.k_proj, attn.v_proj):
                nn.init.normal_(lin.weight, std=std)
            nn.init.normal_(attn.o_proj.weight, std=std / math.sqrt(2 * self.config.n_layers))

    def forward(self, idx_BS: torch.Tensor) -> torch.Tensor:
        self._check_idx(idx_BS)
        return self.lm_head(self.hidden_states(idx_BS))

    def _check_idx(self, idx_BS: torch.Tensor) -> None:
        if not isinstance(idx_BS, torch.Tensor) or idx_BS.dtype not in (torch.int64, torch.int32) or idx_BS.dim() != 2:
            raise TypeError(f"idx must be an int64/int32 tensor [batch, seq], got {getattr(idx_BS, 'dtype', type(idx_BS))} "
                            f"{tuple(getattr(idx_BS, 'shape', ()))}")
        if idx_BS.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {idx_BS.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")

    def hidden_states(self, idx_BS: torch.Tensor) -> torch.Tensor:
        """The final normed hidden states ``[B, S, D]`` (what the output projection reads)."""
        x_BSD = self.drop(self.embed(idx_BS))
        for block in self.layers:
            x_BSD = block(x_BSD)
        return self.norm(x_BSD)

    def loss(self, idx_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``targets`` given ``idx`` (computed in at least fp32).

        An output projection with a ``cross_entropy(h_TD, targets_T)`` method (the
        vocabulary-parallel head of ``moeflow.models.vocab_parallel``) computes the per-token
        losses itself, without full logits."""
        head_loss = getattr(self.lm_head, "cross_entropy", None)
        if head_loss is not None:
            self._check_idx(idx_BS)
            return head_loss(self.hidden_states(idx_BS).flatten(0, 1), targets_BS.flatten()).mean()
        logits_BSV = self(idx_BS)
        logits_BSV = logits_BSV.to(torch.promote_types(logits_BSV.dtype, torch.float32))
        return F.cross_entropy(logits_BSV.flatten(0, 1), targets_BS.flatten())

    def new_cache(self, pad_B: torch.Tensor, capacity: int, *, zeroed: bool = False) -> KVCache:
        """An empty ``KVCache`` for ``len(pad_B)`` rows (``pad_B[b]`` left-pad columns in row
        ``b``) and ``capacity <= max_seq_len`` columns, on the model's device and dtype
        (``zeroed``: filled with zeros, as ``decode_step`` needs)."""
        _int("capacity", capacity, minimum=1)
        if capacity > self.config.max_seq_len:
            raise ValueError(f"capacity={capacity} exceeds max_seq_len={self.config.max_seq_len}")
        ref = self.embed.weight
        head_dim = self.config.dim // self.config.n_heads
        cos, sin = rope_cos_sin(capacity, head_dim, self.config.rope_theta, ref.device, ref.dtype)
        return KVCache(n_layers=self.config.n_layers, batch=pad_B.shape[0], kv_heads=self.config.kv_heads,
                       head_dim=head_dim, capacity=capacity, pad_B=pad_B, cos_LH=cos, sin_LH=sin,
                       device=ref.device, dtype=ref.dtype, zeroed=zeroed)

    def forward_cached(self, idx_BS: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, V]`` of the last column after appending ``idx [B, S]`` to ``cache``: the
        prompt into an empty cache (prefill; left-pad columns as ``cache.pad_B`` says), or one
        token per row (decode). Equal to ``self(whole sequence)[:, -1]`` up to rounding. Each
        block runs its usual layers (the MoE's dispatcher and experts included), on the new
        columns only."""
        self._check_idx(idx_BS)
        if idx_BS.shape[0] != cache.batch:
            raise ValueError(f"idx has {idx_BS.shape[0]} rows but the cache holds {cache.batch}")
        step = step_inputs(cache, idx_BS.shape[1])
        x_BSD = self.drop(self.embed(idx_BS))
        for i, block in enumerate(self.layers):
            x_BSD = block(x_BSD, step, i)
        cache.length += idx_BS.shape[1]
        return self.lm_head(self.norm(x_BSD[:, -1]))

    def decode_step(self, next_B: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits ``[B, V]`` after appending token ``next_B[b]`` to row ``b`` at column ``pos``
        (a 0-dim int64 device tensor, ``pos < cache.capacity``; the columns before it filled by a
        prefill and earlier steps) of a zeroed cache (``new_cache(..., zeroed=True)``).

        The *static* decode step: its shapes depend on the cache alone and nothing in it reads
        a tensor on the host, so ``torch.compile(fullgraph=True)`` compiles it once per batch
        size and cache capacity, and CUDA graphs replay it (``generate(..., compile=True)``).
        It attends over all ``L`` columns (the unwritten ones masked): more attention work than
        ``forward_cached`` on a short cache, the price of one shape for every step. Equal to
        ``forward_cached`` up to rounding. The caller advances ``pos``; ``cache.length`` is not
        touched."""
        return self.lm_head(self.decode_hidden(next_B, pos, cache))

    def decode_hidden(self, next_B: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``decode_step`` without the head: the normed last hidden state ``[B, D]`` whose
        ``lm_head`` is the step's logits (the CPU's compiled decoder multiplies the head itself,
        in the layout fastest for its rows: ``moeflow.models.compiled_decode.HeadProduct``)."""
        step = static_step(cache, pos)
        x_BSD = self.embed(next_B.unsqueeze(1))
        for i, block in enumerate(self.layers):
            x_BSD = block(x_BSD, step, i)
        return self.norm(x_BSD[:, -1])

    @torch.no_grad()
    def generate(self, idx_BS: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float = 1.0, eos: int | Sequence[int] | None = None,
                 generator: torch.Generator | None = None, use_cache: bool = True) -> torch.Tensor:
        """Append up to ``max_new_tokens`` tokens to each row of ``idx [B, S]``; ``temperature=0``
        is greedy, else sampling from the softmax at ``temperature``, cut to the ``top_k`` most
        likely tokens (None or 0: all) and to the smallest set of mass ``>= top_p``.

        The context of each new token is the last ``max_seq_len`` tokens (longer rows are
        cropped, as a model trained at that length sees them). A row stops after producing a
        token of ``eos``; the result is ``[B, S + n]`` with ``n`` the steps taken, a stopped
        row repeating its stop token to the end. ``use_cache=False`` re-runs the whole
        context per token (the reference of the cached path; same tokens). Ragged prompts and
        timings: ``moeflow.models.generation.generate``."""
        from moeflow.models.generation import generate_tensor

        return generate_tensor(self, idx_BS, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               eos=eos, generator=generator, use_cache=use_cache)

    def num_parameters(self) -> tuple[int, int]:
        """``(total, active per token)``: active counts k of the E experts of each MoE block."""
        total = sum(p.numel() for p in self.parameters())
        expert = sum(p.numel() for p in self.parameters() if getattr(p, "moeflow_expert", False))
        c = self.config
        active = total - expert + (expert * c.top_k // c.num_experts if c.moe_every else 0)
        return total, active
