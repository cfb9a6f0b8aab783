"""The Router module: ``x_TD -> RoutingResult`` (legend: moeflow.types, plus ``P`` the cosine
router's projection dim)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.config import RouterConfig
from moeflow.routing import (
    importance_loss,
    load_balance_loss,
    load_loss,
    router_z_loss,
    select_experts,
    smooth_load_E,
)
from moeflow.types import RoutingResult

__all__ = ["Router", "router_compute_dtype"]


def router_compute_dtype(config: RouterConfig, input_dtype: torch.dtype) -> torch.dtype:
    """``config.dtype``, or the input dtype promoted to at least float32."""
    if config.dtype is not None:
        return config.dtype
    return torch.promote_types(input_dtype, torch.float32)


class Router(nn.Module):
    """Scores tokens against experts and picks the top-k.

    Linear router: ``logits = x W^T (+ b)`` with ``weight [E, D]``.
    Cosine router (SwinV2-MoE / X-MoE): ``logits = cos(x P, M_e) * s`` with a projection
    ``P [D -> proj]``, expert embeddings ``M [E, proj]`` and a learnable scale
    ``s = exp(min(log_scale, log(1/min_temperature)))``, initialised to ``1/init_temperature``.

    Aux-loss-free balancing keeps two buffers: ``expert_bias [E]`` (added to the scores for
    selection only; kept in fp32 whatever the module dtype) and ``load_counts [E]`` (int64:
    assignments seen in training since the last ``update_bias()``); both live outside autograd
    and are saved in the state dict (so a resumed run continues the same balancing step).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_experts: int,
        config: RouterConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config if config is not None else RouterConfig()
        self.dim, self.num_experts = dim, num_experts
        kw = {"device": device, "dtype": dtype}
        cfg = self.config
        if cfg.kind == "linear":
            self.linear = nn.Linear(dim, num_experts, bias=cfg.bias, **kw)
        else:
            self.proj = nn.Linear(dim, cfg.cosine_proj_dim, bias=cfg.bias, **kw)
            self.expert_embed = nn.Parameter(torch.empty(num_experts, cfg.cosine_proj_dim, **kw))
            self.log_scale = nn.Parameter(torch.full((), math.log(1.0 / cfg.cosine_init_temperature), **kw))
            nn.init.normal_(self.expert_embed, std=0.32)
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        self.register_buffer("load_counts", torch.zeros(num_experts, device=device, dtype=torch.long))

    def _apply(self, fn, recurse=True):  # type: ignore[override]
        # ``module.to(torch.bfloat16)`` would round the bias (its steps are ~1e-3), so it stays
        # fp32 and only follows device moves; ``load_counts`` is int64 and never cast.
        bias = self.expert_bias
        super()._apply(fn, recurse)
        moved = self.expert_bias
        # meta tensors (to_empty after meta-device init) have no values to keep
        self.expert_bias = moved.float() if bias.is_meta else bias.to(device=moved.device)
        return self

    def extra_repr(self) -> str:
        c = self.config
        return f"kind={c.kind}, scoring={c.scoring}, num_experts={self.num_experts}, groups={c.num_groups}/{c.topk_groups}"

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Clean router logits ``[T, E]`` in the router dtype (no noise, jitter or dropout)."""
        dt = router_compute_dtype(self.config, x_TD.dtype)
        x_TD = x_TD.to(dt)
        if self.config.kind == "linear":
            b = self.linear.bias.to(dt) if self.linear.bias is not None else None
            return F.linear(x_TD, self.linear.weight.to(dt), b)
        b = self.proj.bias.to(dt) if self.proj.bias is not None else None
        z_TP = F.normalize(F.linear(x_TD, self.proj.weight.to(dt), b), dim=-1)
        m_EP = F.normalize(self.expert_embed.to(dt), dim=-1)
        scale = torch.clamp(self.log_scale.to(dt), max=math.log(1.0 / self.config.cosine_min_temperature)).exp()
        return (z_TP @ m_EP.t()) * scale

    def forward(self, x_TD: torch.Tensor, *, top_k: int, forced_ids_TK: torch.Tensor | None = None,
                losses: bool = True) -> RoutingResult:
        """Route ``x_TD``; ``forced_ids_TK [T, top_k]`` (router replay) replaces the choice of
        experts: the weights of those experts come from the current logits, and assignment
        counts (losses' count terms, load counters) count the replayed choice.

        ``losses=False`` leaves ``aux_losses`` empty: the balance losses are not computed (a
        decode step of generation routes a handful of tokens, and nobody reads its losses).
        A per-call choice, never inferred from ``torch.is_grad_enabled()``: an evaluation under
        ``no_grad`` still gets its losses."""
        if not isinstance(losses, bool):
            raise TypeError(f"losses must be a bool, got {type(losses).__name__} {losses!r}")
        cfg = self.config
        if forced_ids_TK is not None:
            self._check_forced(forced_ids_TK, x_TD.shape[0], top_k)
        if self.training and cfg.jitter_eps > 0:
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - cfg.jitter_eps, 1.0 + cfg.jitter_eps)
        if self.training and cfg.input_dropout > 0:
            x_TD = F.dropout(x_TD, p=cfg.input_dropout, training=True)
        clean_TE = self.logits(x_TD)
        noisy = self.training and cfg.noise_std > 0
        logits_TE = clean_TE + torch.randn_like(clean_TE) * cfg.noise_std if noisy else clean_TE

        use_bias = cfg.bias_update_rate > 0
        weights_TK, ids_TK, scores_TE = select_experts(
            logits_TE,
            top_k=top_k,
            scoring=cfg.scoring,
            normalize_topk=cfg.normalize_topk,
            routed_scaling_factor=cfg.routed_scaling_factor,
            num_groups=cfg.num_groups,
            topk_groups=cfg.topk_groups,
            group_score=cfg.group_score,
            selection_bias_E=self.expert_bias if use_bias else None,
            forced_ids_TK=None if forced_ids_TK is None else forced_ids_TK.to(x_TD.device),
        )
        aux: dict[str, torch.Tensor] = {}
        routing = RoutingResult(weights_TK=weights_TK, ids_TK=ids_TK, logits_TE=logits_TE, scores_TE=scores_TE, aux_losses=aux)
        if use_bias and self.training:
            with torch.no_grad():
                self.load_counts += routing.counts_E
        if not losses:
            return routing

        if x_TD.shape[0] == 0:  # an empty batch (possible on one rank of a group): zero losses
            zero = logits_TE.sum()
            aux.update({name: zero for name, coef in self._loss_coefs() if coef > 0})
            return routing
        if cfg.load_balance_coef > 0:
            if cfg.scoring == "sigmoid":
                probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
            elif cfg.scoring == "softmax":
                probs_TE = scores_TE  # already softmax(logits)
            else:
                probs_TE = torch.softmax(logits_TE, dim=-1)
            aux["load_balance"] = cfg.load_balance_coef * load_balance_loss(probs_TE, ids_TK, routing.counts_E)
        if cfg.importance_coef > 0:
            aux["importance"] = cfg.importance_coef * importance_loss(weights_TK, ids_TK, self.num_experts)
        if cfg.load_coef > 0:
            if noisy:
                load_E = smooth_load_E(clean_TE, logits_TE, cfg.noise_std, top_k)
            else:
                load_E = routing.counts_E.to(logits_TE.dtype)
            aux["load"] = cfg.load_coef * load_loss(load_E)
        if cfg.z_loss_coef > 0:
            aux["z_loss"] = cfg.z_loss_coef * router_z_loss(logits_TE)
        return routing

    def _check_forced(self, ids_TK: torch.Tensor, T: int, top_k: int) -> None:
        if not isinstance(ids_TK, torch.Tensor) or ids_TK.dtype != torch.int64:
            raise TypeError(f"replayed ids must be an int64 tensor, got {getattr(ids_TK, 'dtype', type(ids_TK))}")
        if tuple(ids_TK.shape) != (T, top_k):
            raise ValueError(
                f"replayed ids have shape {tuple(ids_TK.shape)} but this call routes {T} tokens with top_k={top_k}"
            )
        if ids_TK.numel() and not (0 <= int(ids_TK.min()) and int(ids_TK.max()) < self.num_experts):
            raise ValueError(f"replayed ids must be in [0, {self.num_experts}), got {int(ids_TK.min())}..{int(ids_TK.max())}")
        if top_k > 1 and bool((ids_TK.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise ValueError("replayed ids repeat an expert within a token's row; each row needs top_k distinct experts")

    def _loss_coefs(self) -> list[tuple[str, float]]:
        c = self.config
        return [("load_balance", c.load_balance_coef), ("importance", c.importance_coef), ("load", c.load_coef), ("z_loss", c.z_loss_coef)]

    def update_bias(self, load_counts_E: torch.Tensor | None = None) -> None:
        """Aux-loss-free balancing step (DeepSeek-V3): ``bias += rate * sign(mean_load - load)``.

        Uses ``load_counts_E`` if given (e.g. counts all-reduced over data-parallel ranks),
        otherwise the counts accumulated since the last update, which are then reset. Call it
        once per optimizer step, after all micro-batches: the counts of every micro-batch are
        included, so gradient accumulation does not change the update.
        """
        rate = self.config.bias_update_rate
        if rate <= 0:
            raise RuntimeError("update_bias() needs RouterConfig(bias_update_rate > 0)")
        with torch.no_grad():  # (not a decorator: mutation testing leaves decorated functions alone)
            counts_E = (self.load_counts if load_counts_E is None else load_counts_E).to(torch.float64)
            # no tokens since the last update: every count is 0, so is every sign, and the bias
            # stays (no branch on the counts: the step reads nothing back to the host)
            self.expert_bias += rate * torch.sign(counts_E.mean() - counts_E).to(self.expert_bias)
            self.load_counts.zero_()
