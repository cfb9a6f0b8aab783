"""Small frozen result types shared by routing, dispatch and the layer.

Shape legend (every module uses these suffixes on tensor names):

- ``T`` tokens, ``D`` model dim, ``H`` expert hidden dim, ``F`` expert input-projection width
  (``H``, or ``2H`` for gated activations), ``E`` global experts, ``e`` local experts,
  ``K`` top-k, ``C`` capacity per expert, ``A`` assignments (``T*K``, before drops),
  ``R`` routed rows handed to the experts, ``W`` world size of the expert group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from moeflow.kernels.counts import count_ids

__all__ = ["RoutingResult", "DispatchPlan"]


@dataclass(frozen=True)
class RoutingResult:
    """What a router returns for one batch of tokens.

    Attributes:
        weights_TK: combine weight of each selected expert, in the router dtype; carries the
            gradient back to the router.
        ids_TK: selected expert ids (int64), one row per token, K distinct ids per row.
        logits_TE: raw router logits (after noise, if any), router dtype.
        scores_TE: the per-expert scores the selection was made from (softmax/sigmoid of the
            logits, or the logits themselves for top-k-then-softmax), router dtype.
        aux_losses: name -> scalar tensor, each already multiplied by its coefficient.
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def top_k(self) -> int:
        return self.ids_TK.shape[1]

    @cached_property
    def counts_E(self) -> torch.Tensor:
        """Assignments per expert before any drop (int64 ``[E]``), counted once per call and
        shared by the losses, the balancing counters, the layer and the dispatcher."""
        return count_ids(self.ids_TK.detach(), self.logits_TE.shape[1])


@dataclass(frozen=True)
class DispatchPlan:
    """Everything ``combine`` needs to undo ``dispatch``; produced once per call, never stored.

    The expert input has ``M`` rows: ``M = E*C`` in the capacity layout ``[E, C, D]``, and
    ``M = counts_E.sum()`` in the grouped layout (rows grouped by expert; ``M = A`` when
    dropless without a cap). Assignments are numbered by their flat
    index ``a = t*K + k``.

    Attributes:
        assign_M: the assignment occupying each expert row (int64; arbitrary where not valid).
        row_valid_M: bool mask of expert rows holding a kept assignment, or ``None`` if all do.
        row_A: the expert row of each assignment (int64; arbitrary where dropped).
        kept_A: bool mask of assignments that fit in capacity, or ``None`` when nothing can be
            dropped (dropless without a cap).
        weights_TK: combine weights in the input dtype (renormalised after drops if configured).
        counts_E: kept rows per expert (int64).
        capacity: ``C`` for the capacity layout, ``None`` for the grouped layout.
        num_tokens: ``T``.
        weight_at: ``"combine"`` or ``"dispatch"``: where the router weight is applied.
    """

    assign_M: torch.Tensor
    row_valid_M: torch.Tensor | None
    row_A: torch.Tensor
    kept_A: torch.Tensor | None
    weights_TK: torch.Tensor
    counts_E: torch.Tensor
    capacity: int | None
    num_tokens: int
    weight_at: str

    @property
    def top_k(self) -> int:
        return self.weights_TK.shape[1]
