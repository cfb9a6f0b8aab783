"""Balance and stability losses of the router (legend: moeflow.types).

Each returns an *unweighted* scalar; the router multiplies by the configured coefficient.
"""

from __future__ import annotations

import math

import torch

from moeflow.kernels.counts import count_ids

__all__ = ["load_balance_loss", "importance_loss", "load_loss", "smooth_load_E", "router_z_loss", "cv_squared"]


def cv_squared(x_E: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """Squared coefficient of variation ``var / mean^2`` (population variance, as Shazeer 2017)."""
    x_E = x_E.float() if x_E.dtype in (torch.float16, torch.bfloat16) else x_E
    if x_E.numel() <= 1:
        return x_E.sum() * 0
    return x_E.var(unbiased=False) / (x_E.mean() ** 2 + eps)


def load_balance_loss(probs_TE: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor | None = None) -> torch.Tensor:
    """GShard/Switch balance loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the fraction of the T*K assignments (before capacity drops) that chose expert e,
    ``P_e`` the mean router probability of e. Equals 1 under perfect balance. ``counts_E``
    (assignments per expert) is counted from ``ids_TK`` unless given.
    """
    T, E = probs_TE.shape
    counts_E = (count_ids(ids_TK, E) if counts_E is None else counts_E).to(probs_TE.dtype)
    frac_E = counts_E / ids_TK.numel()
    return E * (frac_E * probs_TE.mean(dim=0)).sum()


def importance_loss(weights_TK: torch.Tensor, ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Shazeer 2017 importance loss: cv^2 of the per-expert sum of gate values."""
    importance_E = weights_TK.new_zeros(num_experts).index_add(0, ids_TK.reshape(-1), weights_TK.reshape(-1))
    return cv_squared(importance_E)


def smooth_load_E(clean_logits_TE: torch.Tensor, noisy_logits_TE: torch.Tensor, noise_std: float, top_k: int) -> torch.Tensor:
    """Shazeer 2017 smooth load estimator: sum over tokens of P(expert e is in the top-k).

    For each expert, the probability (under fresh noise on that expert only) that its noisy
    logit beats the k-th best of the *other* experts: the normal CDF of
    ``(clean - threshold) / noise_std``. Differentiable in the clean logits.
    """
    T, E = clean_logits_TE.shape
    if top_k >= E:
        return clean_logits_TE.new_full((E,), float(T))
    top_TK1 = noisy_logits_TE.topk(top_k + 1, dim=-1).values
    threshold_if_in_T1 = top_TK1[:, top_k : top_k + 1]  # the (k+1)-th: what e must beat if it is in
    threshold_if_out_T1 = top_TK1[:, top_k - 1 : top_k]  # the k-th: what e must beat if it is out
    is_in_TE = noisy_logits_TE > threshold_if_in_T1
    normal_cdf = lambda z: 0.5 * (1 + torch.erf(z / math.sqrt(2.0)))  # noqa: E731
    prob_if_in = normal_cdf((clean_logits_TE - threshold_if_in_T1) / noise_std)
    prob_if_out = normal_cdf((clean_logits_TE - threshold_if_out_T1) / noise_std)
    return torch.where(is_in_TE, prob_if_in, prob_if_out).sum(dim=0)


def load_loss(load_E: torch.Tensor) -> torch.Tensor:
    """Shazeer 2017 load loss: cv^2 of the (smooth or counted) per-expert load."""
    return cv_squared(load_E)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens of ``logsumexp(logits)^2``."""
    return torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
