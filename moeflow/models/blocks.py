"""The decoder blocks of ``MoEGPT`` (legend: ``moeflow.models.gpt``): RMSNorm, rotary position
embeddings, causal grouped-query attention (whole sequence, cached or static step) and the
pre-norm block around it, whose FFN is a ``moeflow.MoE`` on MoE blocks and a ``DenseFFN``
otherwise. Parameter names follow Hugging Face's Llama/Mixtral naming (``q_proj``, ``o_proj``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.experts import DenseFFN
from moeflow.layer import MoE
from moeflow.models.gpt_config import GPTConfig
from moeflow.models.kv_cache import StaticStep, StepInputs

__all__ = ["RMSNorm", "rope_cos_sin", "apply_rope", "Attention", "Block"]


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
            # query head (a mask [B, 1, 1, L] broadcasts): less attention time (docs/benchmarks.md)
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
