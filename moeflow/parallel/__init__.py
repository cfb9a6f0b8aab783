"""Expert parallelism over torch.distributed, applied from outside the model.

The only package of moeflow that touches ``torch.distributed``.
"""

from moeflow.parallel.api import (
    all_reduce_gradients,
    clip_grad_norm_,
    reduce_expert_gradients,
    ddp_ignore_expert_parameters,
    dense_parameters,
    vocab_parameters,
    expert_parallel,
    expert_parameters,
    fsdp_ignored_parameters,
    gather_hidden_experts,
    fix_tuned_settings,
    sync_load_counts,
    tuned_settings,
)
from moeflow.parallel.dispatcher import AllToAllDispatcher, AllToAllPlan
from moeflow.parallel.placement import (
    Placement,
    apply_placement,
    placement_of,
    plan_placement,
    rebalance,
    sync_replica_gradients,
)
from moeflow.parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    gather_vocab_weight,
    vocab_parallel,
    vocab_range,
)
from moeflow.parallel.exchange import FlatExchange, HierarchicalExchange, Hierarchy
from moeflow.parallel.groups import ParallelGroups, init_distributed, make_groups, shutdown_distributed

__all__ = [
    "expert_parallel",
    "gather_hidden_experts",
    "tuned_settings",
    "fix_tuned_settings",
    "AllToAllDispatcher",
    "AllToAllPlan",
    "init_distributed",
    "shutdown_distributed",
    "make_groups",
    "ParallelGroups",
    "expert_parameters",
    "dense_parameters",
    "ddp_ignore_expert_parameters",
    "fsdp_ignored_parameters",
    "sync_load_counts",
    "all_reduce_gradients",
    "clip_grad_norm_",
    "reduce_expert_gradients",
    "FlatExchange",
    "HierarchicalExchange",
    "Hierarchy",
    "Placement",
    "plan_placement",
    "apply_placement",
    "rebalance",
    "sync_replica_gradients",
    "placement_of",
    "vocab_parallel",
    "vocab_parameters",
    "vocab_range",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "gather_vocab_weight",
]
