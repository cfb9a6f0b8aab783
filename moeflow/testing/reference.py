"""Readable references for the MoE layer (legend: moeflow.types, plus ``P`` the cosine router's
projection dim).

They read the parameters of a ``moeflow.MoE`` layer and recompute its output in the plainest
way that still runs, so tests can compare outputs *and* gradients (the references are
differentiable in the same parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from moeflow.dispatch.capacity import capacity_rows
from moeflow.experts import GroupedExperts, ModuleExperts
from moeflow.kernels.activation import ACTIVATIONS, GATED, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moeflow.layer.moe import MoE
from moeflow.layer.router import router_compute_dtype

__all__ = ["reference_routing", "loop_moe", "einsum_moe"]


# ---------------------------------------------------------------- routing, token by token


def _reference_logits(layer: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    router = layer.router
    cfg = router.config
    dt = router_compute_dtype(cfg, x_TD.dtype)
    x_TD = x_TD.to(dt)
    if cfg.kind == "linear":
        logits_TE = x_TD @ router.linear.weight.to(dt).t()
        if router.linear.bias is not None:
            logits_TE = logits_TE + router.linear.bias.to(dt)
        return logits_TE
    z_TP = x_TD @ router.proj.weight.to(dt).t()
    if router.proj.bias is not None:
        z_TP = z_TP + router.proj.bias.to(dt)
    z_TP = z_TP / z_TP.norm(dim=1, keepdim=True).clamp_min(1e-12)
    m_EP = router.expert_embed.to(dt)
    m_EP = m_EP / m_EP.norm(dim=1, keepdim=True).clamp_min(1e-12)
    scale = torch.exp(torch.minimum(router.log_scale.to(dt), torch.tensor(math.log(1 / cfg.cosine_min_temperature), dtype=dt)))
    return (z_TP @ m_EP.t()) * scale


def reference_routing(layer: MoE, x_TD: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights_TK, ids_TK)`` from the layer's router parameters, one token at a time.

    Deterministic parts only: run the layer in eval mode (no noise, jitter or dropout) when
    comparing. The expert bias of aux-loss-free balancing is honoured.
    """
    cfg = layer.router.config
    logits_TE = _reference_logits(layer, x_TD)
    E = logits_TE.shape[1]
    bias = layer.router.expert_bias.tolist() if cfg.bias_update_rate > 0 else [0.0] * E
    per_group = E // cfg.num_groups
    weights, ids = [], []
    for logit_E in logits_TE:
        if cfg.scoring == "softmax":
            score_E = torch.exp(logit_E - logit_E.max()) / torch.exp(logit_E - logit_E.max()).sum()
        elif cfg.scoring == "sigmoid":
            score_E = 1 / (1 + torch.exp(-logit_E))
        else:
            score_E = logit_E
        sel = [float(s) + b for s, b in zip(score_E.tolist(), bias)]
        allowed = list(range(E))
        if cfg.num_groups > 1:
            def group_value(g: int) -> float:
                members = sorted(sel[g * per_group : (g + 1) * per_group], reverse=True)
                return members[0] if cfg.group_score == "max" else members[0] + members[1]

            best_groups = sorted(range(cfg.num_groups), key=group_value, reverse=True)[: cfg.topk_groups]
            allowed = [e for e in allowed if e // per_group in best_groups]
        chosen = sorted(allowed, key=lambda e: sel[e], reverse=True)[:top_k]
        picked = score_E[chosen]
        if cfg.scoring == "topk_softmax":
            w = torch.exp(picked - picked.max()) / torch.exp(picked - picked.max()).sum()
        elif cfg.normalize_topk:
            w = picked / picked.sum()
        else:
            w = picked
        weights.append(w * cfg.routed_scaling_factor)
        ids.append(chosen)
    return torch.stack(weights), torch.tensor(ids, dtype=torch.long, device=x_TD.device)


# ---------------------------------------------------------------- expert FFN, one expert


def _expert_ffn(layer: MoE, e: int, rows_ND: torch.Tensor) -> torch.Tensor:
    experts = layer.experts
    if isinstance(experts, ModuleExperts):
        return experts.experts[e](rows_ND)
    if not isinstance(experts, GroupedExperts):
        raise TypeError(f"the references support GroupedExperts and ModuleExperts, got {type(experts).__name__}")
    h = rows_ND @ experts.w_in[e]
    if experts.b_in is not None:
        h = h + experts.b_in[e]
    act = experts.config.activation
    if act == "swiglu_oai":  # gpt-oss: the gate clamped above, the up half into [-limit, limit], + 1
        H = h.shape[-1] // 2
        limit = SWIGLU_OAI_LIMIT
        gate, up = torch.clamp(h[:, :H], max=limit), torch.clamp(h[:, H:], -limit, limit)
        a = gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate) * (up + 1)
    elif act in GATED:
        H = h.shape[-1] // 2
        gate, up = h[:, :H], h[:, H:]
        a = (gate * torch.sigmoid(gate) if act == "swiglu" else F.gelu(gate)) * up
    elif act == "relu":
        a = torch.clamp_min(h, 0)
    elif act == "silu":
        a = h * torch.sigmoid(h)
    elif act == "gelu":
        a = F.gelu(h)
    else:
        raise ValueError(f"the references know the activations {list(ACTIVATIONS)}, got {act!r}")
    out = a @ experts.w_out[e]
    if experts.b_out is not None:
        out = out + experts.b_out[e]
    return out


def _resolve(layer: MoE, capacity_factor: float | None, top_k: int | None) -> tuple[float, int]:
    cf = layer.config.capacity_factor if capacity_factor is None else capacity_factor
    k = layer.config.top_k if top_k is None else top_k
    return cf, k


# ---------------------------------------------------------------- per-expert loop


def loop_moe(
    layer: MoE,
    x: torch.Tensor,
    *,
    capacity_factor: float | None = None,
    top_k: int | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The MoE layer as a loop over experts.

    ``routing`` = ``(weights_TK, ids_TK)``; by default ``reference_routing`` computes it (slow,
    token by token; benchmarks pass the layer router's output instead).
    """
    cf, K = _resolve(layer, capacity_factor, top_k)
    x_TD = x.reshape(-1, x.shape[-1])
    T, E = x_TD.shape[0], layer.config.num_experts
    if T == 0:
        return x * 0
    weights_TK, ids_TK = routing if routing is not None else reference_routing(layer, x_TD, K)
    weights_TK = weights_TK.to(x.dtype)
    cap = None if cf == 0 else capacity_rows(abs(cf), num_tokens=T, top_k=K, num_experts=E)
    policy = layer.config.dispatch.drop_policy
    token_rank_T = torch.empty(T, dtype=torch.long, device=x.device)
    token_rank_T[torch.sort(-weights_TK.detach().amax(dim=1), stable=True).indices] = torch.arange(T, device=x.device)

    kept_TK = torch.zeros(T, K, dtype=torch.bool, device=x.device)
    for e in range(E):
        t_idx, k_idx = (ids_TK == e).nonzero(as_tuple=True)  # token order, then choice
        if cap is not None and t_idx.numel() > cap:
            if policy == "position":
                key = k_idx * T + t_idx
            elif policy == "bpr":
                key = k_idx * T + token_rank_T[t_idx]
            else:  # "score": by weight, ties by flat index t*K+k (the nonzero order)
                key = torch.sort(-weights_TK.detach()[t_idx, k_idx], stable=True).indices.argsort()
            keep = torch.sort(key).indices[:cap]
            t_idx, k_idx = t_idx[keep], k_idx[keep]
        kept_TK[t_idx, k_idx] = True

    w_TK = torch.where(kept_TK, weights_TK, torch.zeros((), dtype=weights_TK.dtype))
    if layer.config.dispatch.renormalize_after_drop:
        kept_sum_T = w_TK.sum(dim=1, keepdim=True)
        w_TK = torch.where(kept_sum_T > 0, w_TK * weights_TK.sum(dim=1, keepdim=True) / torch.where(kept_sum_T > 0, kept_sum_T, 1), 0)

    y_TD = torch.zeros_like(x_TD)
    at_dispatch = layer.config.dispatch.weight_at == "dispatch"
    for e in range(E):
        t_idx, k_idx = ((ids_TK == e) & kept_TK).nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            continue
        w_N1 = w_TK[t_idx, k_idx].unsqueeze(1)
        rows_ND = x_TD[t_idx] * w_N1 if at_dispatch else x_TD[t_idx]
        out_ND = _expert_ffn(layer, e, rows_ND)
        y_TD = y_TD.index_add(0, t_idx, out_ND if at_dispatch else out_ND * w_N1)
    if layer.shared is not None:
        y_TD = y_TD + layer.shared(x_TD)
    return y_TD.view(x.shape)


# ---------------------------------------------------------------- GShard one-hot einsum


def einsum_moe(
    layer: MoE,
    x: torch.Tensor,
    *,
    capacity_factor: float | None = None,
    top_k: int | None = None,
    routing: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """GShard-style MoE: one-hot dispatch/combine tensors ``[T, E, C]`` and two einsums.

    Slots follow the GShard cumsum over choice-major one-hots (drop policy ``"position"``;
    ``"bpr"`` by sorting tokens first). ``capacity_factor=0`` pads every expert to the busiest
    expert's load, as this lineage does; a negative factor is not supported.
    """
    cf, K = _resolve(layer, capacity_factor, top_k)
    x_TD = x.reshape(-1, x.shape[-1])
    T, E = x_TD.shape[0], layer.config.num_experts
    if T == 0:
        return x * 0
    policy = layer.config.dispatch.drop_policy
    if policy == "score":
        raise ValueError("einsum_moe supports drop_policy 'position' and 'bpr', got 'score'")
    if cf < 0:
        raise ValueError(f"einsum_moe does not support capped dropless capacity_factor < 0, got {cf}")
    weights_TK, ids_TK = routing if routing is not None else reference_routing(layer, x_TD, K)
    weights_TK = weights_TK.to(x.dtype)
    order_T = torch.arange(T, device=x.device)
    if policy == "bpr":
        order_T = torch.sort(-weights_TK.detach().amax(dim=1), stable=True).indices
    w_TK, ids_TK, xs_TD = weights_TK[order_T], ids_TK[order_T], x_TD[order_T]

    mask_KTE = F.one_hot(ids_TK.t(), E)
    loc_KTE = torch.cumsum(mask_KTE.reshape(K * T, E), dim=0).reshape(K, T, E) - 1
    C = int(mask_KTE.sum(dim=(0, 1)).max()) if cf == 0 else capacity_rows(cf, num_tokens=T, top_k=K, num_experts=E)
    keep_KTE = mask_KTE.bool() & (loc_KTE < C)
    if layer.config.dispatch.renormalize_after_drop:
        kept_w_TK = w_TK * keep_KTE.any(dim=2).t()
        kept_sum = kept_w_TK.sum(dim=1, keepdim=True)
        w_TK = torch.where(kept_sum > 0, kept_w_TK * w_TK.sum(dim=1, keepdim=True) / torch.where(kept_sum > 0, kept_sum, 1), 0)
    combine_TEC = x.new_zeros(T, E, C)
    dispatch_TEC = x.new_zeros(T, E, C)
    for k in range(K):
        slot_TEC = F.one_hot(loc_KTE[k].clamp(0, C - 1), C).to(x.dtype) * keep_KTE[k].unsqueeze(-1)
        dispatch_TEC = dispatch_TEC + slot_TEC
        combine_TEC = combine_TEC + slot_TEC * w_TK[:, k, None, None]
    at_dispatch = layer.config.dispatch.weight_at == "dispatch"
    expert_in_ECD = torch.einsum("tec,td->ecd", combine_TEC if at_dispatch else dispatch_TEC, xs_TD)
    counts_E = keep_KTE.sum(dim=(0, 1))
    if isinstance(layer.experts, GroupedExperts):
        expert_out_ECD = layer.experts(expert_in_ECD, counts_E)
    else:
        expert_out_ECD = torch.stack([_expert_ffn(layer, e, expert_in_ECD[e]) for e in range(E)])
    ys_TD = torch.einsum("tec,ecd->td", dispatch_TEC if at_dispatch else combine_TEC, expert_out_ECD)
    y_TD = torch.empty_like(ys_TD).index_copy(0, order_T, ys_TD)
    if layer.shared is not None:
        y_TD = y_TD + layer.shared(x_TD)
    return y_TD.view(x.shape)
