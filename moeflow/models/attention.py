"""Grouped-query attention of ``MoEGPT``'s blocks (legend: ``moeflow.models.gpt``; here also
``L`` key columns, ``R`` rotated dims of a head, ``M = N/G*S`` query rows of one key/value
head), with every option of ``AttentionConfig`` for ``kind="gqa"``, and the RMSNorm the blocks
and the query/key norms share.

Per block: ``q_proj`` / ``k_proj`` / ``v_proj`` (biases with ``qkv_bias``, Qwen2-MoE and
gpt-oss), the query/key norms (``qk_norm="head"``: over each head's ``Hd`` dims, Qwen3-MoE;
``"proj"``: over the whole projection before the head split, OLMoE), ``clip_qkv`` (OLMoE:
queries, keys and values clamped to ``[-clip, clip]`` after the norms), the rotary embedding
(``moeflow.models.rope``: scaled, partial, halves or pairs), causal attention (through a
sliding window on the blocks ``AttentionConfig.slides`` names: a key is visible to a query
``q - k < window`` columns behind it, transformers' ``sliding_window_overlay``), ``sinks``
(gpt-oss: a learned logit per head joins each softmax, taking probability mass but bringing no
value) and ``o_proj`` (a bias with ``o_bias``, gpt-oss).

Without sinks the attention is SDPA (``attend``); with sinks it is the readable softmax of
``attention_reference``, which is also the reference the SDPA path is tested against (SDPA
takes no extra logit; a zero key column carrying the sink in its mask would copy the whole
cache in every decode step).

Parameters start as transformers initialises them: norm weights ones, biases zeros; the sinks
start at zero here and ``MoEGPT`` draws them ``N(0, init_std)``, as transformers does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.models.gpt_config import GPTConfig
from moeflow.models.kv_cache import StaticStep, StepInputs
from moeflow.models.rope import rope_cos_sin, rotate

__all__ = ["RMSNorm", "Attention", "attend", "attention_reference", "window_mask"]


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


def window_mask(seq_len: int, window: int, device: torch.device | str | None) -> torch.Tensor:
    """``[S, S]`` (True = attend) of a whole sequence through a sliding window: key ``k`` is
    visible to query ``q`` when ``k <= q`` and ``q - k < window`` (the query itself and the
    ``window - 1`` keys before it)."""
    q_S1 = torch.arange(seq_len, device=device).unsqueeze(1)
    k_1S = torch.arange(seq_len, device=device).unsqueeze(0)
    return (k_1S <= q_S1) & (q_S1 - k_1S < window)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def attention_reference(q_BNSH: torch.Tensor, k_BGLH: torch.Tensor, v_BGLH: torch.Tensor, *,
                        mask: torch.Tensor | None, sinks_N: torch.Tensor | None = None, scale: float | None = None,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """``y [B, N, S, Hv]``: ``softmax(q k^T * scale + mask [, sink]) v``, written out.

    Query head ``n`` reads key/value head ``n // (N / G)`` (transformers' ``repeat_kv``, here a
    view: the query heads of one key/value head become a dimension of their own). ``mask``
    (bool, True = attend) broadcasts to ``[B, 1, S, L]``; None: every key is visible. ``sinks``:
    per head a logit appended to every row's softmax and dropped after it (gpt-oss's eager
    attention), so the row's probabilities add up to less than one. ``scale`` defaults to
    ``Hd ** -0.5``."""
    B, N, S, Hd = q_BNSH.shape
    G, L = k_BGLH.shape[1], k_BGLH.shape[2]
    # the N/G query heads of a key/value head as more query rows of it ([B, G, N/G*S, Hd]: a
    # view of contiguous queries, else one copy): one product per key/value head, and no
    # broadcast copy of the keys and values per query head
    q_BGMH = q_BNSH.reshape(B, G, N // G * S, Hd)
    logits_BGML = (q_BGMH @ k_BGLH.transpose(-1, -2)) * (Hd ** -0.5 if scale is None else scale)
    logits = logits_BGML.view(B, G, N // G, S, L)
    if mask is not None:
        logits = logits.masked_fill(~_as_4d(mask).unsqueeze(2), float("-inf"))
    if sinks_N is not None:
        sink = sinks_N.to(logits.dtype).view(1, G, N // G, 1, 1).expand(B, G, N // G, S, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :L]
    else:
        probs = torch.softmax(logits, dim=-1)
    probs = F.dropout(probs, p=dropout_p) if dropout_p else probs
    return (probs.reshape(B, G, N // G * S, L) @ v_BGLH).view(B, N, S, -1)


def attend(q_BNSH: torch.Tensor, k_BGLH: torch.Tensor, v_BGLH: torch.Tensor, *, mask: torch.Tensor | None,
           causal: bool, sinks_N: torch.Tensor | None = None, scale: float | None = None, dropout_p: float = 0.0
           ) -> torch.Tensor:
    """``y [B, N, S, Hv]`` of the queries over the keys/values: ``mask`` (bool, True = attend,
    broadcasting to ``[B, 1, S, L]``) or, without one, causal (``causal``: ``L == S``, a whole
    sequence or a prefill) or every key visible. Without sinks through SDPA, with sinks
    through ``attention_reference`` (the same values to rounding)."""
    B, N, S, Hd = q_BNSH.shape
    G = k_BGLH.shape[1]
    if sinks_N is not None:
        if mask is None and causal:
            mask = torch.ones(S, S, device=q_BNSH.device, dtype=torch.bool).tril()
        return attention_reference(q_BNSH, k_BGLH, v_BGLH, mask=mask, sinks_N=sinks_N, scale=scale,
                                   dropout_p=dropout_p)
    gqa = G != N
    if gqa and S == 1 and not causal:
        # one query per row (a decode step): the query heads sharing a KV head become its
        # query rows, so SDPA reads each cached key/value once per KV head, not once per
        # query head (a mask [B, 1, 1, L] broadcasts): less attention time (docs/benchmarks.md)
        y = F.scaled_dot_product_attention(q_BNSH.reshape(B, G, N // G, Hd), k_BGLH, v_BGLH, attn_mask=mask,
                                           dropout_p=dropout_p, scale=scale)
        return y.reshape(B, N, 1, -1)
    return F.scaled_dot_product_attention(q_BNSH, k_BGLH, v_BGLH, attn_mask=mask, is_causal=causal and mask is None,
                                          dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (``AttentionConfig``, kind
    ``"gqa"``) of block ``layer`` (which tells whether it attends through the sliding window)."""

    def __init__(self, config: GPTConfig, layer: int, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        a = config.attention
        if a.kind != "gqa":
            raise ValueError(f"Attention builds attention.kind='gqa', got {a.kind!r}")
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.rotary_dim, self.interleaved = config.rotary_dim, a.rope_interleaved
        self.theta, self.rope_scaling, self.dropout = config.rope_theta, config.rope_scaling, config.dropout
        self.qk_norm, self.clip = a.qk_norm, a.clip_qkv
        self.window = a.sliding_window if a.slides(layer) else None
        N, G, Hd, D = self.n_heads, self.n_kv, self.head_dim, config.dim
        self.q_proj = nn.Linear(D, N * Hd, bias=a.qkv_bias, **kw)
        self.k_proj = nn.Linear(D, G * Hd, bias=a.qkv_bias, **kw)
        self.v_proj = nn.Linear(D, G * Hd, bias=a.qkv_bias, **kw)
        self.o_proj = nn.Linear(N * Hd, D, bias=a.o_bias, **kw)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if a.qk_norm != "none":
            per_head = a.qk_norm == "head"
            self.q_norm = RMSNorm(Hd if per_head else N * Hd, config.norm_eps, **kw)
            self.k_norm = RMSNorm(Hd if per_head else G * Hd, config.norm_eps, **kw)
        self.sinks = nn.Parameter(torch.zeros(N, device=device, dtype=dtype)) if a.sinks else None
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                if lin.bias is not None:
                    lin.bias.zero_()

    def _project(self, lin: nn.Linear, norm: RMSNorm | None, x_BSD: torch.Tensor, heads: int) -> torch.Tensor:
        """``[B, heads, S, Hd]``: the projection, its norm (over the projection or per head) and
        clip, split into heads."""
        B, S, _ = x_BSD.shape
        y = lin(x_BSD)
        if norm is not None and self.qk_norm == "proj":
            y = norm(y)
        y = y.view(B, S, heads, self.head_dim)
        if norm is not None and self.qk_norm == "head":
            y = norm(y)
        if self.clip is not None:
            y = y.clamp(-self.clip, self.clip)
        return y.transpose(1, 2)

    def forward(self, x_BSD: torch.Tensor, step: StepInputs | StaticStep | None = None, layer: int = 0
                ) -> torch.Tensor:
        """Without ``step``: the whole sequence, causal (through the window on a sliding block),
        positions ``0 .. S-1``. With ``step`` (incremental decoding): the new columns'
        keys/values go into ``step.cache`` at block ``layer`` and the queries attend over every
        cached column, at each row's positions; a ``StaticStep`` (one column) writes column
        ``step.pos`` and attends over the whole cache through its mask (the same shapes at
        every step). A sliding block takes the step's window mask."""
        B, S, _ = x_BSD.shape
        q = self._project(self.q_proj, self.q_norm, x_BSD, self.n_heads)
        k = self._project(self.k_proj, self.k_norm, x_BSD, self.n_kv)
        v = self._project(self.v_proj, None, x_BSD, self.n_kv)
        if step is None:
            cos, sin = rope_cos_sin(S, self.rotary_dim, self.theta, x_BSD.device, q.dtype, scaling=self.rope_scaling)
            mask = None if self.window is None else window_mask(S, self.window, x_BSD.device)
            causal = mask is None
        else:
            if self.window is not None and step.cache.window != self.window:
                raise ValueError(f"block {layer} slides over {self.window} columns but the cache's masks are for "
                                 f"window={step.cache.window} (MoEGPT.new_cache makes a cache for its model)")
            cos, sin = step.cos, step.sin
            if self.window is not None:
                mask, causal = step.window_mask, False
            else:
                mask, causal = step.mask, isinstance(step, StepInputs) and step.causal
        q = rotate(q, cos, sin, interleaved=self.interleaved)
        k = rotate(k, cos, sin, interleaved=self.interleaved)
        if isinstance(step, StaticStep):
            k, v = step.cache.write_at(layer, step.pos, k, v)
        elif step is not None:
            k, v = step.cache.write(layer, step.start, k, v)
        y = attend(q, k, v, mask=mask, causal=causal, sinks_N=self.sinks,
                   dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))
