"""Top-k expert selection from router logits (legend: moeflow.types).

All functions are pure and differentiable in the weights; ids are integer outputs.
"""

from __future__ import annotations

import torch

__all__ = ["select_experts", "limit_groups"]


def limit_groups(sel_TE: torch.Tensor, *, num_groups: int, topk_groups: int, group_score: str) -> torch.Tensor:
    """Mask experts outside the best ``topk_groups`` of ``num_groups`` equal groups with -inf.

    The group score is the best expert score in the group (``"max"``) or the sum of the best two
    (``"top2_sum"``). Returns a new ``[T, E]`` tensor; masked entries are ``-inf`` so a later
    top-k never picks them.
    """
    T, E = sel_TE.shape
    sel_TGX = sel_TE.view(T, num_groups, E // num_groups)
    if group_score == "max":
        group_TG = sel_TGX.amax(dim=-1)
    else:
        group_TG = sel_TGX.topk(2, dim=-1).values.sum(dim=-1)
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool)
    keep_TG.scatter_(1, group_TG.topk(topk_groups, dim=-1).indices, True)
    return sel_TGX.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, E)


def select_experts(
    logits_TE: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    normalize_topk: bool = False,
    routed_scaling_factor: float = 1.0,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "max",
    selection_bias_E: torch.Tensor | None = None,
    forced_ids_TK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token and their weights.

    Args:
        logits_TE: router logits ``[T, E]``.
        selection_bias_E: added to the scores for *choosing* experts only (aux-loss-free
            balancing); the weights come from the unbiased scores.
        forced_ids_TK: router replay: take these experts instead of choosing; the weights are
            computed from the scores at these ids exactly as for a choice, so the router still
            gets gradients (the caller validates shape and range).

    Returns:
        ``(weights_TK, ids_TK, scores_TE)`` where ``scores_TE`` are the probabilities
        (softmax/sigmoid) or, for ``"topk_softmax"``, the logits themselves.
    """
    if scoring == "softmax":
        scores_TE = torch.softmax(logits_TE, dim=-1)
    elif scoring == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
    elif scoring == "topk_softmax":
        scores_TE = logits_TE
    else:
        raise ValueError(f"unknown scoring {scoring!r}")

    if forced_ids_TK is not None:
        ids_TK = forced_ids_TK
    else:
        sel_TE = scores_TE.detach()
        if selection_bias_E is not None:
            sel_TE = sel_TE + selection_bias_E.to(sel_TE.dtype)
        if num_groups > 1:
            sel_TE = limit_groups(sel_TE, num_groups=num_groups, topk_groups=topk_groups, group_score=group_score)
        ids_TK = sel_TE.topk(top_k, dim=-1).indices

    picked_TK = scores_TE.gather(1, ids_TK)
    if scoring == "topk_softmax":
        weights_TK = torch.softmax(picked_TK, dim=-1)
    elif normalize_topk:
        weights_TK = picked_TK / picked_TK.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(picked_TK.dtype).tiny)
    else:
        weights_TK = picked_TK
    if routed_scaling_factor != 1.0:
        weights_TK = weights_TK * routed_scaling_factor
    return weights_TK, ids_TK, scores_TE
