"""Row-wise float8 e4m3 quantisation in one kernel (legend: moeflow.kernels.fp8; M rows, N columns).

``quantize_rows_triton(x [M, N]) -> (q [M, N] e4m3, scale [M] fp32)`` by the rule of
``moeflow.kernels.fp8.quantize_reference`` (its reference): one program per row reads the row
once for its amax and once more (from cache for rows up to a few hundred KiB) to scale, clamp,
cast and store it. Eager torch takes abs, amax, divide, clamp and cast, five passes with fp32
intermediates; this is one read of the input (plus the cached re-read) and one 1-byte write.
The division is IEEE round-to-nearest (``div_rn``), as torch's, and the rounding to e4m3 is
done on the bits (``_round_e4m3``), so the codes equal the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["quantize_rows_triton"]

E4M3_MAX = 448.0


@triton.jit
def _round_e4m3(q):
    """``q`` (fp32, within +-448) rounded to nearest even onto e4m3's grid, so the cast after it
    is exact: the same codes as a rounding cast, on every device (Triton's interpreter drops the
    carry into the exponent when its cast rounds up across a power of two, and flushes
    subnormals). Normal range (``|q| >= 2^-6``): 3 mantissa bits kept on the bits; subnormal
    range: multiples of ``2^-9``, by adding and subtracting ``1.5 * 2^14`` (whose fp32 spacing is
    ``2^-9``)."""
    bits = q.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # RNE: drop 20 of fp32's 23 mantissa bits
    subnormal = (q + 24576.0) - 24576.0
    return tl.where(tl.abs(q) >= 0.015625, bits.to(tl.float32, bitcast=True), subnormal)


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
        q = tl.clamp(tl.math.div_rn(v, scale), -E4M3_MAX, E4M3_MAX)
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
