"""Routing math: logits -> (weights_TK, ids_TK, scores_TE) and the balance losses. Pure torch."""

from moeflow.routing.losses import (
    importance_loss,
    load_balance_loss,
    load_loss,
    router_z_loss,
    smooth_load_E,
)
from moeflow.routing.scoring import limit_groups, select_experts

__all__ = [
    "select_experts",
    "limit_groups",
    "load_balance_loss",
    "importance_loss",
    "load_loss",
    "smooth_load_E",
    "router_z_loss",
]
