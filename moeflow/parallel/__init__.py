"""Expert parallelism over torch.distributed, applied from outside the model.

The only package of moeflow that touches ``torch.distributed``. ``expert_parallel`` swaps each
MoE layer's dispatcher for an ``ExpertParallelDispatcher``; see ``docs/architecture.md`` for how
its modules fit together.
"""

from moeflow.config import ParallelConfig
from moeflow.parallel.apply import expert_parallel, fix_tuned_settings, gather_hidden_experts, tuned_settings
from moeflow.parallel.dcp.state import DCPState, dcp_state_dict, load_dcp, load_dcp_state_dict, save_dcp
from moeflow.parallel.dcp.guard import RankLocalTensor
from moeflow.parallel.dcp.tensor import ChunkedTensor
from moeflow.parallel.dispatcher import ExpertParallelDispatcher
from moeflow.parallel.exchange.alltoall import FlatExchange, HierarchicalExchange, Hierarchy
from moeflow.parallel.gradients import (
    all_reduce_gradients,
    clip_grad_norm_,
    ddp_ignore_expert_parameters,
    dense_parameters,
    expert_parameters,
    fsdp_ignored_parameters,
    reduce_expert_gradients,
    sync_load_counts,
    vocab_parameters,
)
from moeflow.parallel.groups import ParallelGroups, init_distributed, make_groups, shutdown_distributed
from moeflow.parallel.placement.plan import Placement, plan_placement
from moeflow.parallel.exchange.plan import ExchangePlan
from moeflow.parallel.placement.rebalance import apply_placement, placement_of, rebalance, sync_replica_gradients
from moeflow.parallel.vocab import gather_vocab_weight, vocab_range

__all__ = [
    "expert_parallel",
    "ParallelConfig",
    "gather_hidden_experts",
    "tuned_settings",
    "fix_tuned_settings",
    "ExpertParallelDispatcher",
    "ExchangePlan",
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
    "vocab_parameters",
    "vocab_range",
    "gather_vocab_weight",
    "dcp_state_dict",
    "load_dcp_state_dict",
    "DCPState",
    "save_dcp",
    "load_dcp",
    "ChunkedTensor",
    "RankLocalTensor",
]
