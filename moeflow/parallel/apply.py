"""Apply expert parallelism to a model from outside: ``expert_parallel`` gives every MoE layer
its shard of the experts and an ``ExpertParallelDispatcher``; the tuner's choices are recorded
and locked per layer. Gradient helpers for the sharded experts are in
``moeflow.parallel.gradients``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moeflow.config import ParallelConfig
from moeflow.experts import GroupedExperts, ModuleExperts
from moeflow.experts.ffn import join_hidden_slices
from moeflow.layer.moe import MoE, moe_layers
from moeflow.parallel.comm import all_to_all_rows, gather_objects
from moeflow.parallel.dcp.guard import mark_rank_local
from moeflow.parallel.dispatcher import ExpertParallelDispatcher
from moeflow.parallel.exchange.alltoall import Hierarchy

__all__ = ["expert_parallel", "gather_hidden_experts", "gather_layer_objects", "tuned_settings", "fix_tuned_settings"]


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
    model: nn.Module, group: dist.ProcessGroup | None = None, *, config: ParallelConfig | None = None,
    hierarchy: Hierarchy | None = None, hidden_shards: int = 1,
) -> nn.Module:
    """Spread the experts of every ``moeflow.MoE`` layer of ``model`` over ``group``.

    Each rank keeps experts ``[r*E/W, (r+1)*E/W)`` (sliced from the full set it holds now, so
    build the model with the same seed or load the same weights on every rank first) and gets
    an ``ExpertParallelDispatcher`` (two-level exchange when ``hierarchy`` is given, see
    ``make_groups``). ``config`` (``ParallelConfig``) sets how calls run: the parallel mode,
    pipelining and the auto-tuner (default: each layer's deprecated ``DispatchConfig`` fields
    where set, else ``ParallelConfig()``); every call may override ``parallel`` and
    ``overlap_degree``. Call it on every rank of the group; configuration errors
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
    if config is not None and not isinstance(config, ParallelConfig):
        raise TypeError(f"config must be a moeflow.ParallelConfig, got {type(config).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
    W = dist.get_world_size(group)
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"model contains no moeflow.MoE layer: {type(model).__name__}")
    # one collective that every rank reaches before anything can fail (host-side control data:
    # gather_objects carries it over any backend, NCCL included)
    # per layer: experts configured, experts held, whether a collective dispatcher is already in place
    mine = [len(layers)] + [
        v
        for layer in layers
        for v in (layer.config.num_experts, int(layer.experts.num_experts), int(layer.dispatcher.collective))
    ]
    every: list[list[int]] = gather_objects(mine, group)  # type: ignore[assignment]
    if any(other != mine for other in every):
        raise ValueError(
            "MoE layers differ between ranks of the expert-parallel group (layer count and experts per layer): "
            + "; ".join(f"rank {i}: {t}" for i, t in enumerate(every))
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
        settings = config if config is not None else layer.config.dispatch.parallel_defaults()
        layer.dispatcher = ExpertParallelDispatcher(
            num_experts=E, group=group, config=layer.config.dispatch, parallel=settings, hierarchy=hierarchy,
            hidden_shards=hidden_shards,
        )
        # model.state_dict() keeps the local experts, which torch.distributed.checkpoint refuses
        layer.register_state_dict_post_hook(mark_rank_local)
    return model


def gather_hidden_experts(layer: MoE, name: str, slots_t: torch.Tensor) -> dict[int, torch.Tensor]:
    """Whole experts from the hidden slices of a hidden-sharded layer (``expert_parallel(...,
    hidden_shards=n)``): ``slots_t`` is this rank's ``[slots, ...]`` tensor of parameter ``name``
    (``"w_in"`` or ``"w_out"``) or of optimizer state shaped like it. Every rank of the group
    calls it, in the same order; each slice goes to the rank holding slice 0 of its expert (one
    all-to-all), which gets ``{expert: whole tensor}`` for those experts (the others ``{}``).
    Checkpoints save hidden-sharded layers through it."""
    with torch.no_grad():
        n, _ = layer.hidden_shards()
        disp = layer.dispatcher
        if n == 1 or not isinstance(disp, ExpertParallelDispatcher):
            raise ValueError("gather_hidden_experts needs a layer whose experts are split by hidden units "
                             "(hidden_shards > 1)")
        E, W, r, e = layer.config.num_experts, disp.world, disp.rank, disp.placement.slots_per_rank
        writer = lambda x: x // e  # noqa: E731  (the rank holding slot x = slice 0 of expert x)
        mine = [r * e + i for i in range(e)]
        order = sorted(range(e), key=lambda i: writer(mine[i] % E))  # by destination, stable
        send_split = [sum(1 for v in mine if writer(v % E) == d) for d in range(W)]
        arrivals = [v for s in range(W) for v in range(s * e, (s + 1) * e) if writer(v % E) == r]
        recv_split = [sum(1 for v in range(s * e, (s + 1) * e) if writer(v % E) == r) for s in range(W)]
        index = torch.tensor(order, dtype=torch.long, device=slots_t.device)
        recv = all_to_all_rows(slots_t.reshape(e, -1).index_select(0, index), send_split, recv_split, disp.group)
        by_expert: dict[int, dict[int, torch.Tensor]] = {}
        for row, v in zip(recv, arrivals):
            by_expert.setdefault(v % E, {})[v // E] = row.view(slots_t.shape[1:])
        halves = layer.experts.halves
        return {x: join_hidden_slices(name, [got[j] for j in range(n)], halves) for x, got in sorted(by_expert.items())}


def gather_layer_objects(layer: MoE, obj: object) -> list[object]:
    """Every rank's ``obj`` over ``layer``'s expert-parallel group (``[obj]`` without one):
    checkpoints use it to make sure the ranks agree before a collective per tensor."""
    disp = layer.dispatcher
    return gather_objects(obj, disp.group) if isinstance(disp, ExpertParallelDispatcher) else [obj]


def tuned_settings(model: nn.Module) -> list[list[dict]]:
    """The auto-tuner's locked choices of every ``moeflow.MoE`` layer of ``model`` (in
    ``moe_layers`` order; ``[]`` for a layer without a tuner or choices yet), JSON-able: give them
    to ``fix_tuned_settings`` in a later run to repeat the same settings (``ParallelTuner.fix``)."""
    return [layer.dispatcher.tuner.settings() if isinstance(layer.dispatcher, ExpertParallelDispatcher) else []
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
        if not isinstance(layer.dispatcher, ExpertParallelDispatcher):
            if records:
                raise ValueError(f"MoE layer {i} has no expert-parallel dispatcher (apply expert_parallel first); "
                                 f"got {len(records)} tuned settings for it")
            continue
        layer.dispatcher.tuner.fix(records)
