"""Hugging Face transformers 5.x MoE blocks on moeflow's kernels (legend: moeflow.types).

Two ways in, same numerics as transformers' eager experts (up to summation order):

1. **Experts implementation.** Importing this module registers ``"moeflow"`` in
   ``transformers.integrations.moe.ExpertsInterface``; any model whose experts class uses
   ``@use_experts_implementation`` then selects it like the built-in ones::

       model.set_experts_implementation("moeflow")
       model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moeflow")

   The experts' ``forward(hidden [T, D], top_k_index [T, K], top_k_weights [T, K])`` becomes
   moeflow's dropless index dispatch (``LocalDispatcher``: one stable sort by expert, row gathers
   whose backward is a gather too), one grouped GEMM per projection (``grouped_ffn`` over
   ``moeflow.kernels.grouped_mm``; ``F.grouped_mm`` where the probe allows it, the per-expert
   loop otherwise, e.g. fp64) and the combine gather + weighted sum.

2. **Block patch.** ``patch(model)`` replaces every MoE block of a supported family by a
   moeflow-backed block: the HF router module runs unchanged (so ``output_router_logits=True``
   and the HF auxiliary loss keep working), then the experts run as in 1, then the shared
   experts exactly as the HF block adds them. It does not depend on
   ``config._experts_implementation``.

Either way the HF parameter tensors are used in place, through views: ``gate_up_proj
[E, 2H, D]`` and ``down_proj [E, D, H]`` are read as ``[E, D, 2H]`` / ``[E, H, D]`` transposes
(GPT-OSS stores them transposed already), so nothing is copied and state dicts are untouched.
The gate activation is the experts module's own (``_apply_gate``: ``act(gate) * up`` for most
families, GPT-OSS's clamped interleaved SwiGLU), so every family's activation is exact.

Not supported (raises): expert-parallel HF experts (``_is_expert_parallel``), input and weight
dtypes that differ outside autocast.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

try:
    from transformers.integrations.moe import ExpertsInterface
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "moeflow.integrations.hf needs transformers>=5 (transformers.integrations.moe.ExpertsInterface); "
        "install moeflow's 'hf' extra"
    ) from exc

from moeflow.dispatch import LocalDispatcher
from moeflow.experts.ffn import autocast_cast, graph_zero, grouped_ffn
from moeflow.types import RoutingResult

__all__ = ["EXPERTS_IMPLEMENTATION", "FAMILIES", "BlockSpec", "experts_forward", "register", "patch", "is_patched"]

EXPERTS_IMPLEMENTATION = "moeflow"


# --------------------------------------------------------------------------- experts


def _expert_weights(
    experts: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(w_in [E, D, F], w_out [E, H, D], b_in [E, F] | None, b_out [E, D] | None)`` as views
    of the HF parameters (``F = 2H`` with a gate)."""
    for attr in ("has_gate", "has_bias", "is_transposed", "num_experts"):
        if not hasattr(experts, attr):
            raise TypeError(
                f"experts must be a transformers experts module decorated with @use_experts_implementation "
                f"(it has no {attr!r}), got {type(experts).__name__}"
            )
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(
            f"experts ({type(experts).__name__}) is expert-parallel in transformers (_is_expert_parallel=True); "
            "the moeflow implementation runs all experts locally: use moeflow.parallel for expert parallelism"
        )
    name_in = "gate_up_proj" if experts.has_gate else "up_proj"
    w_in, w_out = getattr(experts, name_in), experts.down_proj
    b_in = getattr(experts, f"{name_in}_bias") if experts.has_bias else None
    b_out = experts.down_proj_bias if experts.has_bias else None
    if not experts.is_transposed:  # stored like nn.Linear: [E, out, in]
        w_in, w_out = w_in.transpose(-2, -1), w_out.transpose(-2, -1)
    return w_in, w_out, b_in, b_out


def experts_forward(
    experts: nn.Module,
    hidden_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``y_TD = sum_k weights_TK[t, k] * expert_{ids_TK[t, k]}(hidden_TD[t])`` on the HF experts
    module's own parameters, through moeflow's dispatch, grouped GEMMs and combine.

    Args:
        experts: a transformers experts module (``@use_experts_implementation``).
        hidden_TD: ``[T, D]`` token rows.
        ids_TK: ``[T, K]`` expert ids from the HF router.
        weights_TK: ``[T, K]`` combine weights from the HF router (any float dtype), cast to the
            input dtype before the weighted sum. HF eager multiplies in the promoted dtype and
            casts after: identical for fp32/fp64 models, within rounding for bf16/fp16.
        backend: grouped-matmul backend (``moeflow.kernels.grouped_mm``); ``"auto"`` probes.
    Returns:
        ``[T, D]`` in ``hidden_TD``'s dtype.
    """
    if hidden_TD.dim() != 2:
        raise ValueError(f"hidden_TD must be [T, D], got shape {tuple(hidden_TD.shape)}")
    if ids_TK.shape != weights_TK.shape or ids_TK.dim() != 2 or ids_TK.shape[0] != hidden_TD.shape[0]:
        raise ValueError(
            f"ids_TK {tuple(ids_TK.shape)} and weights_TK {tuple(weights_TK.shape)} must both be "
            f"[T, K] with T = {hidden_TD.shape[0]}"
        )
    if ids_TK.is_floating_point() or ids_TK.is_complex():
        raise TypeError(f"ids_TK must hold integer expert ids, got dtype {ids_TK.dtype}")
    w_in, w_out, b_in, b_out = _expert_weights(experts)
    if torch.is_autocast_enabled(hidden_TD.device.type):
        # F.grouped_mm is not autocast-aware: run the whole FFN in the autocast dtype
        x_TD, w_in, w_out, b_in, b_out = autocast_cast(hidden_TD, hidden_TD, w_in, w_out, b_in, b_out)
    elif hidden_TD.dtype != w_in.dtype:
        raise TypeError(
            f"hidden_TD has dtype {hidden_TD.dtype} but the expert weights are {w_in.dtype}; cast one of them "
            "or run under torch.autocast"
        )
    else:
        x_TD = hidden_TD
    T, E = x_TD.shape[0], int(experts.num_experts)
    if T == 0:
        return hidden_TD.new_zeros(hidden_TD.shape) + graph_zero(experts, hidden_TD)

    # The HF router already chose; the dispatcher reads only ids, weights and counts. The logits
    # and scores fields get a zero-stride placeholder of the right shape (no memory).
    placeholder_TE = weights_TK.new_zeros(()).expand(T, E)
    routing = RoutingResult(weights_TK=weights_TK, ids_TK=ids_TK.long(), logits_TE=placeholder_TE, scores_TE=placeholder_TE)
    dispatcher = LocalDispatcher(num_experts=E)
    rows_RD, plan = dispatcher.dispatch(x_TD, routing, capacity_factor=0.0)  # dropless, grouped [R, D]
    activation = experts._apply_gate if experts.has_gate else experts.act_fn
    y_RD = grouped_ffn(rows_RD, plan.counts_E, w_in, w_out, b_in, b_out, activation=activation, backend=backend)
    if getattr(experts, "has_post_expert_norm", False):
        y_RD = experts.post_expert_norm(y_RD)  # per row, so the grouped order does not matter
    return dispatcher.combine(y_RD, plan).to(hidden_TD.dtype)


def _interface_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``ExpertsInterface`` signature of ``experts_forward``."""
    return experts_forward(self, hidden_states, top_k_index, top_k_weights)


def register(name: str = EXPERTS_IMPLEMENTATION) -> str:
    """Register the moeflow experts forward in transformers' ``ExpertsInterface`` under ``name``
    (done for ``"moeflow"`` on import; idempotent). Returns ``name``."""
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(f"name must be a non-empty implementation name other than 'eager', got {name!r}")
    ExpertsInterface.register(name, _interface_forward)
    return name


register()


# --------------------------------------------------------------------------- blocks


@dataclass(frozen=True)
class BlockSpec:
    """How one family's HF MoE block is put together.

    Attributes:
        block_class: the HF block class name (matched exactly).
        router: attribute of the router module; it returns ``(logits_TE, weights_TK, ids_TK)``.
        shared: ``None``; ``"plain"``: ``+ shared_experts(x)`` (DeepSeek-V3 style; the module may
            be None, as in Ernie-4.5 without shared experts); ``"gated"``:
            ``+ sigmoid(shared_expert_gate(x)) * shared_expert(x)`` (Qwen2-MoE style).
        jitter: attribute holding the training-time multiplicative input jitter (Mixtral), if any.
        returns_scores: the block returns ``(y, router weights)`` (GPT-OSS) instead of ``y``.
    """

    block_class: str
    router: str = "gate"
    shared: Literal["plain", "gated"] | None = None
    jitter: str | None = None
    returns_scores: bool = False


FAMILIES: dict[str, BlockSpec] = {
    "mixtral": BlockSpec("MixtralSparseMoeBlock", jitter="jitter_noise"),
    "minimax": BlockSpec("MiniMaxSparseMoeBlock", jitter="jitter_noise"),
    "qwen2_moe": BlockSpec("Qwen2MoeSparseMoeBlock", shared="gated"),
    "qwen3_moe": BlockSpec("Qwen3MoeSparseMoeBlock"),
    "qwen3_next": BlockSpec("Qwen3NextSparseMoeBlock", shared="gated"),
    "olmoe": BlockSpec("OlmoeSparseMoeBlock"),
    "flex_olmo": BlockSpec("FlexOlmoSparseMoeBlock"),
    "deepseek_v3": BlockSpec("DeepseekV3MoE", shared="plain"),
    "glm4_moe": BlockSpec("Glm4MoeMoE", shared="plain"),
    "dots1": BlockSpec("Dots1MoE", shared="plain"),
    "ernie4_5_moe": BlockSpec("Ernie4_5_MoeSparseMoeBlock", shared="plain"),
    "gpt_oss": BlockSpec("GptOssMLP", router="router", returns_scores=True),
}


class _MoeflowBlock(nn.Module):
    """Mixin placed before the HF block class: same children and parameter names, a forward
    that runs the HF router, moeflow's experts path and the HF shared experts."""

    _moeflow_spec: BlockSpec

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        spec = self._moeflow_spec
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        if spec.jitter is not None and self.training and getattr(self, spec.jitter) > 0:
            eps = getattr(self, spec.jitter)
            # same draw as HF (which multiplies in place); out of place here
            x_TD = x_TD * torch.empty_like(x_TD).uniform_(1.0 - eps, 1.0 + eps)
        _, weights_TK, ids_TK = getattr(self, spec.router)(x_TD)
        y_TD = experts_forward(self.experts, x_TD, ids_TK, weights_TK)
        if spec.shared == "gated":
            y_TD = y_TD + torch.sigmoid(self.shared_expert_gate(x_TD)) * self.shared_expert(x_TD)
        elif spec.shared == "plain" and self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        y = y_TD.reshape(shape)
        return (y, weights_TK) if spec.returns_scores else y


def _patched_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``Moeflow<HFBlock>``: a subclass of the HF block (``isinstance`` checks in transformers
    keep working), created once per class and bound in this module so it pickles."""
    name = f"Moeflow{cls.__name__}"
    module = sys.modules[__name__]
    existing = getattr(module, name, None)
    if existing is not None and existing.__mro__[2] is cls:
        return existing
    patched = type(name, (_MoeflowBlock, cls), {"__module__": __name__, "__qualname__": name})
    setattr(module, name, patched)
    return patched


def _check_block(name: str, block: nn.Module, spec: BlockSpec) -> None:
    needed = ["experts", spec.router]
    needed += {"gated": ["shared_expert", "shared_expert_gate"], "plain": ["shared_experts"], None: []}[spec.shared]
    missing = [a for a in needed if not hasattr(block, a)]
    if missing:
        raise TypeError(f"block {name!r} ({type(block).__name__}) lacks {missing}; this transformers version differs")
    _expert_weights(block.experts)  # raises for an unsupported experts module


def is_patched(module: nn.Module) -> bool:
    """Whether ``module`` is a block produced by ``patch``."""
    return isinstance(module, _MoeflowBlock)


def patch(model: nn.Module, *, family: str | None = None) -> list[str]:
    """Replace every MoE block of ``model`` by a moeflow-backed block, in place.

    The new block is a subclass of the HF block holding the *same* child modules (router,
    experts, shared experts), so parameter names, the state dict and the HF router (and with it
    ``output_router_logits`` and the aux loss) are unchanged; only the forward differs.

    Args:
        model: a transformers model (any module containing the family's MoE blocks).
        family: a key of ``FAMILIES``; default: ``model.config.model_type``.
    Returns:
        the qualified names of the patched blocks (blocks patched earlier included), in module order.
    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or a block's layout is not the expected one.
        ValueError: unknown ``family``, or ``model`` holds no block of that family.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if family is None:
        family = getattr(getattr(model, "config", None), "model_type", None)
        if family is None:
            raise ValueError(
                f"model ({type(model).__name__}) has no config.model_type; pass family= one of {sorted(FAMILIES)}"
            )
        if family not in FAMILIES:
            raise ValueError(
                f"model.config.model_type={family!r} is not a supported MoE family; supported: {sorted(FAMILIES)}"
            )
    elif family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    spec = FAMILIES[family]

    names: list[str] = []
    targets: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, _MoeflowBlock):
            names.append(name)
        elif type(module).__name__ == spec.block_class:
            if name == "":
                raise ValueError(f"model is itself a {spec.block_class}; patch a module that contains it")
            _check_block(name, module, spec)
            targets.append((name, module))
    if not targets and not names:
        raise ValueError(
            f"model ({type(model).__name__}) contains no {spec.block_class} block (family={family!r}); nothing to patch"
        )
    for name, block in targets:
        cls = _patched_class(type(block))
        new = cls.__new__(cls)  # no __init__: it adopts the existing children below
        # same children, parameters, buffers and hooks; fresh registries so the old block is untouched
        new.__dict__.update({k: (v.copy() if isinstance(v, dict) else v) for k, v in block.__dict__.items()})
        new._moeflow_spec = spec
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)
        names.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(names, key=lambda n: order.get(n, -1))
