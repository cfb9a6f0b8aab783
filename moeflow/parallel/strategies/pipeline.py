"""The pipelined expert-parallel call, ``overlap_degree = n > 1`` (legend: moeflow.types, plus
``n`` chunks and ``e`` local slots).

Chunks are cut along the expert slots, not the tokens: chunk ``i`` holds the kept assignments
to the local slots ``[i*e//n, (i+1)*e//n)`` of every rank (``slot_chunks``; ``min(n, e)``
chunks, since a chunk without slots would carry nothing). So every expert's GEMM keeps all its
rows, as in the unchunked call, and chunking costs the GEMMs nothing (cutting the tokens instead
made each GEMM ``n`` times shorter). The exchange of chunk ``i+1`` runs while chunk ``i``'s
experts compute:

1. this rank's sent rows are gathered once from the tokens, chunk-major (chunk, then
   destination rank, slot, position): one gather, as in the unchunked call; every chunk's
   exchange starts now and they complete in order (``moeflow.parallel.exchange.chunked``: over
   the flat exchange each chunk reads and writes its slice of one tensor, forward and backward);
2. per chunk: receive, group the rows by slot, run the chunk's experts and send the outputs
   home asynchronously while the next chunk is received and computed. ``GroupedExperts``
   (``chunk_ffn.ChunkedFFN``): the grouped FFN on the chunk's slice of the weights, whose
   gradients are the unchunked call's two grouped GEMMs over all chunks' rows at the end; with
   biases or recompute, the grouped FFN on a ``split`` of the weights (whose backward joins the
   chunks' weight gradients: one copy); any other experts module: the whole module, with zero
   rows for the other chunks' slots;
3. the outputs, home in chunk-major order, are summed per token by the unchunked call's one
   combine (``combine_rows``), so every token's sum is formed as in the unchunked call.

In backward the reverse exchanges are asynchronous too. One host read per call (the per-chunk
split sizes, read once for every chunk) where the unchunked call reads its split sizes, and no
boolean index; no ``[M, D]`` copy the unchunked call does not make (over the two-level exchange:
one split and one join of the rows, ``chunked.PhasedChunks``).
"""

from __future__ import annotations

import dataclasses

import torch

from moeflow.dispatch.combine import combine_rows
from moeflow.experts.ffn import GroupedExperts, autocast_cast, grouped_ffn
from moeflow.kernels.counts import count_ids
from moeflow.parallel.exchange.assignment import GroupAssignment
from moeflow.parallel.exchange.chunked import chunked_exchange
from moeflow.parallel.exchange.plan import exchange_plan, inverse_permutation, permute_rows, send_rows
from moeflow.parallel.strategies.base import Call, ExpertGroup
from moeflow.parallel.strategies.chunk_ffn import ChunkedFFN

__all__ = ["run_pipelined", "slot_chunks", "chunk_of_slot"]


def slot_chunks(slots: int, degree: int) -> list[int]:
    """Bounds of the slot chunks: chunk ``i`` is the local slots ``[b[i], b[i+1])`` with
    ``b[i] = i * slots // degree``, empty chunks dropped (``min(degree, slots)`` chunks; sizes
    differ by at most one slot). Raises ``ValueError`` for ``slots < 1`` or ``degree < 1``."""
    if slots < 1 or degree < 1:
        raise ValueError(f"slot_chunks needs slots >= 1 and degree >= 1, got slots={slots}, degree={degree}")
    bounds = sorted({i * slots // degree for i in range(degree + 1)})
    return bounds


def chunk_of_slot(local_N: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """Chunk of each local slot in ``local_N`` (``slot_chunks``' ``bounds``); no host read."""
    inner = torch.tensor(bounds[1:-1], dtype=local_N.dtype, device=local_N.device)
    return torch.bucketize(local_N, inner, right=True)


def _fast_experts(experts: object) -> bool:
    """Whether a chunk may run as ``grouped_ffn`` on a slice of ``experts``' weights (the
    built-in experts, unmodified ``forward``)."""
    return isinstance(experts, GroupedExperts) and type(experts).forward is GroupedExperts.forward


def run_pipelined(where: ExpertGroup, call: Call, group: GroupAssignment, chunks: int) -> torch.Tensor:
    """``y_TD`` of ``call`` in at most ``chunks`` pipelined slot chunks (see module docstring)."""
    W, r, e = where.world, where.rank, group.slots_per_rank
    received = group.receive_side(r)
    plan = exchange_plan(group, r, call.routing, dtype=call.x_TD.dtype, config=where.dispatch, received=received)
    x_TD, K, T = call.x_TD, plan.top_k, plan.num_tokens
    device = x_TD.device
    bounds = slot_chunks(e, chunks)
    n = len(bounds) - 1

    # the chunk of every group assignment, and every chunk's split sizes: one host read (dropped
    # assignments are counted in a last bin; no boolean index, which would read on the host too)
    chunk_G = chunk_of_slot(group.slot_G - group.dst_G * e, bounds)
    key_G = torch.where(group.kept_G, (chunk_G * W + group.src_G) * W + group.dst_G, n * W * W)
    counts_nWW = count_ids(key_G, n * W * W + 1)[:-1].view(n, W, W).tolist()

    # this rank's sent rows chunk-major (a stable sort: destination, slot, position kept inside)
    first, TK = group.routing.first_token(r) * K, T * K
    mine_G = group.kept_G & (group.src_G == r)
    chunk_A = torch.zeros(TK + 1, dtype=torch.long, device=device)
    chunk_A.scatter_(0, torch.where(mine_G, group.order_G - first, TK), chunk_G)
    assign_M = plan.assign_M[torch.sort(chunk_A[plan.assign_M], stable=True).indices]
    row_A = torch.zeros(TK, dtype=torch.long, device=device)
    row_A[assign_M] = torch.arange(assign_M.numel(), device=device)
    plan = dataclasses.replace(plan, assign_M=assign_M, row_A=row_A)

    # the received rows chunk by chunk (each chunk arrives by source rank, then slot, position)
    got = [0]
    for i in range(n):
        got.append(got[-1] + sum(counts_nWW[i][s][r] for s in range(W)))
    local_R = received.local_R[torch.sort(chunk_of_slot(received.local_R, bounds), stable=True).indices]
    chunk_e = chunk_of_slot(torch.arange(e, device=device), bounds)
    experts = call.experts
    ffn = ChunkedFFN(experts, received.counts_e, bounds, [got[i + 1] - got[i] for i in range(n)], x_TD) \
        if ChunkedFFN.eligible(experts, x_TD) else None
    fast = ffn is None and _fast_experts(experts)
    if fast:  # one split per weight (its backward is one cat), not a slice per chunk
        widths = [bounds[i + 1] - bounds[i] for i in range(n)]
        w_in, w_out, b_in, b_out = autocast_cast(x_TD, experts.w_in, experts.w_out, experts.b_in, experts.b_out)
        weights = [t.split(widths) if t is not None else [None] * n for t in (w_in, w_out, b_in, b_out)]
        options = experts.ffn_options()

    def compute(i: int, recv_RD: torch.Tensor) -> torch.Tensor:
        """Chunk ``i``'s expert outputs, in the order its rows arrived."""
        by_slot = torch.sort(local_R[got[i] : got[i + 1]], stable=True).indices
        if ffn is not None:
            return ffn(i, recv_RD, by_slot)
        rows = permute_rows(recv_RD, by_slot)
        a, b = bounds[i], bounds[i + 1]
        if fast and rows.shape[0] > 0:
            (rows_c,) = autocast_cast(rows, rows)
            out = grouped_ffn(rows_c, received.counts_e[a:b], *(w[i] for w in weights), **options)
        else:  # the whole module (also: no rows, where it keeps every weight in the graph)
            out = experts(rows, torch.where(chunk_e == i, received.counts_e, 0))
        return permute_rows(out, inverse_permutation(by_slot))

    cx = chunked_exchange(where.exchange, counts_nWW)
    cx.scatter(send_rows(x_TD, plan.assign_M, plan.row_A, plan.kept_A, plan.weights_TK, plan.weight_at))
    for i in range(n):
        cx.send_home(i, compute(i, cx.receive(i)))
    return combine_rows(cx.home(), plan)
