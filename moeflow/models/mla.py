"""Multi-head latent attention of ``MoEGPT``'s blocks (DeepSeek-V2/V3, Kimi-K2;
``AttentionConfig(kind="mla")``), with a KV cache that keeps the compressed latent (legend below).

Per block (the parameter names of issue 47's design; transformers' in brackets):

- queries: ``q_proj`` ``[N*(P+R), D]`` when ``q_lora_rank`` is None, else the bottleneck
  ``q_a_proj`` ``[Q, D]`` -> ``q_a_norm`` (RMSNorm over ``Q``) -> ``q_b_proj`` ``[N*(P+R), Q]``
  [``q_a_layernorm``]; each head's ``P + R`` dims split into an unrotated part ``P`` and a
  rotary part ``R``;
- keys and values: ``kv_a_proj`` ``[C+R, D]`` [``kv_a_proj_with_mqa``] gives the latent ``C``
  (normed by ``kv_a_norm`` [``kv_a_layernorm``]) and one rotary key part ``R`` that every head
  shares; ``kv_b_proj`` ``[N*(P+Hv), C]`` expands the latent into each head's unrotated key
  part ``P`` and value ``Hv``;
- ``o_proj`` ``[D, N*Hv]`` (a bias with ``o_bias``).

The cache (``moeflow.models.kv_cache.KVCache`` with one head, ``k_dim=C``, ``v_dim=R``) keeps
per block the normed latent ``[B, 1, L, C]`` and the rotated key part ``[B, 1, L, R]``: ``C + R``
numbers a column instead of ``N * (P + R + Hv)`` for expanded keys and values, the point of
latent attention (DeepSeek-V3: 576 instead of 40960).

The same attention in two forms, the first the reference of the second:

- *expanded* (``expanded_attention``; transformers' ``DeepseekV3Attention``): ``kv_b_proj``
  over every column gives per-head keys ``cat(k_nope, k_rot)`` and values, then SDPA. The whole
  sequence (training) and the prefill run it.
- *absorbed* (``absorbed_attention``; DeepSeek's inference code, ``attn_impl="absorb"``): the
  key half of ``kv_b_proj`` folded into the query (``q_nope W_UK`` lives in the latent space,
  so ``q_nope . k_nope = (q_nope W_UK) . latent``) and its value half applied after the
  attention (``sum_l p_l (W_UV latent_l) = W_UV sum_l p_l latent_l``): a step reads the cached
  latent as it is and never materialises per-head keys or values over the cache. A one-column
  call (eager decode, the static step) runs it; per step it does ``O(N*C*(P+Hv) + N*L*(C+R))``
  work where the expanded form does ``O(L*C*N*(P+Hv))``.

The softmax scale is ``(P+R) ** -0.5`` with DeepSeek's YaRN correction
(``moeflow.models.rope.softmax_scale``). The two latent norms take ``LATENT_NORM_EPS``, not
``GPTConfig.norm_eps``: transformers and DeepSeek's own code build them with RMSNorm's default
epsilon whatever the model's ``rms_norm_eps``.

Legend: ``B`` rows, ``S`` columns of this call, ``L`` key columns (``S``, or the cache's), ``D``
model dim, ``N`` heads, ``P`` unrotated query/key dims of a head (``qk_nope_head_dim``), ``R``
rotary dims (``qk_rope_head_dim``), ``Hv`` value dims (``v_head_dim``), ``C`` latent rank
(``kv_lora_rank``), ``Q`` query rank (``q_lora_rank``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.models.attention import RMSNorm, attend
from moeflow.models.gpt_config import GPTConfig
from moeflow.models.kv_cache import StaticStep, StepInputs
from moeflow.models.rope import rope_cos_sin, rotate, softmax_scale

__all__ = ["LatentAttention", "expanded_attention", "absorbed_attention", "LATENT_NORM_EPS"]

LATENT_NORM_EPS = 1e-6  # q_a_norm / kv_a_norm: transformers' and DeepSeek's RMSNorm default


def _kv_b_heads(w_kv_b: torch.Tensor, heads: int, nope: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_b_proj.weight`` ``[N*(P+Hv), C]`` as its key half ``W_UK [N, P, C]`` and value half
    ``W_UV [N, Hv, C]`` (views)."""
    w_NXC = w_kv_b.view(heads, -1, w_kv_b.shape[-1])
    return w_NXC[:, :nope], w_NXC[:, nope:]


def expanded_attention(q_nope_BNSP: torch.Tensor, q_rot_BNSR: torch.Tensor, latent_B1LC: torch.Tensor,
                       k_rot_B1LR: torch.Tensor, w_kv_b: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
                       scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """``y [B, N, S, Hv]``, the readable form: the latent of every column expanded through
    ``kv_b_proj`` (``w_kv_b [N*(P+Hv), C]``) into per-head keys (the rotary part shared by the
    heads) and values, then ``attend`` (``mask``: bool, True = attend, broadcasting to ``[B, 1,
    S, L]``; without one ``causal`` or every key visible)."""
    B, N, S, P = q_nope_BNSP.shape
    L, R = latent_B1LC.shape[2], k_rot_B1LR.shape[-1]
    kv_BNLX = F.linear(latent_B1LC.squeeze(1), w_kv_b).view(B, L, N, -1).transpose(1, 2)
    k_nope_BNLP, v_BNLHv = kv_BNLX.split([P, kv_BNLX.shape[-1] - P], dim=-1)
    k_BNLK = torch.cat([k_nope_BNLP, k_rot_B1LR.expand(B, N, L, R)], dim=-1)
    q_BNSK = torch.cat([q_nope_BNSP, q_rot_BNSR], dim=-1)
    return attend(q_BNSK, k_BNLK, v_BNLHv, mask=mask, causal=causal, scale=scale, dropout_p=dropout_p)


def absorbed_attention(q_nope_BNSP: torch.Tensor, q_rot_BNSR: torch.Tensor, latent_B1LC: torch.Tensor,
                       k_rot_B1LR: torch.Tensor, w_kv_b: torch.Tensor, *, mask: torch.Tensor | None, causal: bool,
                       scale: float, dropout_p: float = 0.0) -> torch.Tensor:
    """``expanded_attention``'s result with ``kv_b_proj`` absorbed: the queries' unrotated part
    mapped into the latent space by the key half ``W_UK`` (``q_lat``), the logits ``(q_lat .
    latent + q_rot . k_rot) * scale`` against the cached columns as they are, the softmax's
    average of latents mapped to values by the value half ``W_UV``.

    The weight products batch over the heads (``[N, B*S, .]``); the attention batches over the
    rows, a row's heads and query columns one matrix of ``M = N*S`` rows against the row's
    single latent "head" (a broadcast over the heads would copy the cache ``N`` times). Plain
    matrix products, no einsum: a decode step is a handful of small products, and each op's
    overhead counts. Softmax in at least fp32."""
    B, N, S, P = q_nope_BNSP.shape
    L, C, R = latent_B1LC.shape[2], latent_B1LC.shape[-1], k_rot_B1LR.shape[-1]
    w_uk_NPC, w_uv_NHvC = _kv_b_heads(w_kv_b, N, P)
    latent_BLC, k_rot_BLR = latent_B1LC.squeeze(1), k_rot_B1LR.squeeze(1)
    q_lat_NTC = q_nope_BNSP.transpose(0, 1).reshape(N, B * S, P) @ w_uk_NPC
    q_lat_BMC = q_lat_NTC.view(N, B, S, C).transpose(0, 1).reshape(B, N * S, C)
    rot_BML = q_rot_BNSR.reshape(B, N * S, R) @ k_rot_BLR.transpose(1, 2)
    logits_BML = torch.baddbmm(rot_BML, q_lat_BMC, latent_BLC.transpose(1, 2), beta=scale, alpha=scale)
    logits_BNSL = logits_BML.view(B, N, S, L)
    if mask is None and causal:
        mask = torch.ones(S, L, device=logits_BNSL.device, dtype=torch.bool).tril(L - S)
    if mask is not None:
        logits_BNSL = logits_BNSL.masked_fill(~mask, float("-inf"))
    soft = torch.promote_types(logits_BNSL.dtype, torch.float32)
    probs_BNSL = torch.softmax(logits_BNSL.to(soft), dim=-1).to(latent_BLC.dtype)
    probs_BNSL = F.dropout(probs_BNSL, p=dropout_p) if dropout_p else probs_BNSL
    o_lat_BMC = probs_BNSL.reshape(B, N * S, L) @ latent_BLC
    y_NTHv = o_lat_BMC.view(B, N, S, C).transpose(0, 1).reshape(N, B * S, C) @ w_uv_NHvC.transpose(1, 2)
    return y_NTHv.view(N, B, S, -1).transpose(0, 1)


class LatentAttention(nn.Module):
    """Causal multi-head latent attention with a decoupled rotary part (``AttentionConfig``,
    kind ``"mla"``): whole sequence, cached call or static step (see the module docstring)."""

    def __init__(self, config: GPTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        a = config.attention
        if a.kind != "mla":
            raise ValueError(f"LatentAttention builds attention.kind='mla', got {a.kind!r}")
        self.n_heads, self.nope, self.rope_dim = config.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
        self.rank, self.v_head_dim, self.interleaved = a.kv_lora_rank, a.v_head_dim, a.rope_interleaved
        self.theta, self.rope_scaling, self.dropout = config.rope_theta, config.rope_scaling, config.dropout
        self.scale = softmax_scale(self.nope + self.rope_dim, config.rope_scaling)
        N, D, K = self.n_heads, config.dim, self.nope + self.rope_dim
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if a.q_lora_rank is None:
            self.q_proj = nn.Linear(D, N * K, bias=False, **kw)
        else:
            self.q_a_proj = nn.Linear(D, a.q_lora_rank, bias=False, **kw)
            self.q_a_norm = RMSNorm(a.q_lora_rank, LATENT_NORM_EPS, **kw)
            self.q_b_proj = nn.Linear(a.q_lora_rank, N * K, bias=False, **kw)
        self.kv_a_proj = nn.Linear(D, self.rank + self.rope_dim, bias=False, **kw)
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS, **kw)
        self.kv_b_proj = nn.Linear(self.rank, N * (self.nope + self.v_head_dim), bias=False, **kw)
        self.o_proj = nn.Linear(N * self.v_head_dim, D, bias=a.o_bias, **kw)
        if self.o_proj.bias is not None:
            with torch.no_grad():
                self.o_proj.bias.zero_()

    def _queries(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_nope [B, N, S, P]``, ``q_rot [B, N, S, R]`` (not yet rotated)."""
        B, S, _ = x_BSD.shape
        if self.q_proj is not None:
            q = self.q_proj(x_BSD)
        else:
            assert self.q_a_proj is not None and self.q_a_norm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSD)))
        q_nope, q_rot = q.view(B, S, self.n_heads, -1).transpose(1, 2).split([self.nope, self.rope_dim], dim=-1)
        return q_nope, q_rot

    def forward(self, x_BSD: torch.Tensor, step: StepInputs | StaticStep | None = None, layer: int = 0
                ) -> torch.Tensor:
        """Without ``step``: the whole sequence, causal, positions ``0 .. S-1`` (expanded form).
        With ``step`` (incremental decoding): this call's latent and rotated key part go into
        ``step.cache`` at block ``layer`` (a ``StaticStep`` writes column ``step.pos`` and
        attends over the whole cache through its mask) and the queries attend over every cached
        column: a prefill in the expanded form, a one-column call in the absorbed form."""
        B, S, _ = x_BSD.shape
        q_nope, q_rot = self._queries(x_BSD)
        latent_BSC, k_rot_BSR = self.kv_a_proj(x_BSD).split([self.rank, self.rope_dim], dim=-1)
        latent_B1SC = self.kv_a_norm(latent_BSC).unsqueeze(1)
        k_rot_B1SR = k_rot_BSR.unsqueeze(1)
        if step is None:
            cos, sin = rope_cos_sin(S, self.rope_dim, self.theta, x_BSD.device, q_rot.dtype, scaling=self.rope_scaling)
            mask, causal = None, True
        else:
            cos, sin = step.cos, step.sin
            mask, causal = step.mask, isinstance(step, StepInputs) and step.causal
        q_rot = rotate(q_rot, cos, sin, interleaved=self.interleaved)
        k_rot_B1SR = rotate(k_rot_B1SR, cos, sin, interleaved=self.interleaved)
        if isinstance(step, StaticStep):
            latent_B1SC, k_rot_B1SR = step.cache.write_at(layer, step.pos, latent_B1SC, k_rot_B1SR)
        elif step is not None:
            latent_B1SC, k_rot_B1SR = step.cache.write(layer, step.start, latent_B1SC, k_rot_B1SR)
        form = absorbed_attention if step is not None and S == 1 else expanded_attention
        y_BNSHv = form(q_nope, q_rot, latent_B1SC, k_rot_B1SR, self.kv_b_proj.weight, mask=mask, causal=causal,
                       scale=self.scale, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y_BNSHv.transpose(1, 2).reshape(B, S, -1))
