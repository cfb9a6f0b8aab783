"""Modules: Router, MoE. A dispatcher is injected, never built for parallelism here."""

from moeflow.layer.moe import MoE, aux_loss, moe_layers, update_expert_bias
from moeflow.layer.replay import RoutingTape, record_routing, replay_routing
from moeflow.layer.router import Router, router_compute_dtype

__all__ = ["MoE", "Router", "aux_loss", "moe_layers", "update_expert_bias", "router_compute_dtype",
           "RoutingTape", "record_routing", "replay_routing"]
