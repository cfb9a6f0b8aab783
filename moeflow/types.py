"""Small frozen result types shared by routing, dispatch, parallelism and the layer.

Shape legend (every module uses these suffixes on tensor names):

- ``T`` tokens, ``D`` model dim, ``H`` expert hidden dim, ``F`` expert input-projection width
  (``H``, or ``2H`` for gated activations), ``O`` expert output dim where it differs from ``D``.
- ``E`` global experts, ``e`` expert slots held by this process (experts, replicas or hidden
  slices), ``K`` top-k, ``C`` capacity per expert.
- ``A`` assignments of this process (``T*K``, before drops, flat index ``a = t*K + k``); ``G``
  assignments of the whole expert-parallel group (every rank's ``A``, in rank order).
- ``M`` rows of a dispatch buffer: the expert input of the local dispatcher (``E*C`` in the
  capacity layout, the kept rows otherwise), the rows a rank sends in an exchange.
- ``R`` rows the experts held here receive (in arrival order), ``I`` rows of the expert input
  held here (``e*C`` in the capacity layout, ``R`` grouped by slot otherwise).
- ``W`` world size of the expert group, ``N`` rows of a buffer of any length (collectives and
  row gathers take any).

A module that needs more letters names them in its own docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeflow.kernels.counts import count_ids

__all__ = ["RoutingResult", "DispatchPlan", "ExpertLayout"]


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
        priority_TK: what orders the assignments competing for capacity under the ``"score"``
            and ``"bpr"`` drop policies; the weights unless a router ranks by something else
            (Tutel ranks by its raw scores and combines with normalised ones).
    """

    weights_TK: torch.Tensor
    ids_TK: torch.Tensor
    logits_TE: torch.Tensor
    scores_TE: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    priority_TK: torch.Tensor | None = None

    counts_E: torch.Tensor = field(init=False, repr=False)
    """Assignments per expert before any drop (int64 ``[E]``), counted once per call (on
    construction: every dispatcher reads it) and passed to everything else that needs them:
    the losses, the balancing counters, the layer and the dispatcher's slot assignment, none of
    which counts again. ``moeflow.kernels.counts.count_ids`` counts them (a scatter-add into a
    fixed ``[E]``: no host sync, a static shape)."""

    def __post_init__(self) -> None:
        if self.priority_TK is None:
            object.__setattr__(self, "priority_TK", self.weights_TK)
        object.__setattr__(self, "counts_E", count_ids(self.ids_TK.detach(), self.logits_TE.shape[1]))

    @property
    def top_k(self) -> int:
        return self.ids_TK.shape[1]


@dataclass(frozen=True)
class DispatchPlan:
    """Everything ``combine`` needs to undo ``dispatch``; produced once per call, never stored.

    The token side of a dispatch: this process's assignments become ``M`` rows of a dispatch
    buffer, and ``combine`` gathers each assignment's output back from its row. For the local
    dispatcher the buffer is the expert input: ``M = E*C`` in the capacity layout ``[E, C, D]``,
    ``M = counts_E.sum()`` in the grouped layout (rows grouped by expert; ``M = A`` when dropless
    without a cap). For an exchange the buffer is the rows this rank sends (and gets back), and
    ``counts_E``/``capacity`` describe the input of the experts held here
    (``moeflow.parallel.exchange.plan.ExchangePlan``).

    Attributes:
        assign_M: the assignment occupying each row (int64; arbitrary where not valid).
        row_valid_M: bool mask of rows holding a kept assignment, or ``None`` if all do.
        row_A: the row of each assignment (int64; arbitrary where dropped).
        kept_A: bool mask of assignments that fit in capacity, or ``None`` when nothing can be
            dropped (dropless without a cap).
        weights_TK: combine weights in the input dtype (renormalised after drops if configured).
        counts_E: kept rows per expert held here (int64).
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


@dataclass(frozen=True)
class ExpertLayout:
    """Which experts the experts module of a layer holds: its local slot ``i`` holds hidden
    slice ``slot_parts[i]`` (of ``hidden_shards``) of global expert ``slot_experts[i]``.

    The dispatcher owns it (``Dispatcher.layout``); the layer and checkpoints read it. Every
    process holds all ``E`` whole experts without expert parallelism; expert parallelism holds
    a contiguous block, a load-aware placement any slots (replicas of a hot expert on several
    ranks), hidden sharding slices of experts.

    Attributes:
        num_experts: ``E``, the global (logical) expert count.
        slot_experts: global expert of each local slot.
        slot_primary: whether each slot is the copy a checkpoint saves: its expert's first
            replica, or slice 0 of a hidden-sharded expert (saved after joining the slices).
        hidden_shards: hidden slices per expert (1: whole experts).
        slot_parts: hidden slice each slot holds (all 0 for whole experts).
    """

    num_experts: int
    slot_experts: tuple[int, ...]
    slot_primary: tuple[bool, ...]
    hidden_shards: int = 1
    slot_parts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.slot_parts:
            object.__setattr__(self, "slot_parts", (0,) * len(self.slot_experts))
        if not len(self.slot_experts) == len(self.slot_primary) == len(self.slot_parts):
            raise ValueError(f"slot_experts, slot_primary and slot_parts differ in length: {self}")

    @classmethod
    def whole(cls, num_experts: int) -> ExpertLayout:
        """All ``E`` experts in this process, in order."""
        return cls(num_experts=num_experts, slot_experts=tuple(range(num_experts)), slot_primary=(True,) * num_experts)

    @property
    def offset(self) -> int | None:
        """Global index of the first expert held here when the slots are one contiguous block of
        whole experts (``start, start+1, ...``); None for any other layout."""
        first = self.slot_experts[0] if self.slot_experts else 0
        contiguous = self.slot_experts == tuple(range(first, first + len(self.slot_experts)))
        return first if contiguous and self.hidden_shards == 1 else None
