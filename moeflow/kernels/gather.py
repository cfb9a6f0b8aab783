"""Row gather whose backward is also a gather (legend: moeflow.types).

Dispatch and combine both move rows along a *partial one-to-K mapping*: every output row comes
from at most one source row, and every source row feeds at most K output rows (K = top-k for
dispatch, 1 for combine). Autograd's default backward of ``index_select`` is a scatter-add
(``index_add``), which is serial and slow on CPU and needs atomics on GPU. Because the mapping is
known in both directions, the backward can be written as a gather too:

    forward:  out_MD[m] = src_ND[index_M[m]]                 if valid_M[m] else 0
    backward: grad_src_ND[n] = sum_k grad_out_MD[rev_NK[n, k]] if rev_valid_NK[n, k]

Contract (the dispatcher guarantees it): for every valid ``m`` there is exactly one valid
``(n, k)`` with ``n = index_M[m]`` and ``rev_NK[n, k] = m``, and conversely.

``gather_rows_reference`` is the plain autograd version (index_select + mask) that the tests
compare against.
"""

from __future__ import annotations

import torch

__all__ = ["gather_rows", "gather_rows_reference"]


def _masked_index_select(src: torch.Tensor, index: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if src.shape[0] == 0:
        # nothing to gather from: by the contract every output row is invalid, i.e. zero
        return src.new_zeros(index.numel(), *src.shape[1:])
    out = src.index_select(0, index)
    if valid is not None:
        out.masked_fill_(~valid.unsqueeze(1), 0)
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_ND, index_M, valid_M, rev_NK, rev_valid_NK):  # type: ignore[override]
        ctx.save_for_backward(rev_NK, rev_valid_NK)
        ctx.has_rev_valid = rev_valid_NK is not None
        return _masked_index_select(src_ND, index_M, valid_M)

    @staticmethod
    def backward(ctx, grad_MD):  # type: ignore[override]
        rev_NK, rev_valid_NK = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        N, K = rev_NK.shape
        grad_MD = grad_MD.contiguous()
        valid = rev_valid_NK.reshape(-1) if ctx.has_rev_valid else None
        grad_AD = _masked_index_select(grad_MD, rev_NK.reshape(-1), valid)
        grad_src = grad_AD if K == 1 else grad_AD.view(N, K, grad_AD.shape[-1]).sum(dim=1)
        return grad_src, None, None, None, None


def gather_rows(
    src_ND: torch.Tensor,
    index_M: torch.Tensor,
    valid_M: torch.Tensor | None,
    rev_NK: torch.Tensor,
    rev_valid_NK: torch.Tensor | None,
) -> torch.Tensor:
    """``out_MD[m] = src_ND[index_M[m]]`` (0 where ``valid_M`` is False), backward by gather.

    Args:
        src_ND: source rows.
        index_M: source row of each output row (int64; any in-range value where invalid).
        valid_M: bool mask of output rows that are filled, or None for all.
        rev_NK: for each source row, the (up to K) output rows it feeds (int64).
        rev_valid_NK: bool mask of the entries of ``rev_NK`` that are real, or None for all.
    """
    return _GatherRows.apply(src_ND, index_M, valid_M, rev_NK, rev_valid_NK)


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
