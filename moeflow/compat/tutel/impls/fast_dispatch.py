"""``tutel.impls.fast_dispatch`` on moeflow's index dispatch (legend: moeflow.types).

Tutel's "critical data" describes a routing decision as six items:
``(num_global_experts, indices_s, locations_s, gates_s, capacity, dispatch_count)``, where
``indices_s``, ``locations_s`` and ``gates_s`` are lists of K tensors ``[T]`` (choice k of every
token): the chosen expert, the slot inside that expert (0-based, computed *before* capacity, so
a slot ``>= capacity`` means the assignment is dropped), and the gate value;
``dispatch_count`` (``get_dispatch_count``) is the int64 ``[E]`` count of assignments per
expert before drops. The functions here also take the older five-item tuple (no count).

``fast_encode`` moves token rows into the ``[E, C, D]`` expert layout and ``fast_decode``
brings them back and sums the K contributions per token. Both are row gathers
(``moeflow.kernels.gather_rows``, whose backward is a gather too): O(T*K*D), never the
``[T, E, C]`` one-hot einsum of the GShard formulation they replace.

``extract_critical`` turns router probabilities into critical data with Tutel's slot order
(first choices of all tokens before second choices; with ``batch_prioritized_routing`` tokens
inside each choice ordered by their best score), computed by moeflow's sort-based
``assign_slots`` instead of a cumulative sum over a one-hot mask. Capacity follows Tutel's
rule with two fixes (see ``tutel_capacity``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from moeflow.compat.tutel.impls.losses import gshard_loss
from moeflow.compat.tutel.jit_kernels.gating import fast_cumsum_sub_one
from moeflow.dispatch.combine import sum_token_rows
from moeflow.dispatch.slots import assign_slots
from moeflow.kernels.gather import gather_rows
from moeflow.parallel.comm import gather_objects, process_position

__all__ = [
    "CriticalData",
    "tutel_capacity",
    "extract_critical",
    "fast_encode",
    "fast_decode",
    "fast_dispatcher",
    "TutelMoeFastDispatcher",
    "compute_sorted_location",
    "fast_cumsum_sub_one",
    "get_dispatch_count",
    "GatingEncoder",
    "GatingDecoder",
]

CriticalData = tuple[int, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int, torch.Tensor]


def tutel_capacity(
    capacity_factor: float,
    *,
    num_tokens: int,
    top_k: int,
    num_experts: int,
    max_count: int | None = None,
    alignment: int = 1,
) -> int:
    """Slots per expert ``C`` by Tutel's rule, with its two capacity bugs fixed.

    With ``n = ceil(T / E)`` (tokens per expert under perfect balance):

    - cf > 0: ``C = K * int(cf * n)`` (Tutel truncates ``cf * n`` in floating point; kept), but
      at least 1: Tutel gives ``C = 0`` (every token dropped) for a tiny positive cf.
    - cf == 0: dropless, ``C = max_count`` (the most assignments any expert received).
      Tutel's per-call ``capacity_factor=0`` was ignored (``0 or default``); here 0 is a value.
    - cf < 0: dropless capped: ``C = min(max_count, max(1, K * int(|cf| * n)))``.

    Then ``C`` is rounded up to a multiple of ``alignment``.
    """
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not math.isfinite(capacity_factor):
        raise ValueError(f"capacity_factor must be a finite number, got {capacity_factor!r}")
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be an int >= 1, got {alignment!r}")
    per_expert = (num_tokens + num_experts - 1) // num_experts
    if capacity_factor > 0:
        capacity = max(1, top_k * int(capacity_factor * per_expert))
    else:
        if max_count is None:
            raise ValueError("max_count is needed for capacity_factor <= 0 (dropless)")
        capacity = int(max_count)
        if capacity_factor < 0:
            capacity = min(capacity, max(1, top_k * int(-capacity_factor * per_expert)))
    remainder = capacity % alignment
    return capacity + (alignment - remainder if remainder else 0)


def _check_critical(critial_data: Sequence) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Unpack critical data (six items, or the older five) into ``(E, ids_TK, loc_TK, gates_TK, C)``
    (int64 ids/locations)."""
    if not isinstance(critial_data, (tuple, list)) or len(critial_data) not in (5, 6):
        raise TypeError(
            "critial_data must be the tuple (num_global_experts, indices_s, locations_s, gates_s, capacity, "
            f"dispatch_count) from extract_critical, got {type(critial_data).__name__} of length "
            f"{len(critial_data) if isinstance(critial_data, (tuple, list)) else '-'}"
        )
    E, indices_s, locations_s, gates_s, C = critial_data[:5]
    if not (len(indices_s) == len(locations_s) == len(gates_s) >= 1):
        raise ValueError(
            f"indices_s, locations_s and gates_s must be lists of the same length K >= 1, got "
            f"{len(indices_s)}, {len(locations_s)}, {len(gates_s)}"
        )
    C = int(C)
    if C < 0:
        raise ValueError(f"capacity must be >= 0, got {C}")
    ids_TK = torch.stack([i.reshape(-1) for i in indices_s], dim=1).long()
    loc_TK = torch.stack([l.reshape(-1) for l in locations_s], dim=1).long()
    gates_TK = torch.stack([g.reshape(-1) for g in gates_s], dim=1)
    return int(E), ids_TK, loc_TK, gates_TK, C


class _Rows:
    """Row maps between tokens and the flat ``[E*C]`` expert rows for one routing decision.

    ``assign_M``: the flat assignment ``t*K + k`` in each expert row (0 where empty);
    ``valid_M``: rows that hold an assignment; ``row_A``: the row of each assignment (0 where
    dropped); ``kept_TK``: assignments that fit (slot < C).
    """

    def __init__(self, E: int, ids_TK: torch.Tensor, loc_TK: torch.Tensor, C: int) -> None:
        T, K = ids_TK.shape
        device = ids_TK.device
        if T and (int(ids_TK.min()) < 0 or int(ids_TK.max()) >= E):
            raise ValueError(f"indices_s must lie in [0, {E}), got values in [{int(ids_TK.min())}, {int(ids_TK.max())}]")
        self.kept_TK = (loc_TK >= 0) & (loc_TK < C)
        trash = E * C
        dest_A = torch.where(self.kept_TK, ids_TK * C + loc_TK, trash).reshape(-1)
        A = T * K
        self.assign_M = torch.zeros(trash + 1, dtype=torch.long, device=device).index_copy_(
            0, dest_A, torch.arange(A, device=device)
        )[:trash]
        self.valid_M = torch.zeros(trash + 1, dtype=torch.bool, device=device).index_copy_(
            0, dest_A, self.kept_TK.reshape(-1)
        )[:trash]
        self.row_A = torch.where(self.kept_TK.reshape(-1), dest_A, 0)
        self.T, self.K, self.E, self.C = T, K, E, C

    def encode(self, x_TD: torch.Tensor, gates_TK: torch.Tensor | None) -> torch.Tensor:
        """``[E*C, D]`` expert rows (zero rows where empty), scaled by the gate if given."""
        token_M = torch.div(self.assign_M, self.K, rounding_mode="floor")
        rows_MD = gather_rows(x_TD, token_M, self.valid_M, self.row_A.view(self.T, self.K), self.kept_TK)
        if gates_TK is not None:
            rows_MD = rows_MD * gates_TK.reshape(-1).to(rows_MD.dtype)[self.assign_M].unsqueeze(1)
        return rows_MD

    def decode(self, rows_MD: torch.Tensor, gates_TK: torch.Tensor, weighted: bool) -> torch.Tensor:
        """``y_TD = sum_k g_TK * rows[row of (t, k)]`` (plain sum when not ``weighted``)."""
        D = rows_MD.shape[-1]
        rows_AD = gather_rows(rows_MD, self.row_A, self.kept_TK.reshape(-1), self.assign_M.view(-1, 1), self.valid_M.view(-1, 1))
        w_TK = gates_TK.to(rows_MD.dtype) * self.kept_TK
        return sum_token_rows(rows_AD.view(self.T, self.K, D), w_TK, "combine" if weighted else "dispatch")


def fast_encode(data: torch.Tensor, critial_data: Sequence, is_postscore: bool = True) -> torch.Tensor:
    """Tokens ``[T, D]`` -> expert rows ``[E, C, D]`` for the routing in ``critial_data``.

    Assignments whose slot is ``>= C`` are dropped; empty rows are zero. With
    ``is_postscore=False`` each row is multiplied by its gate here (and ``fast_decode`` does not).
    Differentiable in ``data`` (and in the gates when they are applied here).
    """
    E, ids_TK, loc_TK, gates_TK, C = _check_critical(critial_data)
    x_TD = data.reshape(-1, data.shape[-1])
    if x_TD.shape[0] != ids_TK.shape[0]:
        raise ValueError(f"data has {x_TD.shape[0]} tokens but the critical data routes {ids_TK.shape[0]}")
    rows = _Rows(E, ids_TK, loc_TK, C)
    return rows.encode(x_TD, None if is_postscore else gates_TK).view(E, C, x_TD.shape[1])


def fast_decode(data: torch.Tensor, critial_data: Sequence, is_postscore: bool = True) -> torch.Tensor:
    """Expert rows ``[E, C, D]`` (or ``[E*C, D]``) -> tokens ``[T, D]``: the sum over each
    token's kept assignments, weighted by the gates when ``is_postscore`` (the default).
    Differentiable in ``data`` and the gates."""
    E, ids_TK, loc_TK, gates_TK, C = _check_critical(critial_data)
    rows_MD = data.reshape(-1, data.shape[-1])
    if rows_MD.shape[0] != E * C:
        raise ValueError(f"data must hold E*C = {E}*{C} rows, got shape {tuple(data.shape)}")
    return _Rows(E, ids_TK, loc_TK, C).decode(rows_MD, gates_TK, bool(is_postscore))


class TutelMoeFastDispatcher:
    """Tutel's stateful dispatcher object: ``update(...)`` once per routing decision, then
    ``encode(x_TD) -> [E*C, D]`` and ``decode(rows) -> [T, D]``.

    Kept for code that drives Tutel's dispatcher by hand (``fast_dispatcher(E, C, D, dtype)``);
    moeflow's own layers use stateless plans instead.
    """

    def __init__(self, num_global_experts: int, capacity: int, model_dim: int, dispatch_dtype: torch.dtype) -> None:
        self.num_global_experts = int(num_global_experts)
        self.capacity = int(capacity)
        self.model_dim = int(model_dim)
        self.dtype = dispatch_dtype
        self.is_postscore = True
        self._rows: _Rows | None = None
        self._gates_TK: torch.Tensor | None = None

    def update(
        self,
        indices_: Sequence[torch.Tensor],
        locations_: Sequence[torch.Tensor],
        gates_: Sequence[torch.Tensor],
        capacity: int | None = None,
        is_postscore: bool = True,
    ) -> None:
        if capacity is not None:
            self.capacity = int(capacity)
        self.is_postscore = bool(is_postscore)
        E, ids_TK, loc_TK, gates_TK, C = _check_critical(
            (self.num_global_experts, list(indices_), list(locations_), list(gates_), self.capacity)
        )
        self._rows, self._gates_TK = _Rows(E, ids_TK, loc_TK, C), gates_TK

    def _state(self) -> tuple[_Rows, torch.Tensor]:
        if self._rows is None or self._gates_TK is None:
            raise RuntimeError("call update(indices_, locations_, gates_) before encode/decode")
        return self._rows, self._gates_TK

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        rows, gates_TK = self._state()
        x_TD = data.reshape(-1, data.shape[-1]).to(self.dtype)
        return rows.encode(x_TD, None if self.is_postscore else gates_TK)

    def decode(self, data: torch.Tensor) -> torch.Tensor:
        rows, gates_TK = self._state()
        return rows.decode(data.reshape(-1, data.shape[-1]).to(self.dtype), gates_TK, self.is_postscore)


fast_dispatcher = TutelMoeFastDispatcher


def compute_sorted_location(x: torch.Tensor, importance_scores: torch.Tensor) -> torch.Tensor:
    """``fast_cumsum_sub_one`` over the rows of ``x`` taken in ascending ``importance_scores``
    order (stable), returned in the original row order and multiplied by ``x`` (Tutel's
    batch-prioritized slot scan; pass ``-max_score`` to put the most confident tokens first)."""
    order = torch.sort(importance_scores, stable=True).indices
    sorted_x = x.index_select(0, order)
    located = fast_cumsum_sub_one(sorted_x) * sorted_x
    return located.index_select(0, torch.argsort(order))


def extract_critical(
    scores: torch.Tensor,
    top_k: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = gshard_loss,
    capacity_factor: float = 1.0,
    batch_prioritized_routing: bool = False,
    normalize_gate: bool = True,
    group: object | None = None,
    alignment: int = 1,
    inequivalent_tokens: bool = False,
) -> tuple[CriticalData, torch.Tensor | None]:
    """Router probabilities ``[T, E]`` -> ``((E, indices_s, locations_s, gates_s, C, counts_E), l_loss)``.

    Picks the top ``top_k`` experts per token (``top_k`` must be <= E; Tutel clamps it
    silently), gates = the picked probabilities (divided by their sum when ``normalize_gate``
    and ``top_k > 1``, as in Tutel), slots in first-choice-priority order (or batch-prioritized
    order), ``C`` by ``tutel_capacity``. ``l_loss = loss_fn(scores, topk_ids_TK)`` (None
    without ``loss_fn``). ``indices_s`` and ``locations_s`` are int32 like Tutel's.

    ``group`` (an expert-parallel process group) matters only for ``capacity_factor <= 0``
    (the dropless capacity is the maximum over the group) and ``inequivalent_tokens=True``
    (``T`` is the maximum token count over the group), as in Tutel.

    ``counts_E`` (int64 ``[E]``, ``get_dispatch_count``) holds the assignments per expert of
    this process before drops. With ``batch_prioritized_routing`` Tutel reads both it and the
    dropless capacity from the last row of its location scan, which is then the *last token's*
    row, not the per-expert totals, so Tutel's "dropless" mode drops tokens there; here both
    are the true counts (a Tutel bug fixed).
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2:
        raise ValueError(f"scores must be a [T, E] tensor, got {getattr(scores, 'shape', type(scores).__name__)}")
    T, E = scores.shape
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"top_k must be an int in [1, num_global_experts={E}], got {top_k!r}")
    ids_TK = torch.topk(scores, top_k, dim=1).indices
    gates_TK = scores.gather(1, ids_TK)
    l_loss = loss_fn(scores, ids_TK) if loss_fn is not None else None

    policy = "bpr" if batch_prioritized_routing else "position"
    slots = assign_slots(ids_TK, gates_TK, num_experts=E, drop_policy=policy)
    loc_A = torch.empty_like(slots.pos_A).scatter_(0, slots.order_A, slots.pos_A)
    loc_TK = loc_A.view(T, top_k)

    if top_k > 1 and normalize_gate:
        denom_T1 = gates_TK.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates_TK.dtype).eps)
        gates_TK = gates_TK / denom_T1

    _, world = process_position(group)
    num_tokens = T
    if inequivalent_tokens and world > 1:
        num_tokens = max(int(t) for t in gather_objects(T, group))  # type: ignore[arg-type]
    max_count = None
    if capacity_factor <= 0:
        max_count = int(slots.counts_E.max()) if T else 0
        if world > 1:
            max_count = max(int(c) for c in gather_objects(max_count, group))  # type: ignore[arg-type]
    capacity = tutel_capacity(
        capacity_factor, num_tokens=num_tokens, top_k=top_k, num_experts=E, max_count=max_count, alignment=alignment
    )
    indices_s = [ids_TK[:, k].to(torch.int32) for k in range(top_k)]
    locations_s = [loc_TK[:, k].to(torch.int32) for k in range(top_k)]
    gates_s = [gates_TK[:, k] for k in range(top_k)]
    return (E, indices_s, locations_s, gates_s, capacity, slots.counts_E.long()), l_loss


def get_dispatch_count(critial_data: Sequence) -> torch.Tensor:
    """The int64 ``[E]`` assignments per expert (before drops) of ``extract_critical``'s tuple."""
    if not isinstance(critial_data, (tuple, list)) or len(critial_data) != 6:
        raise TypeError("critial_data must be the 6-tuple from extract_critical (the dispatch count is its last item)")
    return critial_data[-1]


def _dispatcher_state(config: object, what: str) -> tuple[_Rows, torch.Tensor]:
    if not isinstance(config, TutelMoeFastDispatcher):
        raise TypeError(f"{what}.apply needs a fast_dispatcher (after update(...)) as config, got {type(config).__name__}")
    return config._state()


class GatingEncoder:
    """``GatingEncoder.apply(config, x_TD, *gates_s) -> [E*C, D]``, as Tutel's autograd function.

    ``config`` is a ``fast_dispatcher`` after ``update(...)``; with gates (one ``[T]`` tensor
    per choice) every row is scaled by its gate. The gradients (input and gates) come from
    moeflow's differentiable row gathers, the same as ``fast_encode``.
    """

    @staticmethod
    def apply(config: "TutelMoeFastDispatcher", reshaped_input: torch.Tensor, *gates_: torch.Tensor) -> torch.Tensor:
        rows, _ = _dispatcher_state(config, "GatingEncoder")
        gates_TK = torch.stack([g.reshape(-1) for g in gates_], dim=1) if gates_ else None
        return rows.encode(reshaped_input.reshape(-1, reshaped_input.shape[-1]), gates_TK)


class GatingDecoder:
    """``GatingDecoder.apply(config, rows [E*C, D], *gates_s) -> [T, D]``, as Tutel's autograd
    function: the sum of each token's kept rows, weighted by the gates when given."""

    @staticmethod
    def apply(config: "TutelMoeFastDispatcher", expert_output: torch.Tensor, *gates_: torch.Tensor) -> torch.Tensor:
        rows, gates_TK = _dispatcher_state(config, "GatingDecoder")
        if gates_:
            gates_TK = torch.stack([g.reshape(-1) for g in gates_], dim=1)
        return rows.decode(expert_output.reshape(-1, expert_output.shape[-1]), gates_TK, bool(gates_))
