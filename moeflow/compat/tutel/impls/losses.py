"""``tutel.impls.losses``: the two balance losses Tutel's gates use (legend: moeflow.types).

Both follow Tutel's published formulas exactly (including its choices that differ from
moeflow's own ``moeflow.routing.losses``: the GShard loss counts only each token's *first*
choice, and the importance/load loss uses the unbiased variance).
"""

from __future__ import annotations

import math

import torch

__all__ = ["gshard_loss", "load_importance_loss"]


def gshard_loss(scores_w_noise: torch.Tensor, top_ids: torch.Tensor) -> torch.Tensor:
    """``E * sum_e mean_t(scores[t, e]) * mean_t(top_ids[t, 0] == e)``.

    Args:
        scores_w_noise: ``[T, E]`` router probabilities (softmax of the noisy logits).
        top_ids: ``[T, K]`` selected experts; only column 0 (the first choice) is counted,
            as in GShard/Tutel (moeflow's ``load_balance_loss`` counts all K choices).
    """
    T, E = scores_w_noise.shape
    counts_E = torch.bincount(top_ids[:, 0].reshape(-1), minlength=E).to(scores_w_noise.dtype)
    return (scores_w_noise.sum(dim=0) * counts_E).sum() * (E / max(T * T, 1))


def _cv_squared_unbiased(x_E: torch.Tensor) -> torch.Tensor:
    return x_E.var() / (x_E.mean() ** 2 + 1e-10)


def load_importance_loss(
    scores_wo_noise: torch.Tensor, topk_logits: torch.Tensor, num_global_experts: int, gate_noise: float
) -> torch.Tensor:
    """Shazeer et al. (2017) importance + load loss as Tutel computes it: ``(imp + load) / 2``.

    ``imp = cv^2(sum_t scores)``; ``load = cv^2(sum_t Phi((scores - threshold) / sigma))`` with
    ``threshold`` the smallest selected noisy logit of each token and
    ``sigma = gate_noise / E`` (Tutel compares probabilities with logits here; kept as is).
    ``cv^2`` uses the unbiased variance, like Tutel.

    Args:
        scores_wo_noise: ``[T, E]`` softmax of the clean logits.
        topk_logits: ``[T, K]`` noisy logits of the selected experts (best first).
    """
    if gate_noise <= 0:
        raise ValueError(f"load_importance_loss needs gate_noise > 0 (is_gshard_loss=False), got {gate_noise}")
    s_TE = scores_wo_noise.float()
    imp = _cv_squared_unbiased(s_TE.sum(dim=0))
    sigma = gate_noise / num_global_experts
    threshold_T1 = topk_logits[:, -1:].float()
    prob_TE = 0.5 * (1 + torch.erf((s_TE - threshold_T1) / (sigma * math.sqrt(2.0))))
    load = _cv_squared_unbiased(prob_TE.sum(dim=0))
    return (imp + load) / 2.0
