"""One rank's plan of an exchanged call (legend: moeflow.types): the token side (which of its
assignments it sends, and how their outputs are summed back) as a ``DispatchPlan``, plus the
exchange's split sizes and the layout of the rows its experts receive. Pure torch: built from
the ``GroupAssignment`` every rank computed alike."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.config import DispatchConfig
from moeflow.dispatch.combine import combine_weights
from moeflow.kernels.gather import gather_rows
from moeflow.parallel.exchange.assignment import GroupAssignment, ReceiveSide
from moeflow.types import DispatchPlan, RoutingResult

__all__ = ["ExchangePlan", "exchange_plan", "send_rows", "permute_rows", "inverse_permutation"]


@dataclass(frozen=True)
class ExchangePlan(DispatchPlan):
    """A ``DispatchPlan`` whose ``M`` rows are the rows this rank sends (``assign_M``: the local
    assignment of each, in send order; ``row_valid_M`` is None) and whose ``counts_E`` and
    ``capacity`` describe the input of the experts held here. Besides:

    Attributes:
        counts_WW: ``counts[s][d]`` rows sent from rank ``s`` to rank ``d`` (every rank's view).
        input_row_R: expert-input row of each received row (arrival order).
        recv_row_I: received row feeding each expert-input row (arbitrary where empty).
        valid_I: expert-input rows that hold a row (None: all of them).
    """

    counts_WW: list[list[int]]
    input_row_R: torch.Tensor
    recv_row_I: torch.Tensor
    valid_I: torch.Tensor | None


def exchange_plan(group: GroupAssignment, rank: int, routing: RoutingResult, *, dtype: torch.dtype,
                  config: DispatchConfig, received: ReceiveSide | None = None) -> ExchangePlan:
    """``rank``'s plan of the call (``received``: ``group.receive_side(rank)`` if the caller has
    it already). Combine weights come from this rank's ``routing``, renormalised over its kept
    assignments when configured; with hidden shards every slice's output carries its
    assignment's weight."""
    sent = group.send_side(rank)
    received = group.receive_side(rank) if received is None else received
    n, T = group.hidden_shards, group.routing.tokens_W[rank]
    kept_A = sent.kept_A
    if kept_A is not None and n > 1:  # slices are kept or dropped together: read slice 0
        kept_A = kept_A.view(T, routing.top_k, n)[:, :, 0].reshape(-1)
    weights_TK = combine_weights(routing.weights_TK, kept_A, dtype, config.renormalize_after_drop)
    if n > 1:
        weights_TK = weights_TK.repeat_interleave(n, dim=1)
    return ExchangePlan(
        assign_M=sent.assign_M, row_valid_M=None, row_A=sent.row_A, kept_A=sent.kept_A, weights_TK=weights_TK,
        counts_E=received.counts_e, capacity=group.capacity.layout_capacity, num_tokens=T,
        weight_at=config.weight_at, counts_WW=group.counts_WW, input_row_R=received.input_row_R,
        recv_row_I=received.recv_row_I, valid_I=received.valid_I,
    )


def send_rows(x_TD: torch.Tensor, assign_M: torch.Tensor, row_A: torch.Tensor, kept_A: torch.Tensor | None,
              weights_TK: torch.Tensor, weight_at: str) -> torch.Tensor:
    """The rows sent for assignments ``assign_M`` (``t*K + k`` into ``x_TD``, ``K`` the width of
    ``weights_TK``), in that order, weighted when the weights apply at dispatch; backward
    gathers each token's (up to K) row gradients through ``row_A`` (masked by ``kept_A``)."""
    T, K = weights_TK.shape
    send_MD = gather_rows(
        x_TD,
        torch.div(assign_M, K, rounding_mode="floor"),
        None,
        row_A.view(T, K),
        None if kept_A is None else kept_A.view(T, K),
    )
    if weight_at == "dispatch":
        send_MD = send_MD * weights_TK.reshape(-1)[assign_M].unsqueeze(1)
    return send_MD


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def permute_rows(x_ND: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """``x_ND[perm]`` for a permutation, backward by the inverse gather."""
    return gather_rows(x_ND, perm, None, inverse_permutation(perm).view(-1, 1), None)
