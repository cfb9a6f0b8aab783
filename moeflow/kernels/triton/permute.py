"""Permute / unpermute by index, with routing weights (legend: moeflow.types).

One kernel serves dispatch, combine and both backwards (the scattermoe idea): a **gather-reduce**

    out_ND[n] = sum_j  valid_NJ[n, j] * w_NJ[n, j] * src_MD[index_NJ[n, j]]

with fp32 accumulation. Because the dispatcher knows its row mapping in both directions
(``moeflow.kernels.gather``), every scatter-add that autograd would use is rewritten as a
gather-reduce along the reverse mapping: no atomics, deterministic, and each output row is
written by exactly one program.

- ``permute_rows(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M) -> x_MD``: the
  dispatch gather (``J = 1``), optionally scaled by a weight per row; backward is a
  gather-reduce over the ``K`` rows each token feeds (and a row dot product for the weights).
  Reference: ``moeflow.kernels.gather_rows_reference`` (same contract as ``gather_rows``).
- ``unpermute_rows(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M) -> y_TD``: the combine,
  ``y_TD[t] = sum_k kept * w_TK[t, k] * y_MD[row_TK[t, k]]`` (``J = K``); its backward is a
  gather-reduce for ``y_MD`` and a row dot product (``_gather_dot_kernel``) for the weights.
  Reference: ``unpermute_rows_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.gather import gather_rows_reference
from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["permute_rows", "unpermute_rows", "unpermute_rows_reference", "gather_reduce", "gather_dot"]

_BLOCK_N = 16
_BLOCK_D = 128


@triton.jit
def _gather_reduce_kernel(
    src_ptr, index_ptr, valid_ptr, w_ptr, out_ptr,
    N, D, J, stride_src, stride_out,
    HAS_VALID: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (i, j) writes rows ``i*BLOCK_N ...`` and columns ``j*BLOCK_D ...`` of out."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < N
    col_ok = cols < D
    acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    for j in range(J):
        take = row_ok
        if HAS_VALID:
            take = take & (tl.load(valid_ptr + rows * J + j, mask=row_ok, other=0) != 0)
        src_row = tl.load(index_ptr + rows * J + j, mask=take, other=0).to(tl.int64)
        vals = tl.load(
            src_ptr + src_row[:, None] * stride_src + cols[None, :], mask=take[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)
        if HAS_W:
            vals = vals * tl.load(w_ptr + rows * J + j, mask=take, other=0.0).to(tl.float32)[:, None]
        acc += vals
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gather_dot_kernel(
    a_ptr, b_ptr, index_ptr, valid_ptr, out_ptr,
    N, D, J, stride_a, stride_b,
    HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>`` (fp32 accumulation)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    for j in range(J):
        take = row_ok
        if HAS_VALID:
            take = take & (tl.load(valid_ptr + rows * J + j, mask=row_ok, other=0) != 0)
        b_row = tl.load(index_ptr + rows * J + j, mask=take, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            m = take[:, None] & (cols < D)[None, :]
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_a + cols[None, :], mask=m, other=0.0)
            b = tl.load(b_ptr + b_row[:, None] * stride_b + cols[None, :], mask=m, other=0.0)
            acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
        tl.store(out_ptr + rows * J + j, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def _block_d(D: int) -> int:
    return min(_BLOCK_D, max(16, triton.next_power_of_2(D)))


def _launch_gather_reduce(
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
        )
    return out_ND


def _launch_gather_dot(
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
            HAS_VALID=valid_NJ is not None, BLOCK_N=_BLOCK_N, BLOCK_D=_block_d(D),
        )
    return out_NJ


# ---------------------------------------------------------------------------------------------
# custom ops: the two primitives (not differentiable themselves; the backward formulas use them)


@torch.library.custom_op("moeflow::gather_reduce", mutates_args=())
def gather_reduce(
    src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, w_NJ: torch.Tensor | None
) -> torch.Tensor:
    """``out_ND[n] = sum_j valid * w * src_MD[index_NJ[n, j]]`` in ``src``'s dtype."""
    return _launch_gather_reduce(src_MD, index_NJ, valid_NJ, w_NJ)


@gather_reduce.register_fake
def _(src_MD, index_NJ, valid_NJ, w_NJ):
    return src_MD.new_empty(index_NJ.shape[0], src_MD.shape[1])


@torch.library.custom_op("moeflow::gather_dot", mutates_args=())
def gather_dot(
    a_ND: torch.Tensor, b_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>`` in ``like``'s dtype."""
    return _launch_gather_dot(a_ND, b_MD, index_NJ, valid_NJ, like.dtype)


@gather_dot.register_fake
def _(a_ND, b_MD, index_NJ, valid_NJ, like):
    return like.new_empty(index_NJ.shape)


# ---------------------------------------------------------------------------------------------
# permute (dispatch gather)


@torch.library.custom_op("moeflow::permute_rows", mutates_args=())
def _permute_op(
    x_TD: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_TK: torch.Tensor,
    rev_valid_TK: torch.Tensor | None,
    weights_M: torch.Tensor | None,
) -> torch.Tensor:
    return _launch_gather_reduce(
        x_TD,
        index_M.view(-1, 1),
        None if valid_M is None else valid_M.view(-1, 1),
        None if weights_M is None else weights_M.view(-1, 1),
    )


@_permute_op.register_fake
def _(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M):
    return x_TD.new_empty(index_M.shape[0], x_TD.shape[1])


def _permute_setup(ctx, inputs, output):
    x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M = inputs
    ctx.has_w = weights_M is not None
    # x is needed only for the weight gradient
    ctx.save_for_backward(x_TD if ctx.has_w else None, index_M, valid_M, rev_TK, rev_valid_TK, weights_M)


def _permute_backward(ctx, grad_MD):
    x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M = ctx.saved_tensors
    grad_MD = grad_MD.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        # every token row t collects the (weighted) gradient of the up-to-K rows it was copied to
        w_TK = None
        if ctx.has_w and weights_M.shape[0] > 0:
            # rev entries that are not real may hold any value: clamp before the lookup, the
            # kernel masks them out
            w_TK = weights_M[rev_TK.clamp(0, weights_M.shape[0] - 1)]
        grad_x = gather_reduce(grad_MD, rev_TK, rev_valid_TK, w_TK)
    if ctx.has_w and ctx.needs_input_grad[5]:
        valid_M1 = None if valid_M is None else valid_M.view(-1, 1)
        grad_w = gather_dot(grad_MD, x_TD, index_M.view(-1, 1), valid_M1, weights_M).view(-1)
    return grad_x, None, None, None, None, grad_w


_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


def permute_rows(
    x_TD: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_TK: torch.Tensor,
    rev_valid_TK: torch.Tensor | None,
    weights_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch gather: ``x_MD[m] = weights_M[m] * x_TD[index_M[m]]`` (0 where ``valid_M`` is False).

    Same contract as ``moeflow.kernels.gather_rows``: ``rev_TK[t]`` lists the (up to K) rows
    that token ``t`` is copied to (``rev_valid_TK`` marks the real entries), which lets the
    backward be a gather-reduce instead of a scatter-add. ``weights_M`` (optional, the router
    weight of each row, for ``weight_at="dispatch"``) gets the gradient
    ``<grad_MD[m], x_TD[index_M[m]]>``.

    Shapes: ``x_TD [T, D]``, ``index_M [M]`` int, ``valid_M [M]`` bool or None,
    ``rev_TK [T, K]`` int, ``rev_valid_TK [T, K]`` bool or None, ``weights_M [M]`` or None.
    Returns ``[M, D]`` in ``x_TD``'s dtype.
    """
    _check_rows("permute_rows", x_TD, "x_TD")
    _check_index("permute_rows", index_M, "index_M", 1)
    _check_index("permute_rows", rev_TK, "rev_TK", 2)
    if rev_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"permute_rows: rev_TK has {rev_TK.shape[0]} rows, x_TD has {x_TD.shape[0]}")
    if weights_M is not None and tuple(weights_M.shape) != tuple(index_M.shape):
        raise ValueError(f"permute_rows: weights_M shape {tuple(weights_M.shape)} != index_M shape {tuple(index_M.shape)}")
    return _permute_op(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M)


# ---------------------------------------------------------------------------------------------
# unpermute (combine with routing weights)


@torch.library.custom_op("moeflow::unpermute_rows", mutates_args=())
def _unpermute_op(
    y_MD: torch.Tensor,
    row_TK: torch.Tensor,
    kept_TK: torch.Tensor | None,
    weights_TK: torch.Tensor | None,
    assign_M: torch.Tensor,
    valid_M: torch.Tensor | None,
) -> torch.Tensor:
    return _launch_gather_reduce(y_MD, row_TK, kept_TK, weights_TK)


@_unpermute_op.register_fake
def _(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M):
    return y_MD.new_empty(row_TK.shape[0], y_MD.shape[1])


def _unpermute_setup(ctx, inputs, output):
    y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M = inputs
    ctx.has_w = weights_TK is not None
    ctx.save_for_backward(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M)


def _unpermute_backward(ctx, grad_TD):
    y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M = ctx.saved_tensors
    grad_TD = grad_TD.contiguous()
    K = row_TK.shape[1]
    grad_y = grad_w = None
    if ctx.needs_input_grad[0]:
        # expert row m came from assignment a = assign_M[m] of token a // K, weighted by w[a]
        token_M1 = torch.div(assign_M, K, rounding_mode="floor").view(-1, 1)
        w_M1 = None if weights_TK is None else weights_TK.reshape(-1)[assign_M].view(-1, 1)
        valid_M1 = None if valid_M is None else valid_M.view(-1, 1)
        grad_y = gather_reduce(grad_TD, token_M1, valid_M1, w_M1)
    if ctx.has_w and ctx.needs_input_grad[3]:
        grad_w = gather_dot(grad_TD, y_MD, row_TK, kept_TK, weights_TK)
    return grad_y, None, None, grad_w, None, None


_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def unpermute_rows(
    y_MD: torch.Tensor,
    row_TK: torch.Tensor,
    kept_TK: torch.Tensor | None,
    weights_TK: torch.Tensor | None,
    assign_M: torch.Tensor,
    valid_M: torch.Tensor | None,
) -> torch.Tensor:
    """Combine: ``y_TD[t] = sum_k kept_TK[t, k] * weights_TK[t, k] * y_MD[row_TK[t, k]]``.

    ``weights_TK=None`` sums without weights (the weights were applied at dispatch). The
    reverse mapping ``assign_M`` (flat assignment ``t*K + k`` of each expert row; ``valid_M``
    marks real rows, None for all) makes the backward for ``y_MD`` a gather; the weight gradient
    is ``kept * <grad_y_TD[t], y_MD[row_TK[t, k]]>``. Output dtype is ``y_MD``'s; sums are fp32.
    """
    _check_rows("unpermute_rows", y_MD, "y_MD")
    _check_index("unpermute_rows", row_TK, "row_TK", 2)
    _check_index("unpermute_rows", assign_M, "assign_M", 1)
    if assign_M.shape[0] != y_MD.shape[0]:
        raise ValueError(f"unpermute_rows: assign_M has {assign_M.shape[0]} entries, y_MD has {y_MD.shape[0]} rows")
    if weights_TK is not None and weights_TK.shape != row_TK.shape:
        raise ValueError(f"unpermute_rows: weights_TK shape {tuple(weights_TK.shape)} != row_TK shape {tuple(row_TK.shape)}")
    return _unpermute_op(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M)


def unpermute_rows_reference(
    y_MD: torch.Tensor,
    row_TK: torch.Tensor,
    kept_TK: torch.Tensor | None,
    weights_TK: torch.Tensor | None,
    assign_M: torch.Tensor,
    valid_M: torch.Tensor | None,
) -> torch.Tensor:
    """Plain autograd: ``gather_rows_reference`` then a weighted sum over ``k``."""
    T, K = row_TK.shape
    rows_AD = gather_rows_reference(y_MD, row_TK.reshape(-1), None if kept_TK is None else kept_TK.reshape(-1), None, None)
    rows_TKD = rows_AD.view(T, K, -1)
    if weights_TK is None:
        return rows_TKD.sum(dim=1)
    return (rows_TKD * weights_TK.unsqueeze(-1)).sum(dim=1)


def _check_rows(op: str, t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")


def _check_index(op: str, t: torch.Tensor, name: str, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: {name} must be int32 or int64, got {t.dtype}")
