"""Row-wise float8 e4m3 quantisation in one kernel (legend: moeflow.kernels.fp8; M rows, N columns).

``quantize_rows_triton(x [M, N]) -> (q [M, N] e4m3, scale [M] fp32)`` by the rule of
``moeflow.kernels.fp8.quantize_reference`` (its reference): one program per row reads the row
once for its amax and once more (from cache for rows up to a few hundred KiB) to scale, clamp,
cast and store it. Eager torch takes abs, amax, divide, clamp and cast, five passes with fp32
intermediates; this is one read of the input (plus the cached re-read) and one 1-byte write.
``quantize_columns_t_triton(x [B, M, N]) -> (q [B, N, M] e4m3, scale [B, N])``: one scale per
column over the M rows, written transposed (the layout the grouped GEMM wants for the operand
whose K is the rows: the weight gradient's, and the weights' in forward): two kernels, the
column amax of a slab of rows per program (``atomic_max`` across slabs), then a tiled
scale-cast-transpose; the input is read twice, no bf16 transposed copy is made.

``fp8_weight_grouped_mm_triton(x_RK, w_q_EKN, scale_EN, offs_E)``: ``out[rows of e] = (x[rows of
e] @ w_q[e]) * scale[e]``, the weight-only FP8 product (reference:
``moeflow.experts.fp8_weights.fp8_weight_grouped_mm_reference``): the e4m3 weight tiles are read
as they are stored (1 byte an element, half of bf16's) and widened to ``x``'s dtype in
registers; the per-output-column scale factors out of the sum, so it is applied once to the
fp32 accumulator. Grid: ``(column tiles, E, row tiles of the whole input)``, an upper bound
needing no host read of the group sizes; a program past its expert's rows returns at once (meant
for the few rows of decode).

The division is IEEE round-to-nearest (``div_rn``), as torch's, and the rounding to e4m3 is
done on the bits (``_round_e4m3``), so the codes equal the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["quantize_rows_triton", "quantize_columns_t_triton", "fp8_weight_grouped_mm_triton"]

E4M3_MAX = 448.0


@triton.jit
def _round_e4m3(q):
    """``q`` (fp32, within +-448) rounded to nearest even onto e4m3's grid, so the cast after it
    is exact: the same codes as a rounding cast, on every device (Triton's interpreter drops the
    carry into the exponent when its cast rounds up across a power of two, and flushes
    subnormals). Normal range (``|q| >= 2^-6``): 3 mantissa bits kept on the bits; subnormal
    range: multiples of ``2^-9``, by adding and subtracting ``1.5 * 2^14`` (whose fp32 spacing is
    ``2^-9``) to ``|q|``, with ``q``'s sign bit put back."""
    bits = q.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # RNE: drop 20 of fp32's 23 mantissa bits
    tiny = ((tl.abs(q) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -0x80000000)  # (keeps -0)
    return tl.where(tl.abs(q) >= 0.015625, normal, tiny).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, N, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * N
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / E4M3_MAX
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(v, tl.full([BLOCK], 0.0, tl.float32) + scale), -E4M3_MAX, E4M3_MAX)
        tl.store(q_row + cols, _round_e4m3(q).to(q_ptr.dtype.element_ty), mask=cols < N)
    tl.store(scale_ptr + row, scale)


def quantize_rows_triton(x_MN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, N]`` (any float dtype, last dimension contiguous) -> ``(q [M, N] e4m3 contiguous,
    scale [M] fp32)``."""
    if x_MN.dim() != 2 or x_MN.stride(1) != 1:
        raise ValueError(f"quantize_rows_triton: x must be 2-D with a contiguous last dimension, got shape "
                         f"{tuple(x_MN.shape)} strides {x_MN.stride()}")
    check_triton_tensors("quantize_rows_triton", x=x_MN)
    m, n = x_MN.shape
    q = torch.empty(m, n, device=x_MN.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(m, device=x_MN.device, dtype=torch.float32)
    if m == 0 or n == 0:
        return q, scale.fill_(1e-12 / E4M3_MAX)
    block = min(max(triton.next_power_of_2(n), 16), 2048)
    with device_guard(x_MN):
        _quantize_rows_kernel[(m,)](x_MN, q, scale, n, x_MN.stride(0), BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return q, scale


@triton.jit
def _column_amax_kernel(x_ptr, amax_ptr, M, N, stride_xb, stride_xm, ROWS: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr):
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    row_start = tl.program_id(1) * ROWS
    b = tl.program_id(2).to(tl.int64)
    x_b = x_ptr + b * stride_xb
    amax = tl.zeros([BN], dtype=tl.float32)
    for r0 in range(row_start, row_start + ROWS, BM):
        rows = r0 + tl.arange(0, BM)
        v = tl.load(x_b + rows[:, None].to(tl.int64) * stride_xm + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
    tl.atomic_max(amax_ptr + b * N + cols, amax, mask=cols < N)


@triton.jit
def _cast_transposed_kernel(x_ptr, scale_ptr, q_ptr, M, N, stride_xb, stride_xm, BM: tl.constexpr, BN: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    b = tl.program_id(2).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    v = tl.load(x_ptr + b * stride_xb + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * N + cols, mask=cols < N, other=1.0)
    q = _round_e4m3(tl.clamp(tl.math.div_rn(v, tl.broadcast_to(scale[None, :], (BM, BN))), -E4M3_MAX, E4M3_MAX))
    out = q_ptr + b * N * M + cols[None, :].to(tl.int64) * M + rows[:, None]
    tl.store(out, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_columns_t_triton(x_BMN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, M, N]`` or ``[M, N]`` (last dimension contiguous) -> ``(q [B, N, M] / [N, M] e4m3
    contiguous, scale [B, N] / [N] fp32)``: ``quantize_reference`` of ``x``'s transpose."""
    flat = x_BMN.dim() == 2
    x3 = x_BMN.unsqueeze(0) if flat else x_BMN
    if x3.dim() != 3 or x3.stride(2) != 1:
        raise ValueError(f"quantize_columns_t_triton: x must be [M, N] or [B, M, N] with a contiguous last dimension, "
                         f"got shape {tuple(x_BMN.shape)} strides {x_BMN.stride()}")
    check_triton_tensors("quantize_columns_t_triton", x=x_BMN)
    nb, m, n = x3.shape
    q = torch.empty(nb, n, m, device=x3.device, dtype=torch.float8_e4m3fn)
    amax = torch.zeros(nb, n, device=x3.device, dtype=torch.float32)
    if m and n and nb:
        bm, bn = 32, 128
        rows = max(bm, min(1024, triton.next_power_of_2(triton.cdiv(m, 64))))  # ~64 slabs of rows per column tile
        with device_guard(x3):
            _column_amax_kernel[(triton.cdiv(n, bn), triton.cdiv(m, rows), nb)](
                x3, amax, m, n, x3.stride(0), x3.stride(1), ROWS=rows, BM=bm, BN=bn, num_warps=4)
    scale = amax.clamp_(min=1e-12).div_(E4M3_MAX)
    if m and n and nb:
        bm, bn = 64, 64
        with device_guard(x3):
            _cast_transposed_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), nb)](
                x3, scale, q, m, n, x3.stride(0), x3.stride(1), BM=bm, BN=bn, num_warps=4)
    return (q[0], scale[0]) if flat else (q, scale)


@triton.jit
def _fp8_weight_gmm_kernel(x_ptr, w_ptr, s_ptr, offs_ptr, out_ptr, K, N,
                           stride_xr, stride_we, stride_wk, stride_se, stride_or,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64)  # (e * stride_we passes 2^31 on large experts)
    pid_m = tl.program_id(2)
    start = tl.where(e > 0, tl.load(offs_ptr + e - 1, mask=e > 0, other=0), 0).to(tl.int64)
    end = tl.load(offs_ptr + e).to(tl.int64)
    row0 = start + pid_m * BM
    if row0 >= end:
        return
    rows = row0 + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rows[:, None] * stride_xr + ks[None, :], mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + e * stride_we + ks[:, None] * stride_wk + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc)
    scale = tl.load(s_ptr + e * stride_se + cols, mask=cols < N, other=0.0)
    out = acc * scale[None, :]
    tl.store(out_ptr + rows[:, None] * stride_or + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < N))


def fp8_weight_grouped_mm_triton(x_RK: torch.Tensor, w_q_EKN: torch.Tensor, scale_EN: torch.Tensor,
                                 offs_E: torch.Tensor) -> torch.Tensor:
    """``x [R, K]`` (bf16/fp16/fp32, last dimension contiguous), ``w_q [E, K, N]`` e4m3 (last
    dimension contiguous), ``scale [E, N]`` fp32, ``offs_E`` the inclusive group ends (``offs[-1]
    == R``) -> ``[R, N]`` in ``x``'s dtype. Rows past ``offs[-1]`` are left unwritten."""
    if x_RK.dim() != 2 or w_q_EKN.dim() != 3 or x_RK.shape[1] != w_q_EKN.shape[1]:
        raise ValueError(f"fp8_weight_grouped_mm_triton: x [R, K] and w [E, K, N] expected, got {tuple(x_RK.shape)} "
                         f"and {tuple(w_q_EKN.shape)}")
    if (w_q_EKN.dtype != torch.float8_e4m3fn or scale_EN.dtype != torch.float32
            or scale_EN.shape != (w_q_EKN.shape[0], w_q_EKN.shape[2])):
        raise ValueError(f"fp8_weight_grouped_mm_triton: w must be float8_e4m3fn with fp32 scale [E, N], got "
                         f"{w_q_EKN.dtype} and scale {scale_EN.dtype} {tuple(scale_EN.shape)}")
    if x_RK.shape[0] > 16 * 65535:
        raise ValueError(f"fp8_weight_grouped_mm_triton: at most {16 * 65535} rows (the grid's row axis), got {x_RK.shape[0]}")
    if x_RK.stride(1) != 1 or w_q_EKN.stride(2) != 1 or scale_EN.stride(1) != 1:
        raise ValueError("fp8_weight_grouped_mm_triton: x, w and scale need a contiguous last dimension")
    check_triton_tensors("fp8_weight_grouped_mm_triton", x=x_RK, w=w_q_EKN)
    r, k = x_RK.shape
    n_e, _, n = w_q_EKN.shape
    out = torch.empty(r, n, device=x_RK.device, dtype=x_RK.dtype)
    if r == 0:
        return out
    offs = offs_E.to(device=x_RK.device, dtype=torch.int32)
    bm, bn, bk = 16, 64, 128
    grid = (triton.cdiv(n, bn), n_e, triton.cdiv(r, bm))
    with device_guard(x_RK):
        _fp8_weight_gmm_kernel[grid](x_RK, w_q_EKN, scale_EN, offs, out, k, n, x_RK.stride(0),
                                     w_q_EKN.stride(0), w_q_EKN.stride(1), scale_EN.stride(0), out.stride(0),
                                     BM=bm, BN=bn, BK=bk, num_warps=4)
    return out
