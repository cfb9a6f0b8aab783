"""Tutel's argument dicts, checked and translated into moeflow's terms.

``moe_layer`` takes Tutel's loosely typed arguments: ``gate_type`` dicts (or ``'Top<k>Gate'``,
or custom gate modules), an ``experts`` dict (``'ffn'``, ``'llama_ffn'`` or ``'custom'``) and
capacity factors under Tutel's capacity rule. This module is the one place that reads them:
each entry is checked (a bad key or value raises naming ``gate_type[i]['key']`` or
``experts['key']`` and the value) and turned into what ``moeflow.MoE`` takes: a ``TutelGate``
with its ``RouterConfig`` (or its built custom module), an experts module, and a moeflow
capacity factor giving Tutel's ``C`` (``moeflow_capacity_factor``, with Tutel's alignment,
``tutel_alignment``). The layer itself
(``moeflow.compat.tutel.impls.moe_layer``) only assembles and runs them.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re

import torch
from torch import nn

from moeflow.compat.tutel.experts import TutelCustomExperts, TutelFFNExperts, TutelLlamaExperts
from moeflow.compat.tutel.impls.fast_dispatch import tutel_capacity
from moeflow.config import RouterConfig
from moeflow.dispatch.capacity import capacity_rows

__all__ = ["TutelGate", "gate_specs", "build_custom_gate", "moeflow_capacity_factor", "tutel_alignment",
           "SUPPORTED_PARALLEL_TYPES"]

_GATE_TYPES = ("top", "cosine_top")
_GATE_KEYS = {
    "top": {"type", "k", "capacity_factor", "gate_noise", "fp32_gate"},
    "cosine_top": {"type", "k", "capacity_factor", "gate_noise", "fp32_gate", "proj_dim", "init_t"},
}
_FFN_KEYS = {"type", "count_per_node", "num_experts_per_device", "hidden_size_per_expert", "output_dim",
             "activation_fn", "activation_fn_with_self", "has_fc1_bias", "has_fc2_bias"}
_LLAMA_KEYS = {"type", "count_per_node", "num_experts_per_device", "hidden_size_per_expert", "activation_fn"}
EXPERT_TYPES = ("ffn", "llama_ffn", "custom")
SUPPORTED_PARALLEL_TYPES = ("adaptive:1",)


@dataclasses.dataclass(frozen=True)
class TutelGate:
    """One entry of ``gate_type``: its top-k, default capacity factor and noise scale."""

    type: str
    k: int
    capacity_factor: float
    gate_noise: float
    fp32_gate: bool
    router: RouterConfig | None  # None for a custom gate (``module`` computes the logits)
    module: object = None
    options: dict = dataclasses.field(default_factory=dict)


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def gate_specs(gate_type: object) -> list[dict]:
    """``gate_type`` as a list of gate dicts (copies). Accepts one dict, a list of them, or
    Tutel's older string form ``'Top<k>Gate'`` (``'Top2Gate'`` is ``{'type': 'top', 'k': 2}``)."""
    if isinstance(gate_type, str):
        match = re.fullmatch(r"Top([0-9]+)Gate", gate_type)
        if match is None:
            raise ValueError(f"gate_type={gate_type!r}: a string gate_type must be 'Top<k>Gate' (e.g. 'Top2Gate')")
        return [{"type": "top", "k": int(match.group(1))}]
    specs = list(gate_type) if isinstance(gate_type, (list, tuple)) else [gate_type]
    if not specs:
        raise ValueError("gate_type must be a gate dict or a non-empty list of them, got []")
    return [dict(s) if isinstance(s, dict) else s for s in specs]  # type: ignore[misc]


def _parse_gate(i: int, spec: object) -> TutelGate:
    where = f"gate_type[{i}]"
    if not isinstance(spec, dict):
        raise TypeError(f"{where} must be a dict like {{'type': 'top', 'k': 2}}, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "custom":
        return _custom_gate_spec(where, spec)
    if kind not in _GATE_TYPES:
        raise ValueError(f"{where}['type'] must be one of {list(_GATE_TYPES) + ['custom']}, got {kind!r}")
    unknown = sorted(set(spec) - _GATE_KEYS[kind])
    if unknown:
        raise ValueError(f"{where} has unsupported keys {unknown}; allowed: {sorted(_GATE_KEYS[kind])}")
    k = _count(f"{where}['k']", spec.get("k", 1))
    cf = _number(f"{where}['capacity_factor']", spec.get("capacity_factor", 1.0))
    noise = _gate_noise(where, spec.get("gate_noise", 0.0))
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


def _gate_noise(where: str, value: object) -> float:
    noise = _number(f"{where}['gate_noise']", value)
    if noise < 0:
        raise ValueError(f"{where}['gate_noise'] must be >= 0, got {noise}")
    return noise


def _custom_gate_spec(where: str, spec: dict) -> TutelGate:
    """A ``{'type': 'custom', 'module': cls, ...}`` entry, before its module is built: its
    ``k``, capacity factor and noise come from the built module (``build_custom_gate``)."""
    module = spec.get("module")
    if not (isinstance(module, nn.Module) or callable(module)):
        raise TypeError(f"{where}['module'] must be an nn.Module class (or a callable building one), got {module!r}")
    options = {key: value for key, value in spec.items() if key not in ("type", "module")}
    return TutelGate(type="custom", k=0, capacity_factor=1.0, gate_noise=0.0, fp32_gate=False, router=None,
                     module=module, options=options)


def build_custom_gate(i: int, gate: TutelGate, *, model_dim: int, num_experts: int) -> tuple[nn.Module, TutelGate]:
    """Build a custom gate as Tutel does and read its settings back.

    The class is called as ``cls(model_dim=D, num_global_experts=E, **other_entries)`` and must
    return an ``nn.Module`` mapping ``x [T, D]`` to logits ``[T, E]`` with an int attribute
    ``top_k``; ``capacity_factor`` and ``gate_noise`` are read from the module when it has
    them, else from the entry (defaults 1.0 and 0.0), as in Tutel.
    """
    where = f"gate_type[{i}]"
    built = gate.module if isinstance(gate.module, nn.Module) else gate.module(
        model_dim=model_dim, num_global_experts=num_experts, **gate.options)
    if not isinstance(built, nn.Module):
        raise TypeError(f"{where}['module'](...) must return an nn.Module, got {type(built).__name__}")
    k = getattr(built, "top_k", None)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"{where}: the custom gate's top_k must be an int in [1, {num_experts}], got {k!r}")
    cf = _number(f"{where}['capacity_factor']", getattr(built, "capacity_factor", gate.options.get("capacity_factor", 1.0)))
    noise = _gate_noise(where, getattr(built, "gate_noise", gate.options.get("gate_noise", 0.0)))
    return built, dataclasses.replace(gate, k=k, capacity_factor=cf, gate_noise=noise)


def moeflow_capacity_factor(
    capacity_factor: float, *, num_tokens: int, top_k: int, num_experts: int, alignment: int = 1
) -> float:
    """The moeflow capacity factor whose ``C`` equals Tutel's (``tutel_capacity``) for these sizes.

    ``alignment``: Tutel rounds ``C`` up to a multiple of it (the layer passes
    ``a2a_ffn_overlap_degree``, and ``megablocks_size`` when that is active).

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
        target = tutel_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E, alignment=alignment)
    else:
        # Tutel: roundup(min(max_count, cap)); as a moeflow cap, roundup(min(T, cap)) drops the same
        target = tutel_capacity(capacity_factor, num_tokens=T, top_k=K, num_experts=E, max_count=T, alignment=alignment)
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


def tutel_alignment(slots_multiple: int, megablocks_size: int = 0) -> int:
    """What Tutel rounds the capacity up to a multiple of: ``sharded_count *
    a2a_ffn_overlap_degree``, itself rounded up to a multiple of ``megablocks_size`` when that
    is active; above 256, to a multiple of 128."""
    block = max(megablocks_size, 1)
    alignment = (slots_multiple + block - 1) // block * block
    return (alignment + 127) // 128 * 128 if alignment > 256 else alignment


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



def _build_experts(kind: str, experts: dict, *, model_dim: int, num_experts: int, local_count: int) -> tuple[nn.Module, int]:
    """The experts module for Tutel's ``experts`` dict (its ``'type'`` already taken out as
    ``kind``) and the ``hidden`` size for ``MoEConfig`` (1 for custom experts, which own theirs).

    ``'ffn'`` and ``'llama_ffn'`` (SwiGLU, on moeflow's ``GroupedExperts``) build the full set of ``num_experts`` global experts (``expert_parallel`` slices
    this rank's block from it); ``'custom'`` wraps this rank's ``local_count`` experts.
    """
    if kind in ("ffn", "llama_ffn"):
        allowed = _FFN_KEYS if kind == "ffn" else _LLAMA_KEYS
        unknown = sorted(set(experts) - allowed)
        if unknown:
            raise ValueError(f"experts has unsupported keys {unknown} for type {kind!r}; allowed: {sorted(allowed)}")
        if "hidden_size_per_expert" not in experts:
            raise ValueError(f"experts['hidden_size_per_expert'] is required for type {kind!r}")
        hidden = _count("experts['hidden_size_per_expert']", experts["hidden_size_per_expert"])
        activation = experts.get("activation_fn")
        if activation is not None and not callable(activation):
            raise TypeError(f"experts['activation_fn'] must be callable, got {type(activation).__name__}")
        if kind == "llama_ffn":
            return TutelLlamaExperts(num_experts=num_experts, model_dim=model_dim, hidden_size_per_expert=hidden,
                                     activation_fn=activation), hidden
        with_self = experts.get("activation_fn_with_self")
        if with_self is not None:
            if activation is not None:
                raise ValueError("experts['activation_fn'] and experts['activation_fn_with_self'] are both set; keep exactly one")
            if not callable(with_self):
                raise TypeError(f"experts['activation_fn_with_self'] must be callable, got {type(with_self).__name__}")
        output_dim = experts.get("output_dim")
        if output_dim is not None:
            output_dim = _count("experts['output_dim']", output_dim)
        ffn = TutelFFNExperts(
            num_experts=num_experts, model_dim=model_dim, hidden_size_per_expert=hidden, output_dim=output_dim,
            activation_fn=activation, activation_fn_with_self=with_self,
            has_fc1_bias=bool(experts.get("has_fc1_bias", True)), has_fc2_bias=bool(experts.get("has_fc2_bias", True)),
        )
        return ffn, hidden
    custom = TutelCustomExperts(
        _build_custom(experts, model_dim=model_dim, local_count=local_count), num_experts=num_experts, local_count=local_count
    )
    return custom, 1


def _build_custom(experts: dict, *, model_dim: int, local_count: int) -> nn.Module:
    """Instantiate a Tutel custom expert class (or accept a ready module).

    The class gets the remaining ``experts`` entries plus whichever of Tutel's context
    arguments its signature accepts (all of them for ``**kwargs``): ``model_dim``,
    ``num_experts_per_device`` (this rank's expert count; ``local_experts`` for a class that
    takes only that older name), ``sharded_count`` (always 1).
    """
    module = experts.pop("module", None)
    experts.pop("count_per_node", None)
    experts.pop("num_experts_per_device", None)
    if isinstance(module, nn.Module):
        if experts:
            raise ValueError(f"experts has extra keys {sorted(experts)} but 'module' is an already built nn.Module")
        return module
    if not callable(module):
        raise TypeError(f"experts['module'] must be an nn.Module class or instance, got {module!r}")
    params = inspect.signature(module).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    # Tutel passes num_experts_per_device (its current name), or local_experts to older classes
    count_name = "local_experts" if "local_experts" in params and "num_experts_per_device" not in params else "num_experts_per_device"
    context = {"model_dim": model_dim, count_name: local_count, "sharded_count": 1}
    kwargs = dict(experts)
    for name, value in context.items():
        if (name in params or takes_any) and name not in kwargs:
            kwargs[name] = value
    built = module(**kwargs)
    if not isinstance(built, nn.Module):
        raise TypeError(f"experts['module'](...) must return an nn.Module, got {type(built).__name__}")
    return built
