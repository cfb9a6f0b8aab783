"""Expert- and vocabulary-parallel models with PyTorch's distributed checkpoint (DCP):
``torch.distributed.checkpoint.save``/``async_save``/``load`` on any world size.

``dcp_state_dict(model, optimizer)`` is the state DCP should see: every expert tensor (and the
optimizer state shaped like it) at its global shape ``[E, ...]`` of whole experts, each rank
holding its chunks (``moeflow.parallel.dcp.layout``: any placement, replicas, hidden slices),
every vocabulary-split table at ``[V, D]``. DCP then writes each expert once and loads into any
world size, layout or a single process (without ``init_process_group``). It holds what moeflow's
checkpoints hold: ``{"model": {name: tensor}}`` for every parameter (``named_parameters``: a tied
weight once) and buffer (``named_buffers``); with an optimizer ``{"optim": {"state": {parameter
name: {key: value}}, "param_groups": [{...hyper-parameters, "params": [names]}]}}``; and
``"moeflow"``: a JSON string naming the format, the experts of each stacked expert parameter, the
buffers and the world size (what ``moeflow.checkpoint.dcp`` needs to convert without a model). DCP
joins the nested keys with dots (``model.1.experts.w_in``).

Why not the plain ``model.state_dict()`` with DTensors, as torchtitan does: a DTensor over a
device mesh says "rank ``r`` holds rows ``[r*E/W, (r+1)*E/W)``", but not a load-aware placement
(any expert in any slot, replicas written once), the column blocks of a hidden slice of a gated
expert, or vocabulary parts that differ by one row; ``ChunkedTensor`` (``dcp_tensor``) lists its
chunks instead, and DCP treats it like a DTensor. And ``model.state_dict()`` has to stay the
local tensors for everything that is not DCP.

The tensors are views of the model's and the optimizer's own tensors, so ``dcp.load`` loads in
place; ``load_dcp_state_dict`` then checks that they still are (parameters replaced in between,
e.g. by ``apply_placement``, would not receive the load) and applies the hyper-parameters and
non-tensor state. ``DCPState`` does both for DCP's ``Stateful`` protocol; ``save_dcp`` and
``load_dcp`` are the whole round trip in one call each (the layout ``moeflow convert
--to-dcp``/``--from-dcp`` writes and reads). An optimizer without
state is given its initial state first, so that DCP has tensors to load into: one step with
learning rate 0 on zero gradients (as ``torch.distributed.checkpoint.state_dict`` does; the
parameters and gradients are left as they were).

The plain ``model.state_dict()`` of such a model stays the local tensors, which DCP refuses
with an error pointing here (``moeflow.parallel.dcp.guard``).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from moeflow.experts import GroupedExperts
from moeflow.layer.moe import MoE
from moeflow.parallel.comm import process_position
from moeflow.parallel.dcp.layout import check_expert_layer, expert_view, holds_every_expert, vocab_view
from moeflow.parallel.dcp.tensor import ChunkedTensor

__all__ = ["FORMAT", "DCPState", "dcp_state_dict", "load_dcp_state_dict", "save_dcp", "load_dcp"]

FORMAT = "moeflow-dcp/1"

View = Callable[[torch.Tensor], torch.Tensor]


def _views(model: nn.Module) -> tuple[dict[str, View], dict[str, int]]:
    """``{parameter name: its global view}`` for the parameters whose process holds a part, and
    ``{parameter name: E}`` for every stacked expert parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    views: dict[str, View] = {}
    experts: dict[str, int] = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoE):
            whole = holds_every_expert(module)
            if not whole or not getattr(module.experts, "resident", True):
                check_expert_layer(prefix, module)
            for name, p in module.experts.named_parameters():
                if isinstance(module.experts, GroupedExperts):
                    experts[names[id(p)]] = module.config.num_experts
                if not whole:
                    views[names[id(p)]] = lambda t, m=module, k=name: expert_view(m, k, t)
    for name, p in model.named_parameters():
        if getattr(p, "moeflow_vocab_shard", False) and name not in views:
            start, rows = getattr(p, "moeflow_vocab_start", None), getattr(p, "moeflow_vocab_size", None)
            if not isinstance(start, int) or not isinstance(rows, int):
                raise TypeError(f"parameter {name!r} is tagged a vocabulary shard without moeflow_vocab_start and "
                                "moeflow_vocab_size (moeflow.parallel.vocab.mark_vocab_shard): its place in the whole "
                                "table is unknown")
            views[name] = lambda t, s=start, v=rows: vocab_view(t, s, v)
    return views, experts


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """One step with learning rate 0 on zero gradients, when the optimizer has no state yet (see
    module docstring); gradients and learning rates are restored."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for p, g in zip(params, grads):
            p.grad = g
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr


def _check_types(model: object, optimizer: object, state: object = None) -> None:
    """A ``TypeError`` naming the argument where one is swapped or of the wrong kind (an
    optimizer passed as ``state`` fails here, not as an ``AttributeError`` deep inside)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if state is not None and not isinstance(state, dict):
        raise TypeError(f"state must be the dict from dcp_state_dict(model, optimizer), got {type(state).__name__} "
                        "(the order is load_dcp_state_dict(model, state, optimizer))")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def dcp_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The state of ``model`` (and ``optimizer``) for ``torch.distributed.checkpoint.save``,
    ``async_save`` and ``load``, on every rank (module docstring). No communication."""
    _check_types(model, optimizer)
    views, experts = _views(model)
    state: dict = {"model": {}}
    for name, p in model.named_parameters():
        t = p.detach()
        state["model"][name] = views[name](t) if name in views else t
    for name, b in model.named_buffers():
        state["model"][name] = b.detach()
    meta = {"format": FORMAT, "experts": experts, "buffers": [name for name, _ in model.named_buffers()],
            "world_size": process_position()[1]}
    state["moeflow"] = json.dumps(meta, sort_keys=True)
    if optimizer is None:
        return state
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [i for i, g in enumerate(optimizer.param_groups) if any(id(p) not in names for p in g["params"])]
    if missing:
        raise ValueError(f"optimizer param groups {missing} hold parameters that are not in the model")
    _init_optimizer_state(optimizer)
    per_param: dict[str, dict] = {}
    for p, entries in optimizer.state.items():
        name, view = names[id(p)], views.get(names[id(p)])
        per_param[name] = {}
        for key, value in entries.items():  # state shaped like a sharded parameter is sharded like it
            sharded = view is not None and isinstance(value, torch.Tensor) and value.shape == p.shape
            per_param[name][key] = view(value.detach()) if sharded else value
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    state["optim"] = {"state": per_param, "param_groups": groups}
    return state


def _storage(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor  # here, not at the top: its import costs ~1 s at every start

    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()  # FSDP2's dense DTensors


def _same_memory(entry: torch.Tensor, target: torch.Tensor, what: str) -> None:
    """``entry`` (a state-dict tensor, or each chunk of a ``ChunkedTensor``) must view ``target``."""
    parts = [t for _, t, _ in entry.chunks()] if isinstance(entry, ChunkedTensor) else [entry]
    if any(_storage(t) != _storage(target) for t in parts):
        raise ValueError(f"{what} of the state dict no longer views the tensor it was taken from (it was replaced, "
                         "e.g. by apply_placement, after dcp_state_dict): take dcp_state_dict again and load into that")


def load_dcp_state_dict(model: nn.Module, state: dict, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Finish loading ``state`` (``dcp_state_dict(model, optimizer)`` after ``dcp.load``): check
    the format and that the tensors were loaded in place, apply the optimizer's hyper-parameters
    and non-tensor state."""
    _check_types(model, optimizer, {} if state is None else state)
    meta = json.loads(state["moeflow"]) if isinstance(state.get("moeflow"), str) else None
    if meta is None or meta.get("format") != FORMAT:
        raise ValueError(f"state['moeflow'] is not a {FORMAT} description (got {state.get('moeflow')!r}): load "
                         "dcp_state_dict(model, optimizer) from a checkpoint written from one")
    _, experts = _views(model)
    if meta["experts"] != experts:
        raise ValueError(f"the checkpoint's experts per parameter {meta['experts']} differ from the model's {experts}")
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, entry in state["model"].items():
        if name not in targets:
            raise ValueError(f"state['model'] has {name!r}, which the model does not")
        _same_memory(entry, targets[name], f"state['model'][{name!r}]")
    if optimizer is None:
        return
    if "optim" not in state:
        raise ValueError("state has no 'optim' entry: take it with dcp_state_dict(model, optimizer)")
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    groups = state["optim"]["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer has {len(optimizer.param_groups)} param groups, the checkpoint {len(groups)}")
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, groups)):
        if [names.get(id(p)) for p in group["params"]] != list(saved["params"]):
            raise ValueError(f"optimizer param group {i} holds other parameters than the checkpoint's: "
                             f"{[names.get(id(p)) for p in group['params']]} != {list(saved['params'])}")
        # (a checkpoint converted from moeflow's JSON index holds lists where the optimizer has tuples)
        group.update({k: tuple(v) if isinstance(v, list) and isinstance(group.get(k), tuple) else v
                      for k, v in saved.items() if k != "params"})
    for name, entries in state["optim"]["state"].items():
        current = optimizer.state[params[name]]
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                _same_memory(value, current[key], f"state['optim']['state'][{name!r}][{key!r}]")
            else:
                current[key] = value


class DCPState:
    """``model`` (and ``optimizer``) as a DCP ``Stateful``: ``dcp.save({"train": DCPState(model,
    opt)}, ...)`` saves ``dcp_state_dict``, ``dcp.load`` with it loads and calls
    ``load_dcp_state_dict``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return dcp_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        load_dcp_state_dict(self.model, state, self.optimizer)


def save_dcp(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``model`` (and ``optimizer``) as a DCP checkpoint directory at ``path``:
    ``torch.distributed.checkpoint.save(dcp_state_dict(model, optimizer))``. Every rank of the
    job calls it (each writes its own chunks; under NCCL the tensors stay on the GPU until DCP
    stages them); one process without ``init_process_group`` saves alone. ``load_dcp`` loads it
    on any world size and layout, and ``moeflow convert --from-dcp`` turns it into a moeflow
    checkpoint."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.save(dcp_state_dict(model, optimizer), checkpoint_id=os.fspath(path))


def load_dcp(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load the DCP checkpoint at ``path`` (``save_dcp``'s, or ``moeflow convert --to-dcp``'s)
    into ``model`` (and ``optimizer``) in place, whatever world size and expert layout wrote it:
    ``dcp.load`` into ``dcp_state_dict(model, optimizer)``, then ``load_dcp_state_dict``. Every
    rank of the job calls it."""
    import torch.distributed.checkpoint as dcp

    state = dcp_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=os.fspath(path))
    load_dcp_state_dict(model, state, optimizer)


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes a single process whenever it runs without a process group; in
    ``save_dcp``/``load_dcp`` without one that is what the caller asked for."""
    with warnings.catch_warnings():
        if process_position()[1] == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield

