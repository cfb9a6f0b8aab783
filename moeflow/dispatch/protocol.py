"""The dispatcher protocol: the one seam between the MoE layer and where its experts live
(legend: moeflow.types).

``MoE.forward`` routes the tokens and then makes exactly one call, ``dispatcher.run(x_TD,
routing, experts, ...)``: move every kept assignment's row to its expert, run the experts,
bring the outputs back and sum each token's ``K`` weighted outputs. The single-process
``LocalDispatcher`` and the expert-parallel dispatcher of ``moeflow.parallel`` implement it, so
parallelism is a substitution made from outside (``expert_parallel``), never a branch in the
layer. What the layer and checkpoints need to know besides ``run`` is declared here too:
whether ``run`` is a collective, and which experts live in this process (``layout``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from moeflow.experts.ffn import Experts
from moeflow.types import ExpertLayout, RoutingResult

__all__ = ["Dispatcher", "check_dispatcher"]


@runtime_checkable
class Dispatcher(Protocol):
    """Runs one MoE step on the experts held here.

    Attributes:
        num_experts: ``E``, the global expert count the routing refers to.
        collective: True when ``run`` is a collective that every rank of a group must enter,
            even with no tokens (the layer then never skips the call for ``T = 0``).
        layout: which experts (slots, replicas, hidden slices) the experts module holds.
    """

    num_experts: int
    collective: bool
    layout: ExpertLayout

    def run(
        self,
        x_TD: torch.Tensor,
        routing: RoutingResult,
        experts: Experts,
        *,
        capacity_factor: float,
        overlap_degree: int | str | None = None,
        parallel: str | None = None,
    ) -> torch.Tensor:
        """``y_TD = sum_k w_TK * expert_{ids_TK}(x_T)`` over the kept assignments (same dtype as
        ``x_TD``, or the experts' output width where it differs). ``capacity_factor`` as in
        ``MoEConfig``; ``overlap_degree`` and ``parallel`` select how an expert-parallel
        dispatcher runs the call (None: its configured default; a single process ignores them).
        The result does not depend on them beyond rounding."""
        ...


def check_dispatcher(dispatcher: object) -> Dispatcher:
    """``dispatcher`` itself when it implements ``Dispatcher``; otherwise a ``TypeError`` naming
    the argument and the type (an object with only ``dispatch``/``combine`` included: the
    protocol is ``run``)."""
    if isinstance(dispatcher, Dispatcher):
        return dispatcher
    raise TypeError(f"dispatcher must implement moeflow.Dispatcher (run, collective, layout, num_experts), "
                    f"got {type(dispatcher).__name__}")
