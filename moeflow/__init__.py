"""moeflow: Mixture-of-Experts layers for PyTorch, from one CPU to a GPU cluster.

The public surface is small: the ``MoE`` layer, its config dataclasses, the loss helpers, and
the building blocks (router, dispatcher, experts) for people who assemble their own.
"""

from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, ParallelConfig, RouterConfig, TunerConfig
from moeflow.dispatch import Dispatcher, LocalDispatcher
from moeflow.experts import Experts, GroupedExperts, ModuleExperts
from moeflow.experts.weight_grads import zero_grad_
from moeflow.layer import (
    MoE,
    Router,
    RoutingTape,
    aux_loss,
    moe_layers,
    record_routing,
    replay_routing,
    update_expert_bias,
)
from moeflow.types import DispatchPlan, ExpertLayout, RoutingResult

__version__ = "0.1.0"

__all__ = [
    "MoE",
    "MoEConfig",
    "RouterConfig",
    "DispatchConfig",
    "TunerConfig",
    "ParallelConfig",
    "ExpertsConfig",
    "Router",
    "Dispatcher",
    "LocalDispatcher",
    "Experts",
    "GroupedExperts",
    "ModuleExperts",
    "RoutingResult",
    "DispatchPlan",
    "ExpertLayout",
    "aux_loss",
    "update_expert_bias",
    "zero_grad_",
    "moe_layers",
    "RoutingTape",
    "record_routing",
    "replay_routing",
]
