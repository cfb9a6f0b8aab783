"""The pipelined expert-parallel call, ``overlap_degree = n > 1`` (legend: moeflow.types, plus
``n`` chunks and ``e`` local slots).

Chunks are cut along the expert slots, not the tokens: chunk ``i`` holds the kept assignments
to the local slots ``[i*e//n, (i+1)*e//n)`` of every rank (``slot_chunks``; ``min(n, e)``
chunks, since a chunk without slots would carry nothing). So every expert's GEMM keeps all its
rows, as in the unchunked call, and chunking costs the GEMMs nothing (cutting the tokens instead
made each GEMM ``n`` times shorter). Only a rank holding one slot (``E = W``) has no slots to
cut: there chunk ``i`` is each rank's tokens ``[i*T_r/n, (i+1)*T_r/n)`` (the one way to
overlap anything there; its GEMMs are ``n`` times shorter, its weight gradients still one GEMM).
The exchange of chunk ``i+1`` runs while chunk ``i``'s experts compute:

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


def chunk_of_slot(local_N: torch.Tensor, slots: int, degree: int) -> torch.Tensor:
    """Chunk of each local slot in ``local_N`` under ``slot_chunks(slots, degree)``, by
    arithmetic (no tensor built from host values: on CUDA that copy waits for the device). With
    ``m = min(degree, slots)`` chunks, slot ``l`` is in the last chunk ``i`` with
    ``i * slots // m <= l``, which is ``((l + 1) * m - 1) // slots``."""
    m = min(degree, slots)
    return torch.div((local_N + 1) * m - 1, slots, rounding_mode="floor")


def _device_ints(values: list[int] | tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without waiting for it (on CUDA a pinned, non-blocking copy: a
    plain one would wait for the device's queued work)."""
    t = torch.tensor(values, dtype=torch.long, device="cpu")
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


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
    by_tokens = e == 1  # one slot per rank: nothing to cut along the slots, so cut the tokens
    n = chunks if by_tokens else len(bounds) - 1

    # the chunk of every group assignment, and every chunk's split sizes: one host read (dropped
    # assignments are counted in a last bin; no boolean index, which would read on the host too)
    if by_tokens:  # token t of its rank's T_src: chunk t * n // T_src
        tokens_W = _device_ints(group.routing.tokens_W, device)
        local_G = torch.div(group.order_G, K, rounding_mode="floor") - (torch.cumsum(tokens_W, 0) - tokens_W)[group.src_G]
        chunk_G = torch.div(local_G * n, tokens_W.clamp(min=1)[group.src_G], rounding_mode="floor")
    else:
        chunk_G = chunk_of_slot(group.slot_G - group.dst_G * e, e, chunks)
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
    rows_n = [got[i + 1] - got[i] for i in range(n)]
    if by_tokens:  # one slot: every chunk's rows are slot 0's (the arrival order is the slot order)
        local_R = received.local_R
        counts_n = [torch.full((1,), r, dtype=torch.long, device=device) for r in rows_n]  # (a fill: no copy)
    else:
        local_R = received.local_R[torch.sort(chunk_of_slot(received.local_R, e, chunks), stable=True).indices]
        chunk_e = chunk_of_slot(torch.arange(e, device=device), e, chunks)
        counts_n = [torch.where(chunk_e == i, received.counts_e, 0) for i in range(n)]
    experts = call.experts
    ffn = ChunkedFFN(experts, received.counts_e, None if by_tokens else bounds, rows_n, x_TD) \
        if ChunkedFFN.eligible(experts, x_TD) else None
    fast = ffn is None and _fast_experts(experts)
    if fast:  # one split per weight (its backward is one cat), not a slice per chunk
        widths = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        w_in, w_out, b_in, b_out = autocast_cast(x_TD, experts.w_in, experts.w_out, experts.b_in, experts.b_out)
        weights = [([t] * n if by_tokens else t.split(widths)) if t is not None else [None] * n
                   for t in (w_in, w_out, b_in, b_out)]
        options = experts.ffn_options()

    def compute(i: int, recv_RD: torch.Tensor) -> torch.Tensor:
        """Chunk ``i``'s expert outputs, in the order its rows arrived."""
        by_slot = torch.sort(local_R[got[i] : got[i + 1]], stable=True).indices
        if ffn is not None:
            return ffn(i, recv_RD, by_slot)
        rows = permute_rows(recv_RD, by_slot)
        if fast and rows.shape[0] > 0:
            a, b = (0, 1) if by_tokens else (bounds[i], bounds[i + 1])
            (rows_c,) = autocast_cast(rows, rows)
            out = grouped_ffn(rows_c, counts_n[i][a:b], *(w[i] for w in weights), **options)
        else:  # the whole module (also: no rows, where it keeps every weight in the graph)
            out = experts(rows, counts_n[i])
        return permute_rows(out, inverse_permutation(by_slot))

    cx = chunked_exchange(where.exchange, counts_nWW)
    cx.scatter(send_rows(x_TD, plan.assign_M, plan.row_A, plan.kept_A, plan.weights_TK, plan.weight_at))
    for i in range(n):
        cx.send_home(i, compute(i, cx.receive(i)))
    return combine_rows(cx.home(), plan)
