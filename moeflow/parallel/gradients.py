"""Gradients of expert-parallel models: which parameters are sharded (experts, vocabulary
shards) and which replicated, wrappers (DDP, FSDP2) told to skip the experts, reductions over
the data-parallel group, and the global gradient norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.layer.moe import moe_layers
from moeflow.parallel.comm import all_reduce_sum
from moeflow.parallel.groups import ParallelGroups
from moeflow.parallel.placement.rebalance import placement_of

__all__ = [
    "expert_parameters",
    "vocab_parameters",
    "dense_parameters",
    "ddp_ignore_expert_parameters",
    "fsdp_ignored_parameters",
    "sync_load_counts",
    "all_reduce_gradients",
    "clip_grad_norm_",
    "reduce_expert_gradients",
]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of routed experts (tagged ``moeflow_expert``): sharded, never averaged over
    the expert-parallel group."""
    return [p for p in model.parameters() if getattr(p, "moeflow_expert", False)]


def vocab_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Vocabulary shards (``moeflow.models.vocab_parallel``, tagged ``moeflow_vocab_shard``):
    split over the group like experts, their gradients already summed over it."""
    return [p for p in model.parameters() if getattr(p, "moeflow_vocab_shard", False)]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter (router, shared experts, the rest of the model): replicated."""
    return [p for p in model.parameters()
            if not getattr(p, "moeflow_expert", False) and not getattr(p, "moeflow_vocab_shard", False)]


def ddp_ignore_expert_parameters(model: nn.Module) -> list[str]:
    """Make ``DistributedDataParallel`` (built *after* this call) skip the expert parameters.

    DDP then averages only dense gradients over its process group; average the expert gradients
    over the data-parallel group (ranks holding the same experts) yourself with
    ``all_reduce_gradients(expert_parameters(model), groups.data)``. Returns the ignored names.
    """
    names = [name for name, p in model.named_parameters() if getattr(p, "moeflow_expert", False)]
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def fsdp_ignored_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The expert parameters as a set for FSDP2: ``fully_shard(model, ignored_params=...)``.

    FSDP2 then shards and reduces only the dense parameters over its mesh; the experts stay
    whole on their expert-parallel rank (average them over the data-parallel group with
    ``all_reduce_gradients`` when there are replicas).
    """
    return set(expert_parameters(model))


def sync_load_counts(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Sum every MoE router's aux-loss-free ``load_counts`` over ``group`` (the ranks that share
    that router), so ``moeflow.update_expert_bias`` makes the same step on every replica."""
    for layer in moe_layers(model):
        all_reduce_sum(layer.router.load_counts, group)


def reduce_expert_gradients(model: nn.Module, groups: ParallelGroups) -> None:
    """Turn the expert gradients into the gradient of the loss averaged over every rank (what
    DDP/FSDP make of the dense gradients). Call after backward, on every rank.

    The all-to-all backward already *sums* each expert's gradient over the ranks of its expert
    group (each rank's loss reaches it), so averaging over the data group alone would leave them
    ``expert_size`` times too large next to DDP's averaged dense gradients: this sums over
    ``groups.data`` and divides by the world size (``expert_size * data_size``).
    """
    params = expert_parameters(model)
    all_reduce_gradients(params, groups.data, average=False)
    scale = 1.0 / (groups.expert_size * groups.data_size)
    for p in params:
        p.grad.mul_(scale)


def all_reduce_gradients(params: list[nn.Parameter], group: dist.ProcessGroup | None, *, average: bool = True) -> None:
    """Sum (or average) the gradients of ``params`` over ``group``, in one flat buffer."""
    # a parameter without a gradient counts as zeros, so every rank reduces the same layout
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    all_reduce_sum(flat, group)
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm_(model: nn.Module, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the gradients of ``model`` to a global 2-norm of ``max_norm``; returns the norm
    before clipping. With replicated experts, call ``sync_replica_gradients`` first.

    Under expert parallelism the expert gradients are sharded over ``group`` while the dense
    ones are replicated (already reduced), so the global norm is
    ``sqrt(|dense|^2 + sum over ranks of |local experts|^2)``: the same number, and the same
    clipping, as one process holding everything. Without torch.distributed (or ``group`` of
    one rank) it is ``torch.nn.utils.clip_grad_norm_``.
    """
    with torch.no_grad():
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        grads_dense = [p.grad for p in dense_parameters(model) if p.grad is not None]
        grads_expert = [p.grad for p in expert_parameters(model) + vocab_parameters(model) if p.grad is not None]
        ref = next(model.parameters())
        sq_expert = torch.zeros((), dtype=torch.float64, device=ref.device)
        # a replicated expert (load-aware placement) counts once: weight each slot by 1/replicas
        slot_weight = {}
        for layer in moe_layers(model):
            placement = placement_of(layer)
            if placement is not None and max(placement.num_replicas) > 1:
                w = torch.tensor([1.0 / placement.num_replicas[x] for x in layer.dispatcher.layout.slot_experts],
                                 dtype=torch.float64, device=ref.device)
                slot_weight.update({id(p): w for p in layer.experts.parameters()})
        for p in expert_parameters(model) + vocab_parameters(model):
            if p.grad is None:
                continue
            sq = p.grad.double().square()
            if id(p) in slot_weight:
                sq_expert += (sq.reshape(p.shape[0], -1).sum(1) * slot_weight[id(p)]).sum()
            else:
                sq_expert += sq.sum()
        all_reduce_sum(sq_expert, group)  # nothing without torch.distributed
        sq = sq_expert + sum((g.double().square().sum() for g in grads_dense), torch.zeros_like(sq_expert))
        norm = sq.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for g in grads_dense + grads_expert:
            g.mul_(scale.to(g.dtype))
        return norm
