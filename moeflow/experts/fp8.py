"""The expert FFN with its grouped GEMMs in float8 e4m3 (legend: moeflow.types; F = width of
``w_in``: 2H gated, else H; P padded rows; quantisation rule: ``moeflow.kernels.fp8``).

``fp8_grouped_ffn(x_RD, counts_E, w_in_EDF, w_out_EHD, activation=..., gemm=...)`` computes
``act(x W_in[e]) W_out[e]`` as ``ExpertsConfig(fp8="rowwise")`` asks: every one of the six
grouped products of forward and backward takes both operands in e4m3 with one fp32 scale per
row along the contracted dimension, and returns bf16 (the fast path) or fp32 (the reference):

    forward    h  = x  W_in      x per row over D;  W_in per output column (over D)
               y  = a  W_out     a = act(h) per row over H;  W_out per output column (over H)
    backward   da = dy W_out^T   dy per row over D;  W_out per row (over D)
               dx = dh W_in^T    dh per row over F;  W_in per row (over F)
               dW_out = a^T dy   a and dy per column over all rows (written transposed)
               dW_in  = x^T dh   x and dh likewise

The two forward products accumulate with Hopper's fast FP8 accumulation, the four backward ones
with its fp32 promotion (the common recipe: torchao's float8 training does the same).
Gradients are quantised to e4m3 like the rest (torch 2.11's grouped FP8 GEMM takes e4m3
operands only; e4m3 with a per-row scale covers a row's range, which e5m2 exists to widen under a
tensor-wide scale). The weights keep their dtype (the master weights and the optimizer state
stay bf16/fp32) and are quantised on the fly each call; their gradients come back in it.

Why the rows are padded: the weight-gradient products group along K (the rows), and the FP8
grouped GEMM needs each group but the last to span a multiple of 16 rows (TMA's 16-byte
alignment; a device-side assert otherwise). So the rows are first copied into a padded layout
whose groups are multiples of 16 (at least 16, zero rows between), of a fixed ``P = ceil16(R) +
16 E`` rows: sizes and offsets come from ``counts_E`` on the device, with no host sync, and the
extra rows are zeros (no effect on any amax; their outputs are dropped). The per-column scales
of the weight gradient are taken over all rows, not per expert: a per-(expert, column) amax is a
segmented reduction; a column scale keeps full e4m3 precision for every value above
``amax / 28672``.

``gemm``: ``"scaled_grouped_mm"`` (``torch._scaled_grouped_mm``; CUDA, capability 8.9+, a clear
error elsewhere) or ``"reference"`` (the same quantised operands, dequantised to fp32 and
multiplied per group: any device; the CPU tests compare the two through this switch).
"""

from __future__ import annotations

import torch

from moeflow.kernels.activation import ACTIVATIONS, activate, activate_backward_
from moeflow.kernels.fp8 import (ALIGN, check_fp8_device, quantize_columns_t, quantize_rows, scaled_grouped_mm,
                                 scaled_grouped_mm_reference)

__all__ = ["fp8_grouped_ffn", "pad_groups", "FP8_GEMMS"]

FP8_GEMMS = ("scaled_grouped_mm", "reference")


def pad_groups(counts_E: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(dest_R, offs_E int32, P)``: row ``r`` of the grouped layout goes to padded row
    ``dest_R[r]``; padded group ``e`` ends at ``offs_E[e]``; every group spans a multiple of
    ``ALIGN`` rows, at least ``ALIGN``; the last one ends at ``P = ceil(rows / ALIGN) * ALIGN +
    ALIGN * E``, a bound that needs no host read of the counts."""
    n_e = counts_E.shape[0]
    counts = counts_E.to(torch.int64)
    padded = torch.clamp((counts + ALIGN - 1) // ALIGN * ALIGN, min=ALIGN)
    total = -(-rows // ALIGN) * ALIGN + ALIGN * n_e
    ends = torch.cumsum(counts, 0)
    pad_ends = torch.cumsum(padded, 0)
    pad_starts = pad_ends - padded
    pad_ends[-1] = total  # the last group takes the rest of the bound
    expert_R = torch.searchsorted(ends, torch.arange(rows, device=counts.device), right=True)
    dest_R = torch.arange(rows, device=counts.device) - (ends - counts)[expert_R] + pad_starts[expert_R]
    return dest_R, pad_ends.to(torch.int32), total


def _mm(gemm: str, a, b, scale_a, scale_b, offs, dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    if gemm == "reference":
        return scaled_grouped_mm_reference(a, b, scale_a, scale_b, offs).to(dtype)
    return scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum=fast_accum).to(dtype)


class _FP8FFN(torch.autograd.Function):
    """The six FP8 products of the module docstring on padded rows; saves ``x``, ``h`` and the
    weights (the weights' quantised copies are remade in backward, each in the orientation its
    product needs)."""

    @staticmethod
    def forward(ctx, x_PD, w_in_EDF, w_out_EHD, offs_E, activation, gemm):  # type: ignore[override]
        n_e = w_in_EDF.shape[0]
        x_q, x_s = quantize_rows(x_PD)
        w_in_q, w_in_s = quantize_columns_t(w_in_EDF)  # [E, F, D], [E, F]
        h_PF = _mm(gemm, x_q, w_in_q.transpose(-2, -1), x_s, w_in_s, offs_E, x_PD.dtype, fast_accum=True)
        a_PH = activate(h_PF, activation)
        a_q, a_s = quantize_rows(a_PH)
        del a_PH
        w_out_q, w_out_s = quantize_columns_t(w_out_EHD)  # [E, D, H], [E, D]
        y_PD = _mm(gemm, a_q, w_out_q.transpose(-2, -1), a_s, w_out_s, offs_E, x_PD.dtype, fast_accum=True)
        ctx.save_for_backward(x_PD, h_PF, w_in_EDF, w_out_EHD, offs_E)
        ctx.activation, ctx.gemm, ctx.n_e = activation, gemm, n_e
        return y_PD

    @staticmethod
    def backward(ctx, dy_PD):  # type: ignore[override]
        x_PD, h_PF, w_in_EDF, w_out_EHD, offs_E = ctx.saved_tensors
        gemm, n_e, dtype = ctx.gemm, ctx.n_e, x_PD.dtype
        dy_PD = dy_PD.contiguous()
        dy_q, dy_s = quantize_rows(dy_PD)
        w_out_q, w_out_s = quantize_rows(w_out_EHD.contiguous())  # [E, H, D] over D, [E, H]
        da_PH = _mm(gemm, dy_q, w_out_q.transpose(-2, -1), dy_s, w_out_s, offs_E, dtype)
        del dy_q, w_out_q
        a_PH = activate(h_PF, ctx.activation)
        a_t_q, a_t_s = quantize_columns_t(a_PH)  # [H, P], [H]
        del a_PH
        dy_t_q, dy_t_s = quantize_columns_t(dy_PD)  # [D, P], [D]
        d_w_out = _mm(gemm, a_t_q, dy_t_q.t(), a_t_s.repeat(n_e), dy_t_s.repeat(n_e), offs_E, w_out_EHD.dtype)
        del a_t_q, dy_t_q
        dh_PF = activate_backward_(h_PF, da_PH, ctx.activation)  # h is dead: dh overwrites it
        del da_PH
        dh_q, dh_s = quantize_rows(dh_PF)
        w_in_q, w_in_s = quantize_rows(w_in_EDF.contiguous())  # [E, D, F] over F, [E, D]
        dx_PD = _mm(gemm, dh_q, w_in_q.transpose(-2, -1), dh_s, w_in_s, offs_E, dtype)
        del dh_q, w_in_q
        x_t_q, x_t_s = quantize_columns_t(x_PD)  # [D, P]
        dh_t_q, dh_t_s = quantize_columns_t(dh_PF)  # [F, P]
        d_w_in = _mm(gemm, x_t_q, dh_t_q.t(), x_t_s.repeat(n_e), dh_t_s.repeat(n_e), offs_E, w_in_EDF.dtype)
        return dx_PD, d_w_in, d_w_out, None, None, None


def check_fp8_shapes(dim: int, hidden: int, width: int) -> None:
    """FP8 operands need 16-byte row strides: ``dim``, ``hidden`` and ``w_in``'s width multiples of 16."""
    for name, value in (("dim", dim), ("hidden", hidden), ("w_in width", width)):
        if value % ALIGN:
            raise ValueError(f"fp8 experts need {name} a multiple of {ALIGN} (16-byte rows of e4m3), got {value}")


def fp8_grouped_ffn(x_RD: torch.Tensor, counts_E: torch.Tensor, w_in_EDF: torch.Tensor, w_out_EHD: torch.Tensor,
                    *, activation: str, gemm: str = "scaled_grouped_mm") -> torch.Tensor:
    """``y_RD = act(x_RD W_in[e]) W_out[e]`` on rows grouped by expert (``counts_E[e]`` rows of
    expert ``e``), with the six grouped products in e4m3 (module docstring). Differentiable in
    ``x_RD``, ``w_in_EDF`` and ``w_out_EHD``; ``y`` in ``x``'s dtype."""
    if gemm not in FP8_GEMMS:
        raise ValueError(f"fp8_gemm must be one of {list(FP8_GEMMS)}, got {gemm!r}")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"fp8 experts need a named activation in {list(ACTIVATIONS)}, got {activation!r}")
    if x_RD.dim() != 2 or w_in_EDF.dim() != 3 or w_out_EHD.dim() != 3:
        raise ValueError(f"fp8_grouped_ffn: x must be [R, D] and the weights 3-D, got {tuple(x_RD.shape)}, "
                         f"{tuple(w_in_EDF.shape)}, {tuple(w_out_EHD.shape)}")
    n_e, dim, width = w_in_EDF.shape
    hidden = w_out_EHD.shape[1]
    if x_RD.shape[1] != dim or w_out_EHD.shape != (n_e, hidden, dim) or counts_E.shape != (n_e,):
        raise ValueError(f"fp8_grouped_ffn: shapes disagree: x {tuple(x_RD.shape)}, w_in {tuple(w_in_EDF.shape)}, "
                         f"w_out {tuple(w_out_EHD.shape)}, counts {tuple(counts_E.shape)}")
    check_fp8_shapes(dim, hidden, width)
    if gemm == "scaled_grouped_mm":
        check_fp8_device(x_RD.device, "ExpertsConfig(fp8='rowwise')")
    dest_R, offs_E, total = pad_groups(counts_E, x_RD.shape[0])
    x_PD = x_RD.new_zeros(total, dim).index_copy(0, dest_R, x_RD)
    y_PD = _FP8FFN.apply(x_PD, w_in_EDF, w_out_EHD, offs_E, activation, gemm)
    return y_PD.index_select(0, dest_R)
