"""The token side of every dispatcher (legend: moeflow.types): the combine weights after drops,
and the weighted sum of each token's ``K`` expert outputs. The local dispatcher and every
expert-parallel strategy end a call here, so they agree to the bit."""

from __future__ import annotations

import torch

from moeflow.kernels.permute import unpermute_rows
from moeflow.types import DispatchPlan

__all__ = ["combine_weights", "renormalize_kept", "sum_token_rows", "combine_rows"]


def sum_token_rows(rows_TKD: torch.Tensor, weights_TK: torch.Tensor, weight_at: str) -> torch.Tensor:
    """``y_TD = sum_k w_TK * rows_TKD`` (or the plain sum when the weights were applied at
    dispatch), as one ``[T,1,K] x [T,K,D]`` bmm."""
    if weight_at == "dispatch":
        return rows_TKD.sum(dim=1)
    if rows_TKD.shape[1] == 1:
        return rows_TKD[:, 0] * weights_TK
    return torch.bmm(weights_TK.unsqueeze(1), rows_TKD).squeeze(1)


def combine_rows(out_MD: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """``y_TD`` from the outputs of the plan's token-side rows: each token's kept assignments'
    rows (``plan.row_A``; dropped ones give 0), weighted by their router weights unless those
    applied at dispatch, summed per token in one op (``moeflow.kernels.permute.unpermute_rows``:
    each row read once, fp32 sums). Backward is a gather too (each row's gradient comes from
    its one assignment, ``plan.assign_M``), and a row dot product for the weights."""
    T, K = plan.num_tokens, plan.top_k
    weights_TK = None if plan.weight_at == "dispatch" else plan.weights_TK.to(out_MD.dtype)
    return unpermute_rows(out_MD, plan.row_A.view(T, K), None if plan.kept_A is None else plan.kept_A.view(T, K),
                          weights_TK, plan.assign_M, plan.row_valid_M)


def combine_weights(
    weights_TK: torch.Tensor, kept_A: torch.Tensor | None, dtype: torch.dtype, renormalize: bool
) -> torch.Tensor:
    """The router weights in the input dtype, renormalised over the kept assignments when asked
    (``kept_A`` in flat ``t*K + k`` order; None when nothing can be dropped)."""
    weights_TK = weights_TK.to(dtype)
    if kept_A is None or not renormalize:
        return weights_TK
    return renormalize_kept(weights_TK, kept_A.view(weights_TK.shape))


def renormalize_kept(weights_TK: torch.Tensor, kept_TK: torch.Tensor) -> torch.Tensor:
    """Rescale each token's kept weights so they sum to the total of all its k weights
    (tokens with nothing kept keep zero weight)."""
    kept_w_TK = weights_TK * kept_TK
    kept_sum_T1 = kept_w_TK.sum(dim=1, keepdim=True)
    has_kept = kept_sum_T1 > 0
    scale_T1 = torch.where(has_kept, weights_TK.sum(dim=1, keepdim=True) / torch.where(has_kept, kept_sum_T1, 1), 0)
    return weights_TK * scale_T1
