"""Tutel's argument dicts, checked and translated into moeflow's terms.

``moe_layer`` takes Tutel's loosely typed arguments: ``gate_type`` dicts, an ``experts`` dict
(``'ffn'`` or ``'custom'``) and capacity factors under Tutel's capacity rule. This module is
the one place that reads them: each entry is checked (a bad key or value raises naming
``gate_type[i]['key']`` or ``experts['key']`` and the value) and turned into what
``moeflow.MoE`` takes: a ``TutelGate`` with its ``RouterConfig``, an experts module, and a
moeflow capacity factor giving Tutel's ``C`` (``moeflow_capacity_factor``). The layer itself
(``moeflow.compat.tutel.impls.moe_layer``) only assembles and runs them.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

from moeflow.compat.tutel.experts import TutelCustomExperts, TutelFFNExperts
from moeflow.compat.tutel.impls.fast_dispatch import tutel_capacity
from moeflow.config import RouterConfig
from moeflow.dispatch.capacity import capacity_rows

__all__ = ["TutelGate", "moeflow_capacity_factor", "SUPPORTED_PARALLEL_TYPES"]

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

    ``'ffn'`` builds the full set of ``num_experts`` global experts (``expert_parallel`` slices
    this rank's block from it); ``'custom'`` wraps this rank's ``local_count`` experts.
    """
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
        ffn = TutelFFNExperts(
            num_experts=num_experts, model_dim=model_dim, hidden_size_per_expert=hidden, output_dim=output_dim,
            activation_fn=experts.get("activation_fn"),
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
    arguments its signature accepts: ``model_dim``, ``local_experts`` /
    ``num_experts_per_device`` (this rank's expert count), ``sharded_count`` (always 1).
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
