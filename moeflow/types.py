"""Small frozen result types shared by routing, dispatch and the layer.

Shape legend (every module uses these suffixes on tensor names):

- ``T`` tokens, ``D`` model dim, ``H`` expert hidden dim, ``F`` expert input-projection width
  (``H``, or ``2H`` for gated activations), ``E`` global experts, ``e`` local experts,
  ``K`` top-k, ``C`` capacity per expert, ``A`` assignments (``T*K``, before drops),
  ``R`` routed rows handed to the experts, ``W`` world size of the expert group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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


@dataclass(frozen=True)
class DispatchPlan:
    """Everything ``combine`` needs to undo ``dispatch``; produced once per call, never stored.

    Assignments are listed in expert-major order (all rows of expert 0 first, then expert 1,
    ...); inside an expert they follow the drop-policy priority, so the first ``C`` rows of an
    expert are the kept ones.

    Attributes:
        token_A: source token of each assignment (int64).
        weight_A: router weight of each assignment (already renormalised after drops if
            configured; zero for dropped assignments is *not* applied here, ``kept_A`` is).
        kept_A: bool mask of assignments that fit in capacity, or ``None`` when nothing can be
            dropped (dropless without a cap).
        row_A: the row of the flattened expert input that each assignment occupies
            (``e*C + slot`` in capacity layout, position in the grouped layout otherwise);
            dropped assignments point at a trash row past the end.
        counts_E: kept rows per expert (int64); in capacity layout at most ``C``.
        capacity: ``C`` for the padded ``[E, C, D]`` layout, ``None`` for the grouped ``[R, D]``
            layout.
        num_tokens: ``T``.
        weight_at: ``"combine"`` or ``"dispatch"``: where ``weight_A`` was applied.
    """

    token_A: torch.Tensor
    weight_A: torch.Tensor
    kept_A: torch.Tensor | None
    row_A: torch.Tensor
    counts_E: torch.Tensor
    capacity: int | None
    num_tokens: int
    weight_at: str
