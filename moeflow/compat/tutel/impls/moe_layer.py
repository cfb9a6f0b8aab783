"""Tutel's ``moe_layer`` as a ``moeflow.MoE`` (legend: moeflow.types; O = expert output dim).

``MOELayer`` *is* a ``moeflow.MoE``: gate 0 is its ``router`` (extra gates live in
``extra_gates``), its experts follow moeflow's experts protocol, and dispatch/combine go
through the layer's one path after routing (``MoE.forward_routed``: the injected dispatcher's
``run``, a ``LocalDispatcher`` or, once ``moeflow.parallel.expert_parallel`` has been applied for
``group=``, an ``ExpertParallelDispatcher``). Only the routing step is Tutel's own: softmax of
the (noisy) gate logits, top-k, Tutel's gate normalisation and balance loss, and Tutel's
capacity rule, which is translated into the moeflow capacity factor that gives the same ``C``
(see ``moeflow_capacity_factor``). Semantic differences from Tutel are listed in
``moeflow.compat.tutel``.

Tutel's argument dicts (``gate_type``, ``experts``) are checked and translated in
``moeflow.compat.tutel.impls.arguments``; this module holds the layer that assembles and runs
what they become.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moeflow.compat.tutel.experts import TutelCustomExperts
from moeflow.compat.tutel.gates import TutelCustomGate
from moeflow.compat.tutel.impls.arguments import (  # noqa: F401  (all re-exported: they were defined here)
    _FFN_KEYS,
    _GATE_KEYS,
    _GATE_TYPES,
    EXPERT_TYPES,
    SUPPORTED_PARALLEL_TYPES,
    TutelGate,
    _build_custom,
    build_custom_gate,
    gate_specs,
    tutel_alignment,
    _build_experts,
    _count,
    _local_count,
    _number,
    _parse_gate,
    moeflow_capacity_factor,
)
from moeflow.compat.tutel.impls.losses import gshard_loss, load_importance_loss
from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig
from moeflow.experts.ffn import graph_zero
from moeflow.layer.moe import MoE
from moeflow.layer.router import Router
from moeflow.parallel.comm import all_gather_rows, process_position
from moeflow.routing import select_experts
from moeflow.types import RoutingResult

__all__ = ["MOELayer", "moe_layer", "TutelGate", "moeflow_capacity_factor"]

_log = logging.getLogger(__name__)


class MOELayer(MoE):
    """Tutel's ``moe_layer`` built on ``moeflow.MoE`` (arguments as in Tutel; see ``moeflow.compat.tutel``).

    Args:
        gate_type: one gate dict (``{'type': 'top' | 'cosine_top', 'k', 'capacity_factor',
            'gate_noise', 'fp32_gate'}`` plus ``'proj_dim'``, ``'init_t'`` for cosine;
            ``{'type': 'custom', 'module': cls, ...}`` for a user gate, see
            ``arguments.build_custom_gate``), Tutel's string form ``'Top<k>Gate'``, or a list of
            gate dicts (choose per call with ``gate_index``).
        model_dim: ``D``.
        experts: ``{'type': 'ffn', 'count_per_node': e, 'hidden_size_per_expert': H,
            'activation_fn': fn (or 'activation_fn_with_self': fn(h, experts)), 'output_dim': O,
            'has_fc1_bias', 'has_fc2_bias'}``, ``{'type': 'llama_ffn', 'count_per_node': e,
            'hidden_size_per_expert': H, 'activation_fn': fn}`` (SwiGLU) or
            ``{'type': 'custom', 'module': cls_or_instance, 'count_per_node': e, ...}``
            (``num_experts_per_device`` is accepted as an alias of ``count_per_node``).
        scan_expert_func: called as ``fn(name, param)`` for every expert parameter at the end
            of construction (after expert parallelism sliced the experts).
        result_func: applied to the output before it is returned.
        group: expert-parallel process group (None: the default group when torch.distributed
            is initialised, as in Tutel). With ``W > 1`` ranks, ``E = count_per_node * W``.
        seeds: ``(gate_seed, experts_seed, seed_after)``; each non-None entry seeds torch's RNG
            before building the gates (gate i uses ``gate_seed + i``), before building the
            experts, and at the end.
        a2a_ffn_overlap_degree: pipelining of the expert-parallel exchange (moeflow's
            ``overlap_degree``: an int >= 1). As in Tutel, it also rounds the capacity ``C`` up
            to a multiple of it (even on one process), and a value given per call is kept.
        parallel_type, use_2dh: only ``'adaptive:1'`` and ``False`` are supported (anything
            else raises ``ValueError``).
        is_postscore: weight expert outputs by the gate (True) or expert inputs (False).
        batch_prioritized_routing, normalize_gate, is_gshard_loss: as in Tutel.
        pad_samples: accepted and ignored, as in Tutel; any other keyword raises ``TypeError``.

    Tutel's attributes are kept for code that reads them: ``num_global_experts``,
    ``num_local_experts``, ``sharded_count`` (1), ``adaptive_degree`` (1), ``l_aux``,
    ``dispatch_count`` (int64 ``[E]`` of the last call), ``megablocks_size``, and the methods
    ``global_expert_count``, ``get_parameter_iterator`` and ``expert_local``.
    """

    def __init__(
        self,
        gate_type: dict | str | Sequence[dict],
        model_dim: int,
        experts: dict | None = None,
        scan_expert_func: Callable[[str, nn.Parameter], Any] | None = None,
        result_func: Callable[[torch.Tensor], Any] | None = None,
        group: object | None = None,
        seeds: Sequence[int | None] | None = None,
        a2a_ffn_overlap_degree: int = 1,
        is_postscore: bool = True,
        batch_prioritized_routing: bool = False,
        normalize_gate: bool = True,
        is_gshard_loss: bool = True,
        parallel_type: str = "adaptive:1",
        use_2dh: bool = False,
        **kwargs: object,
    ) -> None:
        if "pad_samples" in kwargs:  # Tutel accepts it and ignores it (always unpadded)
            kwargs.pop("pad_samples")
            _log.warning("moe_layer: `pad_samples` is deprecated in Tutel and ignored (samples are never padded)")
        for name in kwargs:  # Tutel raises for any other unknown keyword too
            raise TypeError(f"moe_layer got an unexpected keyword argument {name!r}")
        model_dim = _count("model_dim", model_dim)
        _count("a2a_ffn_overlap_degree", a2a_ffn_overlap_degree)
        if parallel_type not in SUPPORTED_PARALLEL_TYPES:
            raise ValueError(
                f"parallel_type={parallel_type!r} is not supported yet; only {list(SUPPORTED_PARALLEL_TYPES)} "
                "(expert parallelism) is. moeflow's data, sharded and hybrid modes run on a moeflow.MoE: "
                "moeflow.parallel.expert_parallel(model, config=moeflow.ParallelConfig(parallel=...))"
            )
        if use_2dh is not False:
            raise ValueError(
                f"use_2dh={use_2dh!r} is not supported by moeflow.compat.tutel; only False is. For the two-level "
                "exchange build a moeflow.MoE and call moeflow.parallel.expert_parallel(model, group, "
                "hierarchy=make_groups(..., node_size=L).hierarchy)"
            )
        for name, flag in (("is_postscore", is_postscore), ("batch_prioritized_routing", batch_prioritized_routing),
                           ("normalize_gate", normalize_gate), ("is_gshard_loss", is_gshard_loss)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        for name, fn in (("scan_expert_func", scan_expert_func), ("result_func", result_func)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
        if seeds is not None and (not isinstance(seeds, (tuple, list)) or len(seeds) > 3):
            raise ValueError(f"seeds must be a tuple of up to 3 ints (or None entries), got {seeds!r}")
        seeds = tuple(seeds or ()) + (None,) * (3 - len(seeds or ()))

        gates = [_parse_gate(i, s) for i, s in enumerate(gate_specs(gate_type))]

        if not isinstance(experts, dict):
            raise TypeError(f"experts must be a dict like {{'type': 'ffn', 'count_per_node': 2, ...}}, got {type(experts).__name__}")
        experts = dict(experts)
        kind = experts.pop("type", None)
        if kind not in EXPERT_TYPES:
            raise ValueError(f"experts['type'] must be one of {list(EXPERT_TYPES)}, got {kind!r}")
        count = _local_count(experts)
        _, world = process_position(group)
        num_experts = count * world
        for i, g in enumerate(gates):
            if g.k > num_experts:
                raise ValueError(f"gate_type[{i}]['k']={g.k} exceeds the {num_experts} global experts")

        if seeds[1] is not None:
            torch.manual_seed(seeds[1])
        experts_module, hidden = _build_experts(kind, experts, model_dim=model_dim, num_experts=num_experts,
                                                local_count=count)

        custom_gates = {}
        for i, g in enumerate(gates):  # Tutel builds each gate after seeding with seeds[0] + i
            if g.type == "custom":
                if seeds[0] is not None:
                    torch.manual_seed(seeds[0] + i)
                custom_gates[i], gates[i] = build_custom_gate(i, g, model_dim=model_dim, num_experts=num_experts)
        if not is_gshard_loss:
            for i, g in enumerate(gates):
                if g.gate_noise <= 0:
                    raise ValueError(
                        f"is_gshard_loss=False (load/importance loss) needs gate_type[{i}]['gate_noise'] > 0, got {g.gate_noise}"
                    )

        if seeds[0] is not None:
            torch.manual_seed(seeds[0])
        first = gates[0]
        config = MoEConfig(
            dim=model_dim, hidden=hidden, num_experts=num_experts, top_k=first.k,
            capacity_factor=first.capacity_factor,
            router=first.router if first.router is not None else RouterConfig(kind="linear", bias=False, load_balance_coef=0.0),
            dispatch=DispatchConfig(
                drop_policy="bpr" if batch_prioritized_routing else "position",
                weight_at="combine" if is_postscore else "dispatch",
            ),
            experts=ExpertsConfig(activation="relu", bias=True),
        )
        super().__init__(config=config, experts_module=experts_module)
        if 0 in custom_gates:  # the placeholder router MoE built gives way to the user's gate
            self.router = TutelCustomGate(custom_gates[0], num_experts=num_experts)
        extra: list[nn.Module] = []
        for i, g in enumerate(gates[1:], start=1):
            if i in custom_gates:
                extra.append(TutelCustomGate(custom_gates[i], num_experts=num_experts))
                continue
            if seeds[0] is not None:
                torch.manual_seed(seeds[0] + i)
            extra.append(Router(dim=model_dim, num_experts=num_experts, config=g.router))
        self.extra_gates = nn.ModuleList(extra)
        self.gate_specs: tuple[TutelGate, ...] = tuple(gates)

        self.model_dim = model_dim
        self.num_global_experts = num_experts
        self.world_size = world
        self.group = group
        self.is_postscore = is_postscore
        self.batch_prioritized_routing = batch_prioritized_routing
        self.normalize_gate = normalize_gate
        self.is_gshard_loss = is_gshard_loss
        self.a2a_ffn_overlap_degree = a2a_ffn_overlap_degree
        self.result_func = result_func
        self.l_aux: torch.Tensor | None = None
        # Tutel's attributes that user code and custom experts read: one process per expert
        # shard (sharded experts are not supported) and expert parallelism ('adaptive:1')
        self.sharded_count = 1
        self.adaptive_degree = 1
        self.megablocks_size = 0
        self.dispatch_count: torch.Tensor | None = None

        if world > 1:
            from moeflow.parallel import expert_parallel  # the layer is built; now spread its experts

            expert_parallel(self, group)
        if isinstance(self.experts, TutelCustomExperts):
            object.__setattr__(self.experts, "_ctx", self)
        self.num_local_experts = int(self.experts.num_experts)
        if scan_expert_func is not None:
            for name, param in self.experts.tutel_named_parameters():
                scan_expert_func(name, param)
        if seeds[2] is not None:
            torch.manual_seed(seeds[2])

    @property
    def gates(self) -> list[nn.Module]:
        """The gates in ``gate_type`` order (gate 0 is ``self.router``): moeflow ``Router``s, or
        ``TutelCustomGate`` for custom gates."""
        return [self.router, *self.extra_gates]

    @staticmethod
    def global_expert_count(num_local_experts: int, group: object | None = None) -> int:
        """Tutel's global expert count for ``num_local_experts`` per process over ``group``:
        ``e * W`` for ``e > 0``; for ``e = -s`` (one expert sharded over ``s`` processes, which
        ``moe_layer`` does not support) ``W / s``."""
        if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts == 0:
            raise ValueError(f"num_local_experts must be a non-zero int, got {num_local_experts!r}")
        _, world = process_position(group)
        if num_local_experts > 0:
            return num_local_experts * world
        if world % -num_local_experts:
            raise ValueError(f"num_local_experts={num_local_experts}: {world} processes cannot share experts {-num_local_experts} ways")
        return world // -num_local_experts

    def get_parameter_iterator(self, param_type: str):  # type: ignore[no-untyped-def]
        """``named_parameters()`` of the gates (``'gate'``) or of this process's experts
        (``'local_experts'``), as in Tutel."""
        if param_type == "gate":
            return nn.ModuleList(self.gates).named_parameters()
        if param_type == "local_experts":
            return self.experts.named_parameters()
        raise ValueError(f"param_type must be 'gate' or 'local_experts', got {param_type!r}")

    def expert_local(self, x: torch.Tensor, reserve_shape: Sequence[int]) -> torch.Tensor:
        """This process's experts on expert rows ``x [e, N, prod(reserve_shape)]`` ->
        ``[e, N, O]`` (Tutel's hook between the exchanges; custom expert modules see
        ``x.view(e, N, *reserve_shape)`` and the layer, as in Tutel)."""
        e, N = x.shape[0], x.shape[1]
        if isinstance(self.experts, TutelCustomExperts):
            y = self.experts.module(x.reshape(e, N, *reserve_shape), self)
        else:
            counts_e = torch.full((e,), N, dtype=torch.long, device=x.device)
            y = self.experts(x.reshape(e, N, -1), counts_e)
        return y.reshape(e, N, -1)

    @property
    def top_k(self) -> int:
        return self.gate_specs[0].k

    def extra_repr(self) -> str:
        return (
            f"model_dim={self.model_dim}, num_global_experts={self.num_global_experts}, "
            f"gates={[(g.type, g.k, g.capacity_factor) for g in self.gate_specs]}, is_postscore={self.is_postscore}, "
            f"batch_prioritized_routing={self.batch_prioritized_routing}, normalize_gate={self.normalize_gate}"
        )

    def forward(  # type: ignore[override]
        self,
        input: torch.Tensor,
        gate_index: int = 0,
        capacity_factor: float | None = None,
        top_k: int | None = None,
        a2a_ffn_overlap_degree: int | None = None,
        reserve_dims: int = 1,
        inequivalent_tokens: bool = False,
        adaptive_r: int | None = None,
        megablocks_size: int = 0,
    ) -> Any:
        """``input [..., D] -> y [..., O]`` (``result_func(y)`` if set); sets ``y.l_aux`` and
        ``self.l_aux`` to the balance loss of this call.

        ``capacity_factor`` and ``top_k`` override the gate's values for this call (0 is a
        value: dropless). ``reserve_dims``: how many trailing dims form one token
        (their product must be ``model_dim``). ``inequivalent_tokens`` needs no action here:
        with ``group=`` the capacity always uses the group's largest token count (Tutel's
        ``inequivalent_tokens=True`` rule) and moeflow's all-to-all handles different token
        counts per rank without padding.

        As in Tutel, a given ``a2a_ffn_overlap_degree`` is kept for later calls, and Tutel's
        capacity ``C`` (cf != 0) is rounded up to a multiple of it, even on one process.
        ``megablocks_size`` (Tutel's block-sparse inference) is honoured only where Tutel
        honours it (more than one local expert, no autograd, one process): there ``C`` is
        rounded up to a multiple of it; the result is the same as without it.
        """
        degree = self.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else _count(
            "a2a_ffn_overlap_degree", a2a_ffn_overlap_degree)
        if isinstance(megablocks_size, bool) or not isinstance(megablocks_size, int) or megablocks_size < 0:
            raise ValueError(f"megablocks_size must be an int >= 0, got {megablocks_size!r}")
        if self.num_local_experts <= 1 or torch.is_grad_enabled() or self.world_size > 1:
            megablocks_size = 0
        if adaptive_r not in (None, 1):
            raise ValueError(f"adaptive_r={adaptive_r!r} is not supported yet; only 1 (expert parallel) or None is")
        if not isinstance(input, torch.Tensor) or not input.is_floating_point():
            raise TypeError(f"input must be a floating-point torch.Tensor, got {getattr(input, 'dtype', type(input).__name__)}")
        if isinstance(reserve_dims, bool) or not isinstance(reserve_dims, int) or not 1 <= reserve_dims < input.dim():
            raise ValueError(f"reserve_dims must be an int in [1, input.dim() - 1 = {input.dim() - 1}], got {reserve_dims!r}")
        if isinstance(gate_index, bool) or not isinstance(gate_index, int) or not 0 <= gate_index < len(self.gate_specs):
            raise ValueError(f"gate_index must be an int in [0, {len(self.gate_specs)}), got {gate_index!r}")
        spec = self.gate_specs[gate_index]
        E = self.num_global_experts
        k = spec.k if top_k is None else top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
            raise ValueError(f"top_k must be an int in [1, {E}], got {top_k!r}")
        cf = spec.capacity_factor if capacity_factor is None else _number("capacity_factor", capacity_factor)

        self.a2a_ffn_overlap_degree, self.megablocks_size = degree, megablocks_size  # kept, as in Tutel
        shape, dtype = input.shape, input.dtype
        token_dim = math.prod(shape[-reserve_dims:])
        if token_dim != self.model_dim:
            raise ValueError(f"the last {reserve_dims} dims of input {tuple(shape)} hold {token_dim} values, expected model_dim={self.model_dim}")
        x_TD = input.reshape(-1, token_dim)
        param = next(self.experts.parameters(), None)
        if param is not None and not torch.is_autocast_enabled(x_TD.device.type):
            x_TD = x_TD.to(param.dtype)  # Tutel computes in the experts' dtype
        T = x_TD.shape[0]

        gate = self.gates[gate_index]
        logits_TE = gate.logits(x_TD)
        noisy_TE = logits_TE
        if self.training and spec.gate_noise > 0:
            noisy_TE = logits_TE + torch.randn_like(logits_TE) * (spec.gate_noise / E)
        raw_TK, ids_TK, scores_TE = select_experts(noisy_TE, top_k=k, scoring="softmax")
        gates_TK = raw_TK
        if k > 1 and self.normalize_gate:
            gates_TK = raw_TK / raw_TK.sum(dim=1, keepdim=True).clamp(min=torch.finfo(raw_TK.dtype).eps)
        if self.is_gshard_loss:
            l_aux = gshard_loss(scores_TE, ids_TK) if T else scores_TE.sum() * 0
        else:
            l_aux = load_importance_loss(torch.softmax(logits_TE, dim=1), noisy_TE.gather(1, ids_TK), E, spec.gate_noise)

        if T == 0 and not self.dispatcher.collective:
            O = getattr(self.experts, "output_dim", self.model_dim)
            y_TO = x_TD.new_zeros(0, O) + graph_zero(self, x_TD)
            self.dispatch_count = torch.zeros(E, dtype=torch.long, device=x_TD.device)
        else:
            # batch-prioritized routing orders tokens by Tutel's *raw* top score, while the
            # (normalised) gates weight the outputs: the raw scores are the routing's priority
            routing = RoutingResult(weights_TK=gates_TK, ids_TK=ids_TK, logits_TE=noisy_TE, scores_TE=scores_TE,
                                    aux_losses={"tutel_l_aux": l_aux}, priority_TK=raw_TK)
            T_cap = T
            if self.world_size > 1:
                # every rank must pass the same capacity factor to the collective dispatcher:
                # translate Tutel's C from the group's largest token count (one tiny all-gather)
                sizes = all_gather_rows(torch.tensor([[T]], dtype=torch.long, device=x_TD.device), self.group)
                T_cap = max(int(s.sum()) for s in sizes)
            mf_cf = moeflow_capacity_factor(cf, num_tokens=T_cap, top_k=k, num_experts=E,
                                            alignment=tutel_alignment(self.sharded_count * degree, megablocks_size))
            y_TO = self.forward_routed(x_TD, routing, capacity_factor=mf_cf, overlap_degree=degree)
            self.dispatch_count = self.last_counts_E
        O = y_TO.shape[-1]
        out_shape = tuple(shape) if O == self.model_dim else (*shape[:-reserve_dims], O)
        y = y_TO.reshape(out_shape).to(dtype)
        y.l_aux = l_aux  # type: ignore[attr-defined]
        self.l_aux = l_aux
        self.aux_losses = {"tutel_l_aux": l_aux}  # (also when no token came: no routed call then)
        return self.result_func(y) if self.result_func is not None else y

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["l_aux"] = None
        return state


moe_layer = MOELayer
