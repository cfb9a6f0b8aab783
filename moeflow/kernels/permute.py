"""Permute / unpermute by index, with routing weights, on any device (legend: moeflow.types).

One primitive serves dispatch, combine and both backwards (the scattermoe idea), a
**gather-reduce**

    out_ND[n] = sum_j  valid_NJ[n, j] * w_NJ[n, j] * src_MD[index_NJ[n, j]]

with fp32 (or wider) accumulation, and its companion for the weight gradients, a **gather-dot**
``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>``. Because the dispatcher knows its
row mapping in both directions (``moeflow.kernels.gather``), every scatter-add autograd would
use becomes a gather-reduce along the reverse mapping: no atomics, deterministic, each output
row written once.

Every op here is a ``torch.library`` custom op whose forward is one of the two primitives: on
CUDA the Triton launchers of ``moeflow.kernels.triton.permute`` (Triton importable; reached
through the lazily loading ``moeflow.kernels.triton`` package, so this module imports no Triton
and the Triton module imports nothing from here), elsewhere (and on CUDA without Triton) the
torch reference beside it. One call is one op, and one op moves each row once, which is what
``bench.traffic`` counts for the path CUDA runs.

- ``gather_reduce`` (``moeflow::gather_reduce``) and ``gather_dot`` (``moeflow::gather_dot``):
  the primitives themselves, the backwards of the two ops below.
- ``permute_rows(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M) -> x_MD``
  (``moeflow::permute_rows``): the dispatch gather, a gather-reduce with ``J = 1``, optionally
  scaled by a weight per row; backward is a gather-reduce over the ``K`` rows each token feeds
  (and a gather-dot for the weights). Reference: ``gather_rows_reference`` (same contract as
  ``gather_rows``).
- ``unpermute_rows(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M) -> y_TD``
  (``moeflow::unpermute_rows``): the combine, ``y_TD[t] = sum_k kept * w_TK[t, k] *
  y_MD[row_TK[t, k]]``, a gather-reduce with ``J = K``; backward: a gather-reduce for ``y_MD``
  and a gather-dot for the weights. Reference: ``unpermute_rows_reference``.

Shape letters beyond the legend: ``N`` output rows, ``M`` source rows, ``J`` terms per output
row.
"""

from __future__ import annotations

import torch

from moeflow.kernels import triton as triton_kernels
from moeflow.kernels.triton import triton_available

__all__ = ["gather_reduce", "gather_dot", "gather_reduce_reference", "gather_dot_reference", "permute_rows",
           "unpermute_rows", "unpermute_rows_reference", "gather_rows", "gather_rows_reference"]


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _picked(src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None) -> torch.Tensor:
    """``[N, J, D]``: the rows each output row sums (invalid entries may hold any index: they are
    clamped for the lookup and zeroed)."""
    N, J = index_NJ.shape
    index = index_NJ.reshape(-1)
    if valid_NJ is not None and src_MD.shape[0] > 0:
        index = index.clamp(0, src_MD.shape[0] - 1)
    rows = src_MD.index_select(0, index)
    if valid_NJ is not None:
        rows.masked_fill_(~valid_NJ.reshape(-1, 1), 0)
    return rows.view(N, J, src_MD.shape[1])


def gather_reduce_reference(src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None,
                            w_NJ: torch.Tensor | None) -> torch.Tensor:
    """``gather_reduce`` in torch ops: the rows, then their (weighted) sum per output row,
    accumulated in at least fp32 (fp32 and fp64 inputs: in their own dtype, as a ``bmm``)."""
    N, J = index_NJ.shape
    D = src_MD.shape[1]
    if N == 0 or J == 0 or src_MD.shape[0] == 0:
        return src_MD.new_zeros(N, D)
    rows_NJD = _picked(src_MD, index_NJ, valid_NJ)
    if J == 1 and w_NJ is None:
        return rows_NJD.view(N, D)  # a plain gather: the rows themselves
    acc = _accumulate_dtype(src_MD.dtype)
    if w_NJ is None:
        out = rows_NJD.sum(dim=1, dtype=acc)
    elif J == 1:
        out = rows_NJD.view(N, D).to(acc) * w_NJ.to(acc)
    else:
        out = torch.bmm(w_NJ.to(acc).unsqueeze(1), rows_NJD.to(acc)).squeeze(1)
    return out.to(src_MD.dtype)


def gather_dot_reference(a_ND: torch.Tensor, b_MD: torch.Tensor, index_NJ: torch.Tensor,
                         valid_NJ: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``gather_dot`` in torch ops (accumulated in at least fp32), in ``like``'s dtype."""
    N, J = index_NJ.shape
    if N == 0 or J == 0 or a_ND.shape[1] == 0 or b_MD.shape[0] == 0:
        return like.new_zeros(N, J)
    acc = _accumulate_dtype(a_ND.dtype)
    rows_NJD = _picked(b_MD, index_NJ, valid_NJ)
    return torch.bmm(rows_NJD.to(acc), a_ND.to(acc).unsqueeze(2)).squeeze(2).to(like.dtype)


def gather_reduce_cuda(
    src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, w_NJ: torch.Tensor | None
) -> torch.Tensor:
    """What every op whose forward is a gather-reduce runs on CUDA: the Triton kernel where
    ``triton_available`` says it runs (on CPU that is the interpreter, which the tests use to
    run this very function), the reference otherwise."""
    if not triton_available(src_MD.device):
        return gather_reduce_reference(src_MD, index_NJ, valid_NJ, w_NJ)
    return triton_kernels.launch_gather_reduce(src_MD, index_NJ, valid_NJ, w_NJ)


def gather_dot_cuda(
    a_ND: torch.Tensor, b_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """``gather_dot`` on CUDA: the Triton kernel or the reference, as ``gather_reduce_cuda``."""
    if not triton_available(a_ND.device):
        return gather_dot_reference(a_ND, b_MD, index_NJ, valid_NJ, like)
    return triton_kernels.launch_gather_dot(a_ND, b_MD, index_NJ, valid_NJ, like.dtype)


@torch.library.custom_op("moeflow::gather_reduce", mutates_args=())
def gather_reduce(
    src_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, w_NJ: torch.Tensor | None
) -> torch.Tensor:
    """``out_ND[n] = sum_j valid * w * src_MD[index_NJ[n, j]]`` in ``src``'s dtype (module
    docstring; the torch reference off CUDA)."""
    return gather_reduce_reference(src_MD, index_NJ, valid_NJ, w_NJ)


gather_reduce.register_kernel("cuda")(gather_reduce_cuda)


@gather_reduce.register_fake
def _(src_MD, index_NJ, valid_NJ, w_NJ):  # type: ignore[no-untyped-def]
    return src_MD.new_empty(index_NJ.shape[0], src_MD.shape[1])


@torch.library.custom_op("moeflow::gather_dot", mutates_args=())
def gather_dot(
    a_ND: torch.Tensor, b_MD: torch.Tensor, index_NJ: torch.Tensor, valid_NJ: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """``out_NJ[n, j] = valid * <a_ND[n], b_MD[index_NJ[n, j]]>`` in ``like``'s dtype."""
    return gather_dot_reference(a_ND, b_MD, index_NJ, valid_NJ, like)


gather_dot.register_kernel("cuda")(gather_dot_cuda)


@gather_dot.register_fake
def _(a_ND, b_MD, index_NJ, valid_NJ, like):  # type: ignore[no-untyped-def]
    return like.new_empty(index_NJ.shape)


# ---------------------------------------------------------------------------------------------
# permute (dispatch gather)


def _columns(
    index_M: torch.Tensor, valid_M: torch.Tensor | None, weights_M: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The permute's per-row arguments as a gather-reduce's ``[M, 1]`` (``J = 1``)."""
    return (index_M.view(-1, 1), None if valid_M is None else valid_M.view(-1, 1),
            None if weights_M is None else weights_M.view(-1, 1))


@torch.library.custom_op("moeflow::permute_rows", mutates_args=())
def _permute_op(
    x_TD: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_TK: torch.Tensor,
    rev_valid_TK: torch.Tensor | None,
    weights_M: torch.Tensor | None,
) -> torch.Tensor:
    """Off CUDA: the reference gather-reduce itself (no second op inside this one)."""
    return gather_reduce_reference(x_TD, *_columns(index_M, valid_M, weights_M))


@_permute_op.register_kernel("cuda")
def permute_rows_cuda(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M):  # type: ignore[no-untyped-def]
    """On CUDA: the Triton gather-reduce (``gather_reduce_cuda``)."""
    return gather_reduce_cuda(x_TD, *_columns(index_M, valid_M, weights_M))


@_permute_op.register_fake
def _(x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M):  # type: ignore[no-untyped-def]
    return x_TD.new_empty(index_M.shape[0], x_TD.shape[1])


def _permute_setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M = inputs
    ctx.has_w = weights_M is not None
    # x is needed only for the weight gradient
    ctx.save_for_backward(x_TD if ctx.has_w else None, index_M, valid_M, rev_TK, rev_valid_TK, weights_M)


def _permute_backward(ctx, grad_MD):  # type: ignore[no-untyped-def]
    x_TD, index_M, valid_M, rev_TK, rev_valid_TK, weights_M = ctx.saved_tensors
    grad_MD = grad_MD.contiguous()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        # every token row t collects the (weighted) gradient of the up-to-K rows it was copied to
        w_TK = None
        if ctx.has_w and weights_M.shape[0] > 0:
            # rev entries that are not real may hold any value: clamp before the lookup, the
            # gather-reduce masks them out
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


def gather_rows(
    src_ND: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_NK: torch.Tensor,
    rev_valid_NK: torch.Tensor | None,
) -> torch.Tensor:
    """``out_MD[m] = src_ND[index_M[m]]`` (0 where ``valid_M`` is False), backward by gather:
    ``permute_rows`` without weights (``moeflow.kernels.gather`` states the contract).

    Args:
        src_ND: source rows.
        index_M: source row of each output row (int; any value where invalid).
        valid_M: bool mask of output rows that are filled, or None for all.
        rev_NK: for each source row, the (up to K) output rows it feeds (int).
        rev_valid_NK: bool mask of the entries of ``rev_NK`` that are real, or None for all.
    """
    return permute_rows(src_ND, index_M, valid_M, rev_NK, rev_valid_NK)


def gather_rows_reference(
    src_ND: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_NK: torch.Tensor,
    rev_valid_NK: torch.Tensor | None,
) -> torch.Tensor:
    """Same result through plain autograd (backward is a scatter-add); ``rev_*`` unused."""
    out = src_ND.index_select(0, index_M)
    if valid_M is not None:
        out = torch.where(valid_M.unsqueeze(1), out, out.new_zeros(()))
    return out


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
    """Off CUDA: the reference gather-reduce itself (no second op inside this one)."""
    return gather_reduce_reference(y_MD, row_TK, kept_TK, weights_TK)


@_unpermute_op.register_kernel("cuda")
def unpermute_rows_cuda(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M):  # type: ignore[no-untyped-def]
    """On CUDA: the Triton gather-reduce (``gather_reduce_cuda``)."""
    return gather_reduce_cuda(y_MD, row_TK, kept_TK, weights_TK)


@_unpermute_op.register_fake
def _(y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M):  # type: ignore[no-untyped-def]
    return y_MD.new_empty(row_TK.shape[0], y_MD.shape[1])


def _unpermute_setup(ctx, inputs, output):  # type: ignore[no-untyped-def]
    y_MD, row_TK, kept_TK, weights_TK, assign_M, valid_M = inputs
    ctx.has_w = weights_TK is not None
    # y is needed only for the weight gradient
    ctx.save_for_backward(y_MD if ctx.has_w else None, row_TK, kept_TK, weights_TK, assign_M, valid_M)


def _unpermute_backward(ctx, grad_TD):  # type: ignore[no-untyped-def]
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
    is ``kept * <grad_y_TD[t], y_MD[row_TK[t, k]]>``. Output dtype is ``y_MD``'s; sums are fp32
    (or wider).
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
