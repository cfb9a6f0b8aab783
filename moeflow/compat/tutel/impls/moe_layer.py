"""Tutel's ``moe_layer`` as a ``moeflow.MoE`` (legend: moeflow.types; O = expert output dim).

``MOELayer`` *is* a ``moeflow.MoE``: gate 0 is its ``router`` (extra gates live in
``extra_gates``), its experts follow moeflow's experts protocol, and dispatch/combine go
through the layer's one path after routing (``MoE.forward_routed``: the injected dispatcher's
``run``, a ``LocalDispatcher`` or, once ``moeflow.parallel.expert_parallel`` has been applied for
``group=``, an ``ExpertParallelDispatcher``). Only the routing step is Tutel's own: softmax of the (noisy) gate logits, top-k, Tutel's gate normalisation and balance
loss, and Tutel's capacity rule, which is translated into the moeflow capacity factor that
gives the same ``C`` (see ``moeflow_capacity_factor``). Semantic differences from Tutel are
listed in ``moeflow.compat.tutel``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from moeflow.compat.tutel.experts import TutelCustomExperts, TutelFFNExperts
from moeflow.compat.tutel.impls.fast_dispatch import tutel_capacity
from moeflow.compat.tutel.impls.losses import gshard_loss, load_importance_loss
from moeflow.config import DispatchConfig, ExpertsConfig, MoEConfig, RouterConfig
from moeflow.dispatch.capacity import capacity_rows
from moeflow.experts.ffn import graph_zero
from moeflow.layer.moe import MoE
from moeflow.layer.router import Router
from moeflow.parallel.comm import all_gather_rows, process_position
from moeflow.routing import select_experts
from moeflow.types import RoutingResult

__all__ = ["MOELayer", "moe_layer", "TutelGate", "moeflow_capacity_factor"]

_GATE_TYPES = ("top", "cosine_top")
_GATE_KEYS = {
    "top": {"type", "k", "capacity_factor", "gate_noise", "fp32_gate"},
    "cosine_top": {"type", "k", "capacity_factor", "gate_noise", "fp32_gate", "proj_dim", "init_t"},
}
_FFN_KEYS = {"type", "count_per_node", "num_experts_per_device", "hidden_size_per_expert", "output_dim",
             "activation_fn", "has_fc1_bias", "has_fc2_bias"}
SUPPORTED_PARALLEL_TYPES = ("adaptive:1",)


@dataclasses.dataclass(frozen=True)
class TutelGate:
    """One entry of ``gate_type``: its top-k, default capacity factor and noise scale."""

    type: str
    k: int
    capacity_factor: float
    gate_noise: float
    fp32_gate: bool
    router: RouterConfig


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _parse_gate(i: int, spec: object) -> TutelGate:
    where = f"gate_type[{i}]"
    if not isinstance(spec, dict):
        raise TypeError(f"{where} must be a dict like {{'type': 'top', 'k': 2}}, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind not in _GATE_TYPES:
        raise ValueError(f"{where}['type'] must be one of {list(_GATE_TYPES)}, got {kind!r}")
    unknown = sorted(set(spec) - _GATE_KEYS[kind])
    if unknown:
        raise ValueError(f"{where} has unsupported keys {unknown}; allowed: {sorted(_GATE_KEYS[kind])}")
    k = _count(f"{where}['k']", spec.get("k", 1))
    cf = _number(f"{where}['capacity_factor']", spec.get("capacity_factor", 1.0))
    noise = _number(f"{where}['gate_noise']", spec.get("gate_noise", 0.0))
    if noise < 0:
        raise ValueError(f"{where}['gate_noise'] must be >= 0, got {noise}")
    fp32 = spec.get("fp32_gate", False)
    if not isinstance(fp32, bool):
        raise TypeError(f"{where}['fp32_gate'] must be a bool, got {fp32!r}")
    common = dict(load_balance_coef=0.0, dtype=torch.float32 if fp32 else None)
    if kind == "top":
        router = RouterConfig(kind="linear", bias=False, **common)
    else:
        router = RouterConfig(
            kind="cosine", bias=True,
            cosine_proj_dim=_count(f"{where}['proj_dim']", spec.get("proj_dim", 256)),
            cosine_init_temperature=_number(f"{where}['init_t']", spec.get("init_t", 0.5)),
            cosine_min_temperature=0.01, **common,
        )
    return TutelGate(type=kind, k=k, capacity_factor=cf, gate_noise=noise, fp32_gate=fp32, router=router)


def moeflow_capacity_factor(capacity_factor: float, *, num_tokens: int, top_k: int, num_experts: int) -> float:
    """The moeflow capacity factor whose ``C`` equals Tutel's (``tutel_capacity``) for these sizes.

    moeflow: ``C = min(T, ceil(cf * T * K / E))``; Tutel: ``C = K * int(cf * ceil(T / E))``
    (at least 1 here). For cf > 0 this returns ``f ~= C_tutel * E / (T * K)``, nudged down
    until ``capacity_rows(f) == min(T, C_tutel)`` (checked exactly). cf == 0 stays 0 (dropless
    needs no translation: padding to the largest expert, as Tutel does, cannot change results).
    For cf < 0 the cap is translated the same way and returned negated (0 when the cap is >= T).
    """
    if capacity_factor == 0 or num_tokens == 0:
        return 0.0 if capacity_factor == 0 else capacity_factor
    T, K, E = num_tokens, top_k, num_experts
    if capacity_factor > 0:
        target = tutel_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E)
    else:
        target = tutel_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E, max_count=T)
        if target >= T:
            return 0.0
    target = min(target, T)
    f = target * E / (T * K)
    for _ in range(64):
        rows = capacity_rows(f, num_tokens=T, top_k=K, num_experts=E)
        if rows == target:
            return f if capacity_factor > 0 else -f
        f = math.nextafter(f, 0.0) if rows > target else math.nextafter(f, math.inf)
    raise RuntimeError(f"no moeflow capacity factor gives C={target} for T={T}, K={K}, E={E}")


class MOELayer(MoE):
    """Tutel's ``moe_layer`` built on ``moeflow.MoE`` (arguments as in Tutel; see ``moeflow.compat.tutel``).

    Args:
        gate_type: one gate dict (``{'type': 'top' | 'cosine_top', 'k', 'capacity_factor',
            'gate_noise', 'fp32_gate'}`` plus ``'proj_dim'``, ``'init_t'`` for cosine) or a list
            of them (choose per call with ``gate_index``).
        model_dim: ``D``.
        experts: ``{'type': 'ffn', 'count_per_node': e, 'hidden_size_per_expert': H,
            'activation_fn': fn, 'output_dim': O, 'has_fc1_bias', 'has_fc2_bias'}`` or
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
            ``overlap_degree``: an int >= 1; also settable per call).
        parallel_type, use_2dh: only ``'adaptive:1'`` and ``False`` are supported (anything
            else raises ``ValueError``).
        is_postscore: weight expert outputs by the gate (True) or expert inputs (False).
        batch_prioritized_routing, normalize_gate, is_gshard_loss: as in Tutel.
    """

    def __init__(
        self,
        gate_type: dict | Sequence[dict],
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
        if kwargs:
            raise TypeError(f"moe_layer got unsupported arguments {sorted(kwargs)}")
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

        specs = list(gate_type) if isinstance(gate_type, (list, tuple)) else [gate_type]
        if not specs:
            raise ValueError("gate_type must be a gate dict or a non-empty list of them, got []")
        gates = [_parse_gate(i, s) for i, s in enumerate(specs)]
        if not is_gshard_loss:
            for i, g in enumerate(gates):
                if g.gate_noise <= 0:
                    raise ValueError(
                        f"is_gshard_loss=False (load/importance loss) needs gate_type[{i}]['gate_noise'] > 0, got {g.gate_noise}"
                    )

        if not isinstance(experts, dict):
            raise TypeError(f"experts must be a dict like {{'type': 'ffn', 'count_per_node': 2, ...}}, got {type(experts).__name__}")
        experts = dict(experts)
        kind = experts.pop("type", None)
        if kind not in ("ffn", "custom"):
            raise ValueError(f"experts['type'] must be 'ffn' or 'custom', got {kind!r}")
        count = _local_count(experts)
        _, world = process_position(group)
        num_experts = count * world
        for i, g in enumerate(gates):
            if g.k > num_experts:
                raise ValueError(f"gate_type[{i}]['k']={g.k} exceeds the {num_experts} global experts")

        if seeds[1] is not None:
            torch.manual_seed(seeds[1])
        if kind == "ffn":
            unknown = sorted(set(experts) - _FFN_KEYS)
            if unknown:
                raise ValueError(f"experts has unsupported keys {unknown} for type 'ffn'; allowed: {sorted(_FFN_KEYS)}")
            if "hidden_size_per_expert" not in experts:
                raise ValueError("experts['hidden_size_per_expert'] is required for type 'ffn'")
            hidden = _count("experts['hidden_size_per_expert']", experts["hidden_size_per_expert"])
            output_dim = experts.get("output_dim")
            if output_dim is not None:
                output_dim = _count("experts['output_dim']", output_dim)
            # the full set of E experts: expert_parallel slices this rank's block from it
            experts_module: nn.Module = TutelFFNExperts(
                num_experts=num_experts, model_dim=model_dim, hidden_size_per_expert=hidden, output_dim=output_dim,
                activation_fn=experts.get("activation_fn"),
                has_fc1_bias=bool(experts.get("has_fc1_bias", True)), has_fc2_bias=bool(experts.get("has_fc2_bias", True)),
            )
        else:
            hidden = 1
            experts_module = TutelCustomExperts(
                _build_custom(experts, model_dim=model_dim, local_count=count), num_experts=num_experts, local_count=count
            )

        if seeds[0] is not None:
            torch.manual_seed(seeds[0])
        first = gates[0]
        config = MoEConfig(
            dim=model_dim, hidden=hidden, num_experts=num_experts, top_k=first.k,
            capacity_factor=first.capacity_factor, router=first.router,
            dispatch=DispatchConfig(
                drop_policy="bpr" if batch_prioritized_routing else "position",
                weight_at="combine" if is_postscore else "dispatch",
            ),
            experts=ExpertsConfig(activation="relu", bias=True),
        )
        super().__init__(config=config, experts_module=experts_module)
        extra = []
        for i, g in enumerate(gates[1:], start=1):
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
    def gates(self) -> list[Router]:
        """The gates in ``gate_type`` order (gate 0 is ``self.router``)."""
        return [self.router, *self.extra_gates]

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
    ) -> Any:
        """``input [..., D] -> y [..., O]`` (``result_func(y)`` if set); sets ``y.l_aux`` and
        ``self.l_aux`` to the balance loss of this call.

        ``capacity_factor`` and ``top_k`` override the gate's values for this call (0 is a
        value: dropless). ``reserve_dims``: how many trailing dims form one token
        (their product must be ``model_dim``). ``inequivalent_tokens`` needs no action here:
        with ``group=`` the capacity always uses the group's largest token count (Tutel's
        ``inequivalent_tokens=True`` rule) and moeflow's all-to-all handles different token
        counts per rank without padding.
        """
        degree = self.a2a_ffn_overlap_degree if a2a_ffn_overlap_degree is None else _count(
            "a2a_ffn_overlap_degree", a2a_ffn_overlap_degree)
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
            mf_cf = moeflow_capacity_factor(cf, num_tokens=T_cap, top_k=k, num_experts=E)
            y_TO = self.forward_routed(x_TD, routing, capacity_factor=mf_cf, overlap_degree=degree)
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


def _local_count(experts: dict) -> int:
    given = {key: experts[key] for key in ("count_per_node", "num_experts_per_device") if key in experts}
    if not given:
        return 1
    if len(set(map(repr, given.values()))) > 1:
        raise ValueError(f"experts['count_per_node'] and experts['num_experts_per_device'] disagree: {given}")
    key, value = next(iter(given.items()))
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"experts[{key!r}] must be an int, got {value!r}")
    if value < 0:
        raise ValueError(
            f"experts[{key!r}]={value} (one expert sharded over {-value} ranks) is not supported; "
            "only a positive number of experts per rank is"
        )
    if value == 0:
        raise ValueError(f"experts[{key!r}] must be a positive number of experts per rank, got 0")
    return value


def _build_custom(experts: dict, *, model_dim: int, local_count: int) -> nn.Module:
    """Instantiate a Tutel custom expert class (or accept a ready module).

    The class gets the remaining ``experts`` entries plus whichever of Tutel's context
    arguments its signature accepts: ``model_dim``, ``local_experts`` /
    ``num_experts_per_device`` (this rank's expert count), ``sharded_count`` (always 1).
    """
    import inspect

    module = experts.pop("module", None)
    experts.pop("count_per_node", None)
    experts.pop("num_experts_per_device", None)
    if isinstance(module, nn.Module):
        if experts:
            raise ValueError(f"experts has extra keys {sorted(experts)} but 'module' is an already built nn.Module")
        return module
    if not callable(module):
        raise TypeError(f"experts['module'] must be an nn.Module class or instance, got {module!r}")
    context = {"model_dim": model_dim, "local_experts": local_count, "num_experts_per_device": local_count, "sharded_count": 1}
    params = inspect.signature(module).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = dict(experts)
    for name, value in context.items():
        if (name in params or (takes_any and name in ("model_dim", "local_experts", "sharded_count"))) and name not in kwargs:
            kwargs[name] = value
    built = module(**kwargs)
    if not isinstance(built, nn.Module):
        raise TypeError(f"experts['module'](...) must return an nn.Module, got {type(built).__name__}")
    return built


moe_layer = MOELayer
