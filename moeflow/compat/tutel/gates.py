"""Tutel's ``custom`` gates as routers of a ``moeflow.compat.tutel`` layer (legend: moeflow.types).

Tutel lets ``gate_type={'type': 'custom', 'module': cls, ...}`` supply any module that maps
tokens ``x [T, D]`` to logits ``[T, E]`` (it reads ``top_k`` and, when present,
``capacity_factor`` and ``gate_noise`` from the module). The layer does everything after the
logits (noise, softmax, top-k, capacity) itself, exactly as for its built-in gates, so the
wrapper only has to offer the one method the layer calls on a gate: ``logits``.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.config import RouterConfig

__all__ = ["TutelCustomGate"]


class TutelCustomGate(nn.Module):
    """A user gate module (``module(x_TD) -> logits_TE``) in the place of a moeflow ``Router``.

    ``config`` is a plain linear ``RouterConfig`` with no balance losses and no bias updates,
    so moeflow's helpers that read a layer's router settings (``moeflow.update_expert_bias``)
    see a gate with nothing to do. The user module's parameters sit under ``module.``
    (state-dict key ``router.module.<name>`` for gate 0; Tutel's is ``gates.0.<name>``).
    """

    def __init__(self, module: nn.Module, *, num_experts: int) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"a custom gate must be an nn.Module, got {type(module).__name__}")
        self.module = module
        self.num_experts = num_experts
        self.config = RouterConfig(kind="linear", bias=False, load_balance_coef=0.0)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """``x_TD [T, D] -> logits [T, E]`` from the user module (its own dtype rules)."""
        out = self.module(x_TD)
        if not isinstance(out, torch.Tensor) or out.shape != (x_TD.shape[0], self.num_experts):
            raise ValueError(
                f"the custom gate must return logits of shape [T, E] = {[x_TD.shape[0], self.num_experts]}, "
                f"got {getattr(out, 'shape', type(out).__name__)}"
            )
        return out
