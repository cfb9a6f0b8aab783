"""Triton kernels of the permute / unpermute primitives (legend: moeflow.types; shape letters:
``moeflow.kernels.permute``).

``launch_gather_reduce`` and ``launch_gather_dot`` run the two primitives of
``moeflow.kernels.permute`` (``gather_reduce``: ``out_ND[n] = sum_j valid * w * src_MD[index_NJ[n,
j]]``; ``gather_dot``: ``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>``), accumulated in
fp32 (fp64 for fp64 tensors, so the fp64 checks hold to fp64 rounding on CUDA too). The custom
ops of ``moeflow.kernels.permute`` (the primitives, ``permute_rows``, ``unpermute_rows``) call
them on CUDA; this module knows nothing of those ops, so the imports point one way (the ops
reach the launchers through the lazily loading ``moeflow.kernels.triton`` package). The tests
run the launchers under the Triton interpreter against the torch references
(``gather_reduce_reference``, ``gather_dot_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["launch_gather_reduce", "launch_gather_dot"]

_BLOCK_N = 16
_BLOCK_D = 128


@triton.jit
def _gather_reduce_kernel(
    src_ptr, index_ptr, valid_ptr, w_ptr, out_ptr,
    N, D, J, stride_src, stride_out,
    HAS_VALID: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ACC: tl.constexpr,
):
    """Program (i, j) writes rows ``i*BLOCK_N ...`` and columns ``j*BLOCK_D ...`` of out; sums in
    ``ACC`` (fp32, or fp64 for fp64 tensors)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC)
    for j in range(J):
        take = row_ok
        if HAS_VALID:
            take = take & (tl.load(valid_ptr + rows * J + j, mask=row_ok, other=0) != 0)
        src_row = tl.load(index_ptr + rows * J + j, mask=take, other=0).to(tl.int64)
        vals = tl.load(
            src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=take[:, None] & col_ok[None, :], other=0.0
        ).to(ACC)
        if HAS_W:
            vals = vals * tl.load(w_ptr + rows * J + j, mask=take, other=0.0).to(ACC)[:, None]
        acc += vals
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_dot_kernel(
    a_ptr, b_ptr, index_ptr, valid_ptr, out_ptr,
    N, D, J, stride_a, stride_b,
    HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr,
):
    """``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>`` (sums in ``ACC``)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    for j in range(J):
        take = row_ok
        if HAS_VALID:
            take = take & (tl.load(valid_ptr + rows * J + j, mask=row_ok, other=0) != 0)
        b_row = tl.load(index_ptr + rows * J + j, mask=take, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=ACC)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = take[:, None] & (cols < D)[None, :]
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :], mask=m, other=0.0)
            b = tl.load(b_ptr + b_row[:, None] * stride_b + cols[None, :], mask=m, other=0.0)
            acc += tl.sum(a.to(ACC) * b.to(ACC), axis=1)
        tl.store(out_ptr + rows * J + j, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def _acc(*tensors: torch.Tensor | None) -> tl.dtype:
    """The kernels' accumulation dtype: fp64 where any input is fp64, else fp32."""
    return tl.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else tl.float32


def _block_d(D: int) -> int:
    return min(_BLOCK_D, max(16, triton.next_power_of_2(D)))


def launch_gather_reduce(
    src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, w_NJ: torch.Tensor | None
) -> torch.Tensor:
    check_triton_tensors("gather_reduce", src=src_MD)
    N, J = index_NJ.shape
    D = src_MD.shape[1]
    out_ND = torch.empty(N, D, dtype=src_MD.dtype, device=src_MD.device)
    if N == 0 or D == 0:
        return out_ND
    if J == 0 or src_MD.shape[0] == 0:
        return out_ND.zero_()
    src_MD = src_MD.contiguous()
    index_NJ = index_NJ.contiguous()
    valid_NJ = None if valid_NJ is None else valid_NJ.contiguous()
    w_NJ = None if w_NJ is None else w_NJ.contiguous()
    block_d = _block_d(D)
    grid = (triton.cdiv(N, _BLOCK_N), triton.cdiv(D, block_d))
    with device_guard(src_MD):
        _gather_reduce_kernel[grid](
            src_MD, index_NJ, valid_NJ, w_NJ, out_ND,
            N, D, J, src_MD.stride(0), out_ND.stride(0),
            HAS_VALID=valid_NJ is not None, HAS_W=w_NJ is not None, BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
            ACC=_acc(src_MD, w_NJ),
        )
    return out_ND


def launch_gather_dot(
    a_ND: torch.Tensor, b_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    check_triton_tensors("gather_dot", a=a_ND)
    N, J = index_NJ.shape
    out_NJ = torch.zeros(N, J, dtype=dtype, device=a_ND.device)
    if N == 0 or J == 0 or a_ND.shape[1] == 0 or b_MD.shape[0] == 0:
        return out_NJ
    a_ND, b_MD, index_NJ = a_ND.contiguous(), b_MD.contiguous(), index_NJ.contiguous()
    valid_NJ = None if valid_NJ is None else valid_NJ.contiguous()
    D = a_ND.shape[1]
    with device_guard(a_ND):
        _gather_dot_kernel[(triton.cdiv(N, _BLOCK_N),)](
            a_ND, b_MD, index_NJ, valid_NJ, out_NJ,
            N, D, J, a_ND.stride(0), b_MD.stride(0),
            HAS_VALID=valid_NJ is not None, BLOCK_N=_BLOCK_N, BLOCK_D=_block_d(D), ACC=_acc(a_ND, b_MD),
        )
    return out_NJ
