"""Moving experts between ranks to a new placement, and the gradients of replicated experts
(legend: moeflow.types; ``moeflow.parallel.placement.plan`` plans the placements).

- ``apply_placement(model, placements, optimizer)``: at a step boundary, move expert parameters
  *and* their optimizer state (every state tensor shaped like the parameter, e.g. Adam's moments)
  to the new slots with one all-to-all per layer; exact copies.
- ``rebalance(model, optimizer, slots_per_rank=)``: the above from each layer's load statistics
  (``MoEConfig(load_window=...)``) summed over the group.
- ``sync_replica_gradients(model)``: sum every replicated expert's gradient over its replicas,
  so each replica takes the step the single expert would.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moeflow.layer.moe import MoE, moe_layers
from moeflow.parallel.comm import all_reduce_sum, all_to_all_rows
from moeflow.parallel.dispatcher import ExpertParallelDispatcher
from moeflow.parallel.placement.plan import Placement, plan_placement

__all__ = ["apply_placement", "rebalance", "sync_replica_gradients", "placement_of"]


def placement_of(layer: MoE) -> Placement | None:
    """The placement of an expert-parallel layer (None for a single-process layer)."""
    return layer.dispatcher.placement if isinstance(layer.dispatcher, ExpertParallelDispatcher) else None


def _slot_tensors(layer: MoE) -> list[nn.Parameter]:
    params = list(layer.experts.parameters())
    s = int(layer.experts.num_experts)
    bad = [tuple(p.shape) for p in params if p.dim() == 0 or p.shape[0] != s]
    if bad:
        raise TypeError(f"placement needs expert parameters shaped [slots, ...] (GroupedExperts); got shapes {bad}")
    return params


def sync_replica_gradients(model: nn.Module) -> None:
    """Sum the gradients of every replicated expert over its replicas (one all-reduce per layer
    that has replicas; nothing otherwise). Call after backward, before clipping and the step, on
    every rank of the expert-parallel group."""
    with torch.no_grad():
        for layer in moe_layers(model):
            placement = placement_of(layer)
            if placement is None or max(placement.num_replicas) == 1:
                continue
            group = layer.dispatcher.group
            rank = layer.dispatcher.rank
            replicated = [x for x in range(placement.num_experts) if placement.num_replicas[x] > 1]
            index = {x: i for i, x in enumerate(replicated)}
            params = _slot_tensors(layer)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            width = sum(p[0].numel() for p in params)
            replicated_grads = params[0].new_zeros(len(replicated), width)
            mine = [(l, index[x]) for l, x in enumerate(placement.slots[rank]) if x in index]
            for l, i in mine:
                replicated_grads[i] = torch.cat([p.grad[l].reshape(-1) for p in params])
            all_reduce_sum(replicated_grads, group)
            for l, i in mine:
                offset = 0
                for p in params:
                    k = p[0].numel()
                    p.grad[l].copy_(replicated_grads[i, offset : offset + k].view_as(p.grad[l]))
                    offset += k


def _state_tensors(optimizer: torch.optim.Optimizer | None, p: nn.Parameter) -> list[str]:
    """Names of ``p``'s optimizer state entries shaped like ``p`` (moved with it)."""
    if optimizer is None or p not in optimizer.state:
        return []
    return sorted(k for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor) and v.shape == p.shape)


def apply_placement(
    model: nn.Module, placements: Sequence[Placement], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Move every MoE layer's experts to ``placements[i]`` (one per layer, in ``moe_layers``
    order), parameters and optimizer state exactly, with one all-to-all per layer. Call at a
    step boundary (gradients are dropped) on every rank of the expert-parallel group.

    The expert parameters become new ``nn.Parameter`` objects (their first dimension, the slot
    count, may change); ``optimizer`` is updated to hold them with their moved state. Another
    optimizer, or a wrapper that captured the old parameters, must be rebuilt."""
    with torch.no_grad():
        layers = moe_layers(model)
        if len(placements) != len(layers):
            raise ValueError(f"placements has {len(placements)} entries for {len(layers)} MoE layers")
        for i, (layer, new) in enumerate(zip(layers, placements)):
            old = placement_of(layer)
            if old is None:
                raise ValueError(f"MoE layer {i} is not expert-parallel (apply moeflow.parallel.expert_parallel first)")
            if not isinstance(new, Placement):
                raise TypeError(f"placements[{i}] must be a Placement, got {type(new).__name__}")
            if layer.dispatcher.layout.hidden_shards > 1:
                raise ValueError(f"MoE layer {i} splits its experts' hidden units (hidden_shards > 1): "
                                 "load-aware placement is not supported for it")
            if new.num_experts != old.num_experts or new.world != old.world:
                raise ValueError(f"placements[{i}] is for {new.num_experts} experts on {new.world} ranks; "
                                 f"layer {i} has {old.num_experts} experts on {old.world} ranks")
            _move_layer(layer, old, new, optimizer)


def _move_layer(layer: MoE, old: Placement, new: Placement, optimizer: torch.optim.Optimizer | None) -> None:
    disp = layer.dispatcher
    rank, W, group = disp.rank, old.world, disp.group
    params = _slot_tensors(layer)
    keys = [_state_tensors(optimizer, p) for p in params]
    # every rank must move the same state (an optimizer that has not stepped has none)
    tensors = [t for p, ks in zip(params, keys) for t in [p.data] + [optimizer.state[p][k] for k in ks]]
    primary = {x: old.replicas(x)[0] for x in range(old.num_experts)}  # source slot of each expert
    s_old = old.slots_per_rank
    # rows: source rank -> destination rank, ordered by destination slot
    sends = [[(primary[x] % s_old, r2, l2) for r2 in range(W) for l2, x in enumerate(new.slots[r2])
              if primary[x] // s_old == r] for r in range(W)]
    send_rows = [l for l, _, _ in sends[rank]]
    send_split = [sum(1 for _, r2, _ in sends[rank] if r2 == d) for d in range(W)]
    recv_split = [sum(1 for _, r2, _ in sends[src] if r2 == rank) for src in range(W)]
    # my new slots in arrival order: by source rank, then slot
    arrival = [l2 for src in range(W) for _, r2, l2 in sends[src] if r2 == rank]
    rows_out = torch.cat([t.reshape(t.shape[0], -1) for t in tensors], dim=1)
    idx = torch.tensor(send_rows, dtype=torch.long, device=rows_out.device)
    recv_rows = all_to_all_rows(rows_out.index_select(0, idx), send_split, recv_split, group)
    rows_in = torch.empty_like(recv_rows)
    rows_in[torch.tensor(arrival, dtype=torch.long, device=rows_out.device)] = recv_rows
    s_new = new.slots_per_rank
    offset = 0
    names = [name for name, _ in layer.experts.named_parameters()]
    for name, p, ks in zip(names, params, keys):
        k = p[0].numel()
        shape = (s_new, *p.shape[1:])
        fresh = [rows_in[:, offset + j * k : offset + (j + 1) * k].reshape(shape).clone() for j in range(1 + len(ks))]
        offset += (1 + len(ks)) * k
        # a new Parameter object: autograd caches a leaf's shape, so resizing ``p.data`` in place
        # would break the next backward; the optimizer is pointed at the new object
        q = nn.Parameter(fresh[0], requires_grad=p.requires_grad)
        q.__dict__.update({a: v for a, v in p.__dict__.items() if a.startswith("moeflow")})
        owner, _, attr = name.rpartition(".")
        setattr(layer.experts.get_submodule(owner), attr, q)
        if optimizer is not None:
            for group_ in optimizer.param_groups:
                group_["params"] = [q if x is p else x for x in group_["params"]]
            if p in optimizer.state:
                state = optimizer.state.pop(p)
                state.update(zip(ks, fresh[1:]))
                optimizer.state[q] = state
    layer.experts.num_experts = s_new
    disp.set_placement(new)


def rebalance(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, slots_per_rank: int | None = None
) -> list[Placement]:
    """Plan a placement per MoE layer from its load statistics (``MoE.load_stats()``, summed over
    the expert-parallel group) and apply it (``apply_placement``). ``slots_per_rank`` defaults to
    the layer's current slots. Returns the placements; call on every rank at a step boundary."""
    plans = []
    for i, layer in enumerate(moe_layers(model)):
        current = placement_of(layer)
        if current is None:
            raise ValueError(f"MoE layer {i} is not expert-parallel (apply moeflow.parallel.expert_parallel first)")
        load_E = layer.load_stats().to(torch.float64)
        all_reduce_sum(load_E, layer.dispatcher.group)
        s = current.slots_per_rank if slots_per_rank is None else slots_per_rank
        plans.append(plan_placement(load_E, world=current.world, slots_per_rank=s))
    apply_placement(model, plans, optimizer)
    return plans
