"""Fused top-k routing: scores, top-k and weight normalisation in one kernel
(legend: moeflow.types).

One program owns ``BLOCK_T`` tokens and the whole row of ``E <= 256`` (up to
``MAX_ROUTING_EXPERTS``) logits, so the softmax/sigmoid, the ``K`` arg-max passes and the
renormalisation all happen in registers, in fp32, with one read of the logits and one write of
each output. Reference: ``moeflow.routing.select_experts`` (group limits included; forced ids
are not a routing kernel's job), which the tests compare against exactly for the ids and to
rounding for the weights. Ties between equal scores go to the lower expert id.

Degenerate rows: the ``K`` ids of a row are always distinct and in ``[0, E)``, also when fewer
than ``K`` scores are finite (the -inf experts then fill the remaining picks, lowest id first).
A NaN score ranks above every number, as in ``torch.topk`` (so a NaN expert is always picked
and the weights of its row come out NaN, as in the reference); among several NaNs the lower id
goes first, where ``torch.topk`` leaves the order unspecified. Not checked (it would need a host
sync). With group limits, NaN scores make the choice of groups unspecified (ids stay distinct).

The backward needs no kernel of its own: it is a few elementwise ops on ``[T, E]``
(``_routing_backward``), written in torch and fused by ``torch.compile`` where used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard

__all__ = ["fused_topk_routing", "MAX_ROUTING_EXPERTS", "MAX_ROUTING_TOP_K"]

MAX_ROUTING_EXPERTS = 256
MAX_ROUTING_TOP_K = 8
_SCORINGS = {"softmax": 0, "sigmoid": 1, "topk_softmax": 2}


@triton.jit
def _routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, scores_ptr,
    T, E, stride_l, scale,
    SCORING: tl.constexpr, NORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, GROUP_TOP2: tl.constexpr,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    col_ok = experts < E
    ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(logits_ptr + rows64[:, None] * stride_l + experts[None, :], mask=ok, other=0.0).to(tl.float32)
    # padding experts can never win; padding tokens stay finite (they are not stored)
    x = tl.where(col_ok[None, :], x, float("-inf"))
    if SCORING == 0:  # softmax over experts
        z = tl.exp(x - tl.max(x, axis=1)[:, None])
        s = z / tl.sum(z, axis=1)[:, None]
    elif SCORING == 1:  # sigmoid per expert
        s = 1.0 / (1.0 + tl.exp(-x))
    else:  # top-k first, softmax over the k picked logits later
        s = x
    tl.store(scores_ptr + rows64[:, None] * E + experts[None, :], s.to(scores_ptr.dtype.element_ty), mask=ok)

    sel = s
    if HAS_BIAS:  # aux-loss-free balancing: the bias steers the choice, not the weights
        sel = sel + tl.load(bias_ptr + experts, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(col_ok[None, :], sel, float("-inf"))

    if NUM_GROUPS > 1:  # group-limited routing: only experts in the best TOPK_GROUPS groups compete
        group_of = experts // (E // NUM_GROUPS)
        gs = tl.arange(0, BLOCK_G)
        group_score = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for g in tl.static_range(NUM_GROUPS):
            in_g = tl.where((group_of == g)[None, :], sel, float("-inf"))
            score_g = tl.max(in_g, axis=1)
            if GROUP_TOP2:  # sum of the best two
                first = tl.argmax(in_g, axis=1)
                score_g += tl.max(tl.where(experts[None, :] == first[:, None], float("-inf"), in_g), axis=1)
            group_score = tl.where(gs[None, :] == g, score_g[:, None], group_score)
        keep_g = tl.zeros((BLOCK_T, BLOCK_G), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUPS):
            best_g = tl.argmax(group_score, axis=1)
            hit_g = gs[None, :] == best_g[:, None]
            keep_g = tl.where(hit_g, 1, keep_g)
            group_score = tl.where(hit_g, float("-inf"), group_score)
        keep_e = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int32)
        for g in tl.static_range(NUM_GROUPS):
            kept_g = tl.sum(tl.where(gs[None, :] == g, keep_g, 0), axis=1)
            keep_e = tl.where((group_of == g)[None, :] & (kept_g > 0)[:, None], 1, keep_e)
        sel = tl.where(keep_e > 0, sel, float("-inf"))

    ks = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    # Each pass picks, among the experts not picked yet: a NaN score first (torch.topk ranks NaN
    # above everything), else the highest score; ties (NaNs included) go to the lowest id. The
    # "not picked yet" mask, not a -inf overwrite, keeps the ids distinct even when a row has
    # fewer than K finite scores (an argmax over an all -inf row would return 0 every pass).
    is_nan = sel != sel
    sel = tl.where(is_nan, float("-inf"), sel)
    avail = (experts < E)[None, :] & (rows >= 0)[:, None]  # [BLOCK_T, BLOCK_E]
    for k in tl.static_range(K):
        nan_left = is_nan & avail
        has_nan = tl.max(nan_left.to(tl.int32), axis=1) > 0
        cand_sel = tl.where(avail, sel, float("-inf"))
        top = tl.max(cand_sel, axis=1)
        cand = tl.where(has_nan[:, None], nan_left, avail & (cand_sel == top[:, None]))
        best = tl.min(tl.where(cand, experts[None, :], BLOCK_E), axis=1)
        hit = experts[None, :] == best[:, None]
        val = tl.sum(tl.where(hit, s, 0.0), axis=1)
        picked = tl.where(ks[None, :] == k, val[:, None], picked)
        chosen = tl.where(ks[None, :] == k, best.to(tl.int64)[:, None], chosen)
        avail = avail & (experts[None, :] != best[:, None])

    k_ok = ks < K
    if SCORING == 2:
        p = tl.where(k_ok[None, :], picked, float("-inf"))
        z = tl.exp(p - tl.max(p, axis=1)[:, None])
        w = z / tl.sum(z, axis=1)[:, None]
    elif NORMALIZE:
        total = tl.sum(tl.where(k_ok[None, :], picked, 0.0), axis=1)
        w = picked / tl.maximum(total, 1.1754943508222875e-38)[:, None]
    else:
        w = picked
    w = w * scale
    out_ok = row_ok[:, None] & k_ok[None, :]
    tl.store(weights_ptr + rows64[:, None] * K + ks[None, :], w.to(weights_ptr.dtype.element_ty), mask=out_ok)
    tl.store(ids_ptr + rows64[:, None] * K + ks[None, :], chosen, mask=out_ok)


@torch.library.custom_op("moeflow::topk_routing", mutates_args=())
def _routing_op(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor | None,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
    num_groups: int,
    topk_groups: int,
    group_score: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_triton_tensors("fused_topk_routing", logits_TE=logits_TE)
    T, E = logits_TE.shape
    dev, dt = logits_TE.device, logits_TE.dtype
    weights_TK = torch.empty(T, top_k, dtype=dt, device=dev)
    ids_TK = torch.empty(T, top_k, dtype=torch.int64, device=dev)
    scores_TE = torch.empty(T, E, dtype=dt, device=dev)
    if T == 0:
        return weights_TK, ids_TK, scores_TE
    logits_TE = logits_TE.contiguous()
    block_e = triton.next_power_of_2(E)
    block_t = max(1, min(64, 4096 // block_e))
    with device_guard(logits_TE):
        _routing_kernel[(triton.cdiv(T, block_t),)](
            logits_TE, bias_E, weights_TK, ids_TK, scores_TE,
            T, E, logits_TE.stride(0), float(scale),
            SCORING=_SCORINGS[scoring], NORMALIZE=normalize, HAS_BIAS=bias_E is not None,
            NUM_GROUPS=num_groups, TOPK_GROUPS=topk_groups, GROUP_TOP2=group_score == "top2_sum",
            K=top_k, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            BLOCK_G=triton.next_power_of_2(num_groups),
        )
    return weights_TK, ids_TK, scores_TE


@_routing_op.register_fake
def _(logits_TE, bias_E, top_k, scoring, normalize, scale, num_groups, topk_groups, group_score):
    T, E = logits_TE.shape
    return (
        logits_TE.new_empty(T, top_k),
        logits_TE.new_empty(T, top_k, dtype=torch.int64),
        logits_TE.new_empty(T, E),
    )


def _routing_setup(ctx, inputs, output):
    scoring, normalize, scale = inputs[3:6]
    weights_TK, ids_TK, scores_TE = output
    ctx.scoring, ctx.normalize, ctx.scale = scoring, normalize, scale
    ctx.save_for_backward(ids_TK, scores_TE)
    ctx.mark_non_differentiable(ids_TK)


def _routing_backward(ctx, grad_weights_TK, grad_ids_TK, grad_scores_TE):
    """Chain rule through ``weights <- picked scores <- scores <- logits`` in fp32."""
    ids_TK, scores_TE = ctx.saved_tensors
    s_TE = scores_TE.float()
    ds_TE = torch.zeros_like(s_TE) if grad_scores_TE is None else grad_scores_TE.float()
    if grad_weights_TK is not None:
        gw_TK = grad_weights_TK.float() * ctx.scale
        p_TK = s_TE.gather(1, ids_TK)
        if ctx.scoring == "topk_softmax":
            u_TK = torch.softmax(p_TK, dim=-1)
            gp_TK = u_TK * (gw_TK - (gw_TK * u_TK).sum(-1, keepdim=True))
        elif ctx.normalize:
            total_T1 = p_TK.sum(-1, keepdim=True)
            tiny = torch.finfo(torch.float32).tiny
            clamped_T1 = total_T1.clamp_min(tiny)
            g_total_T1 = -(gw_TK * p_TK).sum(-1, keepdim=True) / clamped_T1**2 * (total_T1 >= tiny)
            gp_TK = gw_TK / clamped_T1 + g_total_T1
        else:
            gp_TK = gw_TK
        ds_TE = ds_TE.scatter_add(1, ids_TK, gp_TK)
    if ctx.scoring == "softmax":
        dl_TE = s_TE * (ds_TE - (ds_TE * s_TE).sum(-1, keepdim=True))
    elif ctx.scoring == "sigmoid":
        dl_TE = ds_TE * s_TE * (1 - s_TE)
    else:
        dl_TE = ds_TE
    return (dl_TE.to(scores_TE.dtype),) + (None,) * 8


_routing_op.register_autograd(_routing_backward, setup_context=_routing_setup)


def fused_topk_routing(
    logits_TE: torch.Tensor,
    *,
    top_k: int,
    scoring: str,
    normalize_topk: bool = False,
    routed_scaling_factor: float = 1.0,
    selection_bias_E: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    group_score: str = "max",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_experts`` in one kernel: ``(weights_TK, ids_TK, scores_TE)``.

    Args:
        logits_TE: router logits ``[T, E]``, ``E <= 256``; any float dtype (math in fp32,
            outputs in the logits dtype).
        top_k: ``K <= 8`` (and ``<= E``).
        scoring: ``"softmax"``, ``"sigmoid"`` or ``"topk_softmax"`` (softmax over the picked
            logits; ``scores_TE`` are then the logits themselves).
        normalize_topk: divide the picked scores by their sum (ignored for topk_softmax).
        routed_scaling_factor: multiply the weights by this.
        selection_bias_E: added to the scores for choosing only (aux-loss-free balancing).
        num_groups, topk_groups, group_score: group-limited routing (DeepSeek-V3): the ``E``
            experts form ``num_groups`` equal groups scored by their best (biased) score
            (``"max"``) or the sum of the best two (``"top2_sum"``); only experts in the best
            ``topk_groups`` groups are chosen (``moeflow.routing.limit_groups``).

    Ids are in descending order of (biased) score, like ``torch.topk``, and always distinct
    (also with fewer than ``K`` finite scores; NaN ranks first: module docstring); gradients flow
    to the logits through both ``weights_TK`` and ``scores_TE``.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"fused_topk_routing: logits_TE must be [T, E], got shape {tuple(logits_TE.shape)}")
    if not logits_TE.is_floating_point():
        raise TypeError(f"fused_topk_routing: logits_TE must be floating point, got {logits_TE.dtype}")
    E = logits_TE.shape[1]
    if not 1 <= E <= MAX_ROUTING_EXPERTS:
        raise ValueError(f"fused_topk_routing: needs 1 <= E <= {MAX_ROUTING_EXPERTS}, got E={E}")
    if not 1 <= top_k <= min(E, MAX_ROUTING_TOP_K):
        raise ValueError(f"fused_topk_routing: top_k must be in [1, {min(E, MAX_ROUTING_TOP_K)}], got {top_k}")
    if scoring not in _SCORINGS:
        raise ValueError(f"fused_topk_routing: scoring must be one of {list(_SCORINGS)}, got {scoring!r}")
    if selection_bias_E is not None and tuple(selection_bias_E.shape) != (E,):
        raise ValueError(f"fused_topk_routing: selection_bias_E must have shape ({E},), got {tuple(selection_bias_E.shape)}")
    if not (isinstance(num_groups, int) and num_groups >= 1 and E % num_groups == 0):
        raise ValueError(f"fused_topk_routing: num_groups must be a positive divisor of E={E}, got {num_groups!r}")
    if num_groups > 1:
        if group_score not in ("max", "top2_sum"):
            raise ValueError(f"fused_topk_routing: group_score must be 'max' or 'top2_sum', got {group_score!r}")
        if group_score == "top2_sum" and E // num_groups < 2:
            raise ValueError(f"fused_topk_routing: group_score='top2_sum' needs >= 2 experts per group, got {E // num_groups}")
        if not 1 <= topk_groups <= num_groups or top_k > topk_groups * (E // num_groups):
            raise ValueError(
                f"fused_topk_routing: topk_groups={topk_groups} must be in [1, {num_groups}] and hold at least "
                f"top_k={top_k} experts ({E // num_groups} per group)"
            )
    bias_E = None if selection_bias_E is None else selection_bias_E.detach().float().contiguous()
    return _routing_op(
        logits_TE, bias_E, int(top_k), scoring, bool(normalize_topk), float(routed_scaling_factor),
        int(num_groups), int(topk_groups) if num_groups > 1 else 1, group_score,
    )
