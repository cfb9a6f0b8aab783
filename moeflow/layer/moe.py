"""The MoE layer: router, then one ``dispatcher.run`` (dispatch, experts, combine), plus shared
experts.

Legend: moeflow.types. The dispatcher is injected (a ``LocalDispatcher`` by default), so
parallelism is applied from outside by swapping it (``moeflow.parallel.expert_parallel``), never
by a branch in here: the layer reads only what the ``Dispatcher`` protocol declares.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn

from moeflow.config import MoEConfig, check_capacity_factor, check_overlap_degree, check_parallel_mode, check_top_k
from moeflow.dispatch import Dispatcher, LocalDispatcher
from moeflow.dispatch.protocol import check_dispatcher
from moeflow.experts import DenseFFN, GroupedExperts
from moeflow.experts.ffn import graph_zero
from moeflow.layer.tape import TapeBinding
from moeflow.layer.router import Router
from moeflow.types import RoutingResult

__all__ = ["MoE", "aux_loss", "update_expert_bias", "moe_layers"]


class MoE(nn.Module):
    """A mixture-of-experts FFN block: ``y = layer(x)``, ``x [..., D] -> y [..., D]``, same dtype.

    Construct from keyword arguments (the fields of ``MoEConfig``) or a ready ``MoEConfig``::

        layer = MoE(dim=512, hidden=1024, num_experts=8, top_k=2, capacity_factor=1.0)
        layer = MoE(config=MoEConfig(dim=512, hidden=1024, num_experts=8,
                                     router=RouterConfig(scoring="sigmoid", normalize_topk=True)))

    ``experts_module`` replaces the built-in FFN experts with any module following the experts
    protocol (see ``moeflow.experts``), e.g. ``ModuleExperts([...])``; ``dispatcher`` replaces the
    local dispatcher (expert parallelism does this from outside). ``expert_recompute=True``
    (shorthand for ``ExpertsConfig(recompute=True)``) makes the experts keep only their input
    rows for backward and recompute the hidden activation there: same gradients, less memory.

    Per call, ``capacity_factor`` and ``top_k`` override the configured values (0 is a value:
    ``capacity_factor=0`` means dropless); ``overlap_degree`` and ``parallel`` override the
    expert-parallel dispatcher's ``ParallelConfig`` (a single process has nothing to choose). After each call, ``layer.aux_losses`` holds the
    balance losses of that call (each already multiplied by its coefficient) and
    ``layer.last_counts_E`` the assignments per expert before drops. ``losses=False`` skips the
    balance losses of a call whose losses nobody reads (generation's decode steps):
    ``layer.aux_losses`` is then empty and ``aux_loss()`` reads 0.
    """

    def __init__(
        self,
        *,
        config: MoEConfig | None = None,
        experts_module: nn.Module | None = None,
        dispatcher: Dispatcher | None = None,
        expert_recompute: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **fields: object,
    ) -> None:
        super().__init__()
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        if device is not None:
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must name a torch device (e.g. 'cpu', 'cuda:0'), got {device!r}") from None
        if config is None:
            config = MoEConfig(**fields)  # type: ignore[arg-type]
        elif fields:
            config = dataclasses.replace(config, **fields)  # type: ignore[arg-type]
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
        if expert_recompute is not None:
            if not isinstance(expert_recompute, bool):
                raise TypeError(f"expert_recompute must be a bool or None, got {expert_recompute!r}")
            if experts_module is not None:
                raise ValueError("expert_recompute applies to the built-in experts; set it on experts_module instead")
            chunks = config.experts.recompute_chunks if expert_recompute else None  # (applies with recompute only)
            config = dataclasses.replace(config, experts=dataclasses.replace(config.experts, recompute=expert_recompute,
                                                                             recompute_chunks=chunks))
        self.config = config
        kw = {"device": device, "dtype": dtype}
        self.router = Router(dim=config.dim, num_experts=config.num_experts, config=config.router, **kw)
        experts = experts_module
        if experts is None:
            experts = GroupedExperts(
                num_experts=config.num_experts, dim=config.dim, hidden=config.hidden, config=config.experts, **kw
            )
        elif not isinstance(experts, nn.Module) or not isinstance(getattr(experts, "num_experts", None), int):
            raise TypeError(
                f"experts_module must be an nn.Module with an int num_experts, got {type(experts).__name__}"
            )
        elif experts.num_experts != config.num_experts:
            raise ValueError(
                f"experts_module holds {experts.num_experts} experts but num_experts={config.num_experts}"
            )
        self.experts = experts
        self.dispatcher: Dispatcher = (
            LocalDispatcher(num_experts=config.num_experts, config=config.dispatch) if dispatcher is None
            else check_dispatcher(dispatcher)
        )
        if config.num_shared_experts:
            self.shared = DenseFFN(
                dim=config.dim,
                hidden=config.shared_width,
                activation=config.experts.activation,
                bias=config.experts.bias,
                gate=config.shared_gate,
                init_std=config.experts.init_std,
                **kw,
            )
        else:
            self.shared = None
        self.aux_losses: dict[str, torch.Tensor] | None = None
        self.last_counts_E: torch.Tensor | None = None
        # set while moeflow.record_routing / replay_routing is active
        self._routing_tape: TapeBinding | None = None
        self._load_window: collections.deque = collections.deque(maxlen=max(1, config.load_window))

    def extra_repr(self) -> str:
        c = self.config
        return f"dim={c.dim}, hidden={c.hidden}, num_experts={c.num_experts}, top_k={c.top_k}, capacity_factor={c.capacity_factor}"

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
        if x.dim() < 1 or x.shape[-1] != self.config.dim:
            raise ValueError(f"x must have last dimension dim={self.config.dim}, got shape {tuple(x.shape)}")
        param = next(self.experts.parameters(), None)
        if param is not None and param.device != x.device:
            raise ValueError(f"x is on {x.device} but the layer parameters are on {param.device}; move one of them "
                             "(e.g. x.to(device) or layer.to(device))")
        if param is not None and param.dtype != x.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"x has dtype {x.dtype} but the layer parameters are {param.dtype}; cast one of them "
                "(e.g. layer.to(x.dtype)) or run under torch.autocast"
            )
        if self.config.check_finite and not bool(torch.isfinite(x).all()):
            raise ValueError("x contains non-finite values (NaN or Inf); check_finite=True")

    def forward(
        self,
        x: torch.Tensor,
        *,
        capacity_factor: float | None = None,
        top_k: int | None = None,
        overlap_degree: int | str | None = None,
        parallel: str | None = None,
        losses: bool = True,
    ) -> torch.Tensor:
        self._check_input(x)
        cfg = self.config
        cf = cfg.capacity_factor if capacity_factor is None else check_capacity_factor(capacity_factor)
        k = cfg.top_k if top_k is None else check_top_k(top_k, cfg.num_experts)
        if top_k is not None:
            cfg.router.validate_for(num_experts=cfg.num_experts, top_k=k)
        if overlap_degree is not None:
            check_overlap_degree(overlap_degree)
        if parallel is not None:
            check_parallel_mode(parallel)
        if not isinstance(losses, bool):
            raise TypeError(f"losses must be a bool, got {type(losses).__name__} {losses!r}")

        x_TD = x.reshape(-1, cfg.dim)
        if x_TD.shape[0] == 0 and not self.dispatcher.collective:
            # empty output and zero losses, connected to the parameters so backward() works
            zero = graph_zero(self, x)
            self.aux_losses = {name: zero for name, coef in self.router._loss_coefs() if coef > 0 and losses}
            self.last_counts_E = torch.zeros(cfg.num_experts, dtype=torch.long, device=x.device)
            return torch.zeros_like(x) + zero

        tape = self._routing_tape
        routing = self.router(x_TD, top_k=k, forced_ids_TK=None if tape is None else tape.forced_ids(), losses=losses)
        if tape is not None:
            tape.chosen(routing.ids_TK)
        y_TD = self.forward_routed(x_TD, routing, capacity_factor=cf, overlap_degree=overlap_degree, parallel=parallel)
        return y_TD.view(x.shape)

    def forward_routed(
        self,
        x_TD: torch.Tensor,
        routing: RoutingResult,
        *,
        capacity_factor: float,
        overlap_degree: int | str | None = None,
        parallel: str | None = None,
    ) -> torch.Tensor:
        """The step after routing, shared by every entry point (``forward``, and layers that
        route their own way, such as ``moeflow.compat.tutel``): one ``dispatcher.run``, the
        shared experts, and the call's statistics (``aux_losses``, ``last_counts_E``, the load
        window). ``x_TD [T, D] -> y_TD [T, D]`` (the experts' output width if it differs)."""
        y_TD = self.dispatcher.run(x_TD, routing, self.experts, capacity_factor=capacity_factor,
                                   overlap_degree=overlap_degree, parallel=parallel)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        self.aux_losses = routing.aux_losses
        self.last_counts_E = routing.counts_E
        if self.config.load_window and self.training:
            self._load_window.append(routing.counts_E)
        return y_TD

    def __getstate__(self) -> dict:
        # the last call's losses hold autograd graphs, which cannot be copied or pickled;
        # a copy of the layer starts without them (like a freshly built layer)
        state = dict(super().__getstate__())
        state["aux_losses"] = None
        state["last_counts_E"] = None
        state["_routing_tape"] = None
        state["_load_window"] = collections.deque(maxlen=self._load_window.maxlen)
        return state

    def load_stats(self) -> torch.Tensor:
        """Assignments per expert (int64 ``[E]``, before drops) summed over the last
        ``config.load_window`` training calls of this process. Under data or expert parallelism
        each rank counts its own tokens: sum over the group for the global load."""
        if not self.config.load_window:
            raise RuntimeError("load_stats() needs MoEConfig(load_window > 0)")
        ref = self.router.load_counts
        if not self._load_window:
            return torch.zeros_like(ref)
        return torch.stack(list(self._load_window)).sum(0)

    def expert_range(self) -> tuple[int, int]:
        """``(first global expert index, count)`` of the experts whose weights live here.

        Raises ``ValueError`` when they are not one contiguous block of whole experts (a
        load-aware placement, ``moeflow.parallel.placement.plan``, or hidden-sharded experts):
        restore ``Placement.contiguous`` first, or read ``expert_slots``."""
        offset = self.dispatcher.layout.offset
        if offset is None:
            raise ValueError("this layer's experts follow a non-contiguous placement; apply "
                             "Placement.contiguous(E, W) with moeflow.parallel.apply_placement first")
        return offset, int(self.experts.num_experts)

    def expert_slots(self) -> tuple[list[int], list[bool]]:
        """The global expert of each expert slot held here, and whether the slot is the copy a
        checkpoint saves (its expert's first replica; with hidden-sharded experts, see
        ``hidden_shards()``, the slot holding slice 0, saved after the slices are joined).
        Without expert parallelism: every expert, every slot saved."""
        layout = self.dispatcher.layout
        return list(layout.slot_experts), list(layout.slot_primary)

    def hidden_shards(self) -> tuple[int, list[int]]:
        """``(n, parts)``: every expert's hidden units are split into ``n`` slices over the ranks
        (``expert_parallel(..., hidden_shards=n)``) and slot ``i`` here holds slice ``parts[i]``;
        ``(1, [0, ...])`` for whole experts."""
        layout = self.dispatcher.layout
        return layout.hidden_shards, list(layout.slot_parts)

    def aux_loss(self) -> torch.Tensor:
        """Sum of this layer's balance losses from its last call (a scalar with gradient)."""
        if self.aux_losses is None:
            raise RuntimeError("aux_loss() was read before the layer was called; run a forward pass first")
        ref = next(self.router.parameters())
        total = torch.zeros((), device=ref.device, dtype=torch.promote_types(ref.dtype, torch.float32))
        for value in self.aux_losses.values():
            total = total + value
        return total


def moe_layers(model: nn.Module) -> list[MoE]:
    """Every ``MoE`` layer inside ``model`` (including ``model`` itself)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the balance losses of every MoE layer in ``model`` from their last forward call.

    Add it to the task loss of the *same* forward pass before ``backward()``. With gradient
    accumulation, read it after each micro-batch's forward and scale it like that micro-batch's
    loss (``(task + aux) / n_micro``): each layer keeps only its last call, so reading once
    after several forwards would count just the last micro-batch.
    """
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"model contains no moeflow.MoE layer: {type(model).__name__}")
    total = layers[0].aux_loss()
    for layer in layers[1:]:
        total = total + layer.aux_loss().to(total.device)
    return total


def update_expert_bias(model: nn.Module) -> None:
    """Run the aux-loss-free bias update on every MoE layer that has it enabled.

    Call once per optimizer step (after all micro-batches); see ``Router.update_bias``.
    """
    for layer in moe_layers(model):
        if layer.router.config.bias_update_rate > 0:
            layer.router.update_bias()
