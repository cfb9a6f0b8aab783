"""Rotary position embeddings of ``MoEGPT``'s attention (legend below): the tables of
``rope_theta`` with a ``RopeScaling`` on top (none, linear, YaRN, with transformers' formulas),
a rotated share of each head (partial rotary), the two rotations (halves, as GPT-NeoX/Llama
rotate; adjacent pairs, as DeepSeek lays its rotary part out) and DeepSeek's softmax scale.

One table layout serves both rotations: ``cos, sin [S, R]`` are the angles' cosines and sines
with the halves duplicated (``cat(f, f)``, as transformers builds them), ``sin``'s first half
negated, scaled by YaRN's attention factor. The negated half lets the half rotation be one
``roll`` (``apply_rope``); the pair rotation reads the first half of ``cos`` and the second
(unnegated) half of ``sin`` (``apply_rope_interleaved``).

The frequencies follow transformers' ``modeling_rope_utils`` formula for formula and are
computed in fp32 (fp64 tables in fp64, where transformers stays in fp32): fp32 tables equal
transformers' rotary embedding's.

Legend: ``S`` positions, ``R`` rotated dims of a head (``GPTConfig.rotary_dim``, even), ``Hd``
head dim (``R <= Hd``: the other ``Hd - R`` dims pass through unrotated), ``B`` rows, ``N``
heads.
"""

from __future__ import annotations

import math

import torch

from moeflow.models.gpt_config import RopeScaling

__all__ = ["rope_frequencies", "rope_cos_sin", "apply_rope", "apply_rope_interleaved", "rotate", "yarn_mscale",
           "softmax_scale"]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for ``scale <= 1``):
    transformers' ``get_mscale`` (rope utils) and ``yarn_get_mscale`` (DeepSeek-V3)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(qk_head_dim: int, scaling: RopeScaling | None) -> float:
    """The attention logits' scale of DeepSeek's latent attention: ``qk_head_dim ** -0.5``,
    times ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the rotary embedding is scaled and
    ``mscale_all_dim`` is set (transformers' ``yarn_apply_mscale``: the YaRN attention factor
    of the tables is then ``mscale / mscale_all_dim``-based, and the rest of the correction goes
    into the softmax). Grouped-query attention keeps ``head_dim ** -0.5`` (gpt-oss, Qwen)."""
    scale = qk_head_dim ** (-0.5)
    if scaling is not None and scaling.mscale_all_dim:
        m = yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        scale = scale * m * m
    return scale


def _yarn(inv_extra_R: torch.Tensor, pos_freqs_R: torch.Tensor, rotary_dim: int, theta: float,
          scaling: RopeScaling) -> torch.Tensor:
    """YaRN's blend (transformers' ``_compute_yarn_parameters``): per frequency, interpolation
    (``1 / (factor * base^(2i/R))``) below ``beta_slow`` rotations over the original context,
    extrapolation (the unscaled frequency) above ``beta_fast``, a linear ramp between."""
    R, original = rotary_dim, scaling.original_max_seq_len
    assert original is not None  # (RopeScaling refuses kind="yarn" without it)

    def correction_dim(rotations: float) -> float:  # the dimension making ``rotations`` turns
        return (R * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, R - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = ((torch.arange(R // 2, device=inv_extra_R.device, dtype=inv_extra_R.dtype) - low) / (high - low)).clamp(0, 1)
    extra_weight = 1 - ramp
    inv_inter = 1.0 / (scaling.factor * pos_freqs_R)
    return inv_inter * (1 - extra_weight) + inv_extra_R * extra_weight


def rope_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling | None = None, *,
                     device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, float]:
    """``(inv_freq [R/2], attention_factor)``: the rotation frequencies of a head's ``R`` rotated
    dims, and the factor that scales ``cos``/``sin`` (1 but for YaRN), in ``dtype`` (at least
    fp32). transformers' rope init functions: the default ``1 / theta^(2i/R)``; ``linear``
    divides by ``factor``; ``yarn`` blends (``_yarn``) and infers the factor from ``factor``,
    ``mscale`` and ``mscale_all_dim`` unless ``attention_factor`` is given."""
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even int >= 2, got {rotary_dim!r}")
    cdt = torch.promote_types(dtype, torch.float32)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).to(cdt) / rotary_dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    if scaling.kind == "linear":
        return (1.0 / pos_freqs) / scaling.factor, 1.0
    factor = scaling.attention_factor
    if factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            factor = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        else:
            factor = yarn_mscale(scaling.factor)
    return _yarn(1.0 / pos_freqs, pos_freqs, rotary_dim, theta, scaling), float(factor)


def rope_cos_sin(seq_len: int, rotary_dim: int, theta: float, device: torch.device | str | None,
                 dtype: torch.dtype, *, scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [S, R]`` of positions ``0 .. S-1``, computed in fp32 (fp64 stays fp64), halves
    duplicated (the "rotate half" convention of GPT-NeoX/Llama), scaled by the attention factor
    of ``scaling``; the first half of ``sin`` is negated, which is the sign ``apply_rope`` needs
    (it then rotates with one ``roll``)."""
    inv_freq, factor = rope_frequencies(rotary_dim, theta, scaling, device=device, dtype=dtype)
    angles_SR = torch.outer(torch.arange(seq_len, device=device, dtype=torch.int64).to(inv_freq.dtype), inv_freq)
    emb = torch.cat([angles_SR, angles_SR], dim=-1)
    cos, sin_SR = emb.cos(), angles_SR.sin()
    if factor != 1.0:
        cos, sin_SR = cos * factor, sin_SR * factor
    return cos.to(dtype), torch.cat([-sin_SR, sin_SR], dim=-1).to(dtype)


def apply_rope(x_BNSH: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``R`` dims of each head (the rest pass
    through: partial rotary, as transformers' GLM/NeoX apply it), ``rotate_half(x) = cat(-x2,
    x1)`` written as ``roll(x, R/2) * sin`` with ``sin``'s first half negated
    (``rope_cos_sin``): the same values bit for bit, two ops fewer per call (a decode step calls
    it twice per block). ``cos``/``sin`` broadcast against ``x`` (``[S, R]`` or ``[B, 1, S, R]``)."""
    R = cos_SR.shape[-1]
    if R == x_BNSH.shape[-1]:
        return x_BNSH * cos_SR + x_BNSH.roll(R // 2, dims=-1) * sin_SR
    rot = x_BNSH[..., :R]
    return torch.cat([rot * cos_SR + rot.roll(R // 2, dims=-1) * sin_SR, x_BNSH[..., R:]], dim=-1)


def apply_rope_interleaved(x_BNSH: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """The rotation of adjacent pairs ``(x0, x1), (x2, x3), ...`` of the first ``R`` dims, pair
    ``i`` by angle ``i`` (DeepSeek's layout; transformers' ``apply_rotary_pos_emb_interleave``,
    op for op): the result holds the pairs' first elements, then their second elements, then
    the unrotated dims. Queries and keys come out in the same order, so their dot products are
    those of the rotation in place."""
    R = cos_SR.shape[-1]
    cos, sin = cos_SR[..., : R // 2], sin_SR[..., R // 2:]  # (the second half of sin is not negated)
    x1, x2 = x_BNSH[..., 0:R:2], x_BNSH[..., 1:R:2]
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if R < x_BNSH.shape[-1]:
        out.append(x_BNSH[..., R:])
    return torch.cat(out, dim=-1)


def rotate(x_BNSH: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor, *, interleaved: bool) -> torch.Tensor:
    """``apply_rope_interleaved`` when ``interleaved`` (``AttentionConfig.rope_interleaved``),
    else ``apply_rope``."""
    return (apply_rope_interleaved if interleaved else apply_rope)(x_BNSH, cos_SR, sin_SR)
