"""Apply expert parallelism to a model from outside, and keep gradients right."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.experts import GroupedExperts, ModuleExperts
from moeflow.experts.ffn import join_hidden_slices
from moeflow.layer.moe import MoE, moe_layers
from moeflow.parallel.dispatcher import AllToAllDispatcher
from moeflow.parallel.exchange import Hierarchy
from moeflow.parallel.groups import ParallelGroups

__all__ = [
    "expert_parallel",
    "expert_parameters",
    "vocab_parameters",
    "dense_parameters",
    "ddp_ignore_expert_parameters",
    "fsdp_ignored_parameters",
    "sync_load_counts",
    "all_reduce_gradients",
    "clip_grad_norm_",
    "reduce_expert_gradients",
    "gather_hidden_experts",
    "tuned_settings",
    "fix_tuned_settings",
]


def _shard_experts(experts: nn.Module, start: int, count: int) -> nn.Module:
    if callable(getattr(experts, "shard", None)):
        return experts.shard(start, count)
    if isinstance(experts, GroupedExperts):
        return experts.shard(start, count)
    if isinstance(experts, ModuleExperts):
        return ModuleExperts(list(experts.experts)[start : start + count])
    raise TypeError(
        f"expert_parallel can shard GroupedExperts and ModuleExperts, got {type(experts).__name__}; "
        "give your experts module a shard(start, count) method returning the sub-module"
    )


def expert_parallel(
    model: nn.Module, group: dist.ProcessGroup | None = None, *, hierarchy: Hierarchy | None = None,
    hidden_shards: int = 1,
) -> nn.Module:
    """Spread the experts of every ``moeflow.MoE`` layer of ``model`` over ``group``.

    Each rank keeps experts ``[r*E/W, (r+1)*E/W)`` (sliced from the full set it holds now, so
    build the model with the same seed or load the same weights on every rank first) and gets
    an ``AllToAllDispatcher`` (two-level exchange when ``hierarchy`` is given, see
    ``make_groups``). Call it on every rank of the group; configuration errors
    (E not divisible by W, expert counts that differ between ranks, a group without this rank)
    raise ``ValueError`` on every rank instead of hanging. Returns ``model`` (changed in place).

    ``hidden_shards=n`` also splits every expert's hidden units into ``n`` slices (Tutel's
    ``adaptive_r``; ``GroupedExperts`` without biases): the ``E*n`` slices are spread like
    experts, slice-major (slice ``j`` of every expert on ranks ``[j*W/n, (j+1)*W/n)`` when ``n``
    divides ``W``), so each expert is computed by ``n`` ranks; each kept row goes to all ``n``
    slices of its expert and their outputs add up. This serves ``E < W`` (e.g. 2 experts on 4
    ranks with ``n = 2``) and splits every expert's work over ``n`` ranks; ``E*n`` must be
    divisible by ``W``.
    """
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
    W = dist.get_world_size(group)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"model contains no moeflow.MoE layer: {type(model).__name__}")
    # one collective that every rank reaches before anything can fail
    # per layer: experts configured, experts held, whether a collective dispatcher is already in place
    mine = torch.tensor(
        [len(layers)]
        + [
            v
            for layer in layers
            for v in (layer.config.num_experts, int(layer.experts.num_experts), int(getattr(layer.dispatcher, "collective", False)))
        ],
        dtype=torch.long,
    )
    width = torch.tensor([mine.numel()], dtype=torch.long)
    widths = [torch.empty_like(width) for _ in range(W)]
    dist.all_gather(widths, width, group=group)
    padded = torch.full((int(max(widths)),), -1, dtype=torch.long)
    padded[: mine.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(W)]
    dist.all_gather(every, padded, group=group)
    if any(not torch.equal(other, padded) for other in every):
        raise ValueError(
            "MoE layers differ between ranks of the expert-parallel group (layer count and experts per layer): "
            + "; ".join(f"rank {i}: {t[t >= 0].tolist()}" for i, t in enumerate(every))
        )
    for i, layer in enumerate(layers):
        E = layer.config.num_experts
        if any(t[3 + 3 * i] == 1 or t[2 + 3 * i] != t[1 + 3 * i] for t in every):
            raise ValueError(f"expert_parallel was already applied to MoE layer {i} on some rank (it holds a shard)")
        if (E * hidden_shards) % W:
            hint = f" (or split the hidden units: hidden_shards={W // E})" if hidden_shards == 1 and W % E == 0 else ""
            raise ValueError(f"num_experts={E} x hidden_shards={hidden_shards} must be divisible by the "
                             f"expert-parallel group size {W}{hint}")
        if hidden_shards > 1 and (not isinstance(layer.experts, GroupedExperts) or layer.experts.config.bias
                                  or layer.experts.hidden % hidden_shards):
            raise ValueError(f"hidden_shards={hidden_shards} needs GroupedExperts without biases whose hidden size "
                             f"is divisible by it (MoE layer {i})")
    for layer in layers:
        E = layer.config.num_experts
        e = E * hidden_shards // W
        experts = layer.experts.hidden_slices(hidden_shards) if hidden_shards > 1 else layer.experts
        layer.experts = _shard_experts(experts, rank * e, e)
        layer.dispatcher = AllToAllDispatcher(
            num_experts=E, group=group, config=layer.config.dispatch, hierarchy=hierarchy, hidden_shards=hidden_shards
        )
    return model


@torch.no_grad()
def gather_hidden_experts(layer: MoE, name: str, t_vX: torch.Tensor) -> dict[int, torch.Tensor]:
    """Whole experts from the hidden slices of a hidden-sharded layer (``expert_parallel(...,
    hidden_shards=n)``): ``t_vX`` is this rank's ``[slots, ...]`` tensor of parameter ``name``
    (``"w_in"`` or ``"w_out"``) or of optimizer state shaped like it. Every rank of the group
    calls it, in the same order; each slice goes to the rank holding slice 0 of its expert (one
    all-to-all), which gets ``{expert: whole tensor}`` for those experts (the others ``{}``).
    Checkpoints save hidden-sharded layers through it."""
    from moeflow.parallel.comm import all_to_all_rows

    n, parts = layer.hidden_shards()
    if n == 1:
        raise ValueError("gather_hidden_experts needs a layer whose experts are split by hidden units (hidden_shards > 1)")
    disp = layer.dispatcher
    E, W, r, e = layer.config.num_experts, disp.world, disp.rank, disp.num_local_experts
    writer = lambda x: x // e  # noqa: E731  (the rank holding slot x = slice 0 of expert x)
    mine = [r * e + i for i in range(e)]
    order = sorted(range(e), key=lambda i: writer(mine[i] % E))  # by destination, stable
    send_split = [sum(1 for v in mine if writer(v % E) == d) for d in range(W)]
    arrivals = [v for s in range(W) for v in range(s * e, (s + 1) * e) if writer(v % E) == r]
    recv_split = [sum(1 for v in range(s * e, (s + 1) * e) if writer(v % E) == r) for s in range(W)]
    index = torch.tensor(order, dtype=torch.long, device=t_vX.device)
    recv = all_to_all_rows(t_vX.reshape(e, -1).index_select(0, index), send_split, recv_split, disp.group)
    by_expert: dict[int, dict[int, torch.Tensor]] = {}
    for row, v in zip(recv, arrivals):
        by_expert.setdefault(v % E, {})[v // E] = row.view(t_vX.shape[1:])
    halves = layer.experts.halves
    return {x: join_hidden_slices(name, [got[j] for j in range(n)], halves) for x, got in sorted(by_expert.items())}


def tuned_settings(model: nn.Module) -> list[list[dict]]:
    """The auto-tuner's locked choices of every ``moeflow.MoE`` layer of ``model`` (in
    ``moe_layers`` order; ``[]`` for a layer without a tuner or choices yet), JSON-able: give them
    to ``fix_tuned_settings`` in a later run to repeat the same settings (``ParallelTuner.fix``)."""
    return [layer.dispatcher.tuner.settings() if isinstance(layer.dispatcher, AllToAllDispatcher) else []
            for layer in moe_layers(model)]


def fix_tuned_settings(model: nn.Module, settings: list[list[dict]]) -> None:
    """Lock the choices ``tuned_settings`` recorded, layer by layer: calls with those shapes run
    the recorded setting without timing. Raises ``ValueError`` when the layer count differs or a
    layer without an expert-parallel dispatcher is given choices."""
    layers = moe_layers(model)
    if not isinstance(settings, list) or len(settings) != len(layers):
        raise ValueError(f"settings must be a list with one entry per MoE layer ({len(layers)}), got "
                         f"{len(settings) if isinstance(settings, list) else type(settings).__name__}")
    for i, (layer, records) in enumerate(zip(layers, settings)):
        if not isinstance(records, list):
            raise ValueError(f"settings[{i}] must be a list of records, got {type(records).__name__}")
        if not isinstance(layer.dispatcher, AllToAllDispatcher):
            if records:
                raise ValueError(f"MoE layer {i} has no expert-parallel dispatcher (apply expert_parallel first); "
                                 f"got {len(records)} tuned settings for it")
            continue
        layer.dispatcher.tuner.fix(records)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of routed experts (tagged ``moeflow_expert``): sharded, never averaged over
    the expert-parallel group."""
    return [p for p in model.parameters() if getattr(p, "moeflow_expert", False)]


def vocab_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Vocabulary shards (``moeflow.parallel.vocab_parallel``, tagged ``moeflow_vocab_shard``):
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
        dist.all_reduce(layer.router.load_counts, group=group)


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
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Clip the gradients of ``model`` to a global 2-norm of ``max_norm``; returns the norm
    before clipping. With replicated experts, call ``sync_replica_gradients`` first.

    Under expert parallelism the expert gradients are sharded over ``group`` while the dense
    ones are replicated (already reduced), so the global norm is
    ``sqrt(|dense|^2 + sum over ranks of |local experts|^2)``: the same number, and the same
    clipping, as one process holding everything. Without torch.distributed (or ``group`` of
    one rank) it is ``torch.nn.utils.clip_grad_norm_``.
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}")
    grads_dense = [p.grad for p in dense_parameters(model) if p.grad is not None]
    grads_expert = [p.grad for p in expert_parameters(model) + vocab_parameters(model) if p.grad is not None]
    ref = next(model.parameters())
    sq_expert = torch.zeros((), dtype=torch.float64, device=ref.device)
    # a replicated expert (load-aware placement) counts once: weight each slot by 1/replicas
    slot_weight = {}
    for layer in moe_layers(model):
        placement = getattr(layer.dispatcher, "placement", None)
        if placement is not None and max(placement.num_replicas) > 1:
            w = torch.tensor([1.0 / placement.num_replicas[x] for x in placement.slots[layer.dispatcher.rank]],
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
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(sq_expert, group=group)
    sq = sq_expert + sum((g.double().square().sum() for g in grads_dense), torch.zeros_like(sq_expert))
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads_dense + grads_expert:
        g.mul_(scale.to(g.dtype))
    return norm
