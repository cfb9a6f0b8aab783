"""The pipelined expert-parallel call, ``overlap_degree = n > 1`` (legend: moeflow.types, plus
``n`` chunks).

Chunk ``i`` holds, on every rank, the kept assignments of that rank's tokens ``[ceil(i*T_r/n),
ceil((i+1)*T_r/n))``. All chunks' send exchanges start asynchronously; then each chunk is
received, computed (rows grouped by local slot) and sent home asynchronously while the next
chunk's rows arrive, and its outputs are summed into its tokens as soon as they are home. In
backward the reverse exchanges are asynchronous too (``moeflow.parallel.comm``). A chunk's rows
are gathered straight from the tokens, so chunking adds no pass over the rows to the unchunked
call, only per-chunk index work and messages. The two-level exchange pipelines both phases:
chunk ``i+1``'s second phase is launched before chunk ``i``'s experts run.
"""

from __future__ import annotations

import torch

from moeflow.dispatch.combine import sum_token_rows
from moeflow.kernels.gather import gather_rows
from moeflow.parallel.exchange.assignment import GroupAssignment
from moeflow.parallel.exchange.plan import exchange_plan, inverse_permutation, permute_rows, send_rows
from moeflow.parallel.strategies.base import Call, ExpertGroup

__all__ = ["run_pipelined"]


def run_pipelined(where: ExpertGroup, call: Call, group: GroupAssignment, chunks: int) -> torch.Tensor:
    """``y_TD`` of ``call`` in ``chunks`` pipelined chunks (see module docstring)."""
    W, r, e = where.world, where.rank, group.slots_per_rank
    received = group.receive_side(r)
    plan = exchange_plan(group, r, call.routing, dtype=call.x_TD.dtype, config=where.dispatch, received=received)
    x_TD, K, T = call.x_TD, plan.top_k, plan.num_tokens
    device, D = x_TD.device, x_TD.shape[1]
    tokens_W = torch.tensor(group.routing.tokens_W, device=device)
    first_W = torch.cumsum(tokens_W, 0) - tokens_W

    def chunk_of(order: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Chunk of group assignments ``order`` of ranks ``src``: ``t_local * n // T_src``."""
        local_token = torch.div(order, K, rounding_mode="floor") - first_W[src]
        return torch.div(local_token * chunks, tokens_W.clamp(min=1)[src], rounding_mode="floor")

    kept = group.kept_G
    src_G, dst_G = group.src_G[kept], group.dst_G[kept]
    chunk_G = chunk_of(group.order_G[kept], src_G)
    counts_nWW = torch.bincount((chunk_G * W + src_G) * W + dst_G, minlength=chunks * W * W).view(chunks, W, W).tolist()
    chunk_R = chunk_of(received.order_R, received.src_R)
    # my tokens of chunk i: [bounds[i], bounds[i+1]) (t lies in chunk t*n // T)
    bounds = [-(-i * T // chunks) for i in range(chunks + 1)]
    chunk_M = torch.div(torch.div(plan.assign_M, K, rounding_mode="floor") * chunks, max(T, 1), rounding_mode="floor")

    def chunk_plan(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Chunk i's sent assignments (chunk-local ``t*K + k``, in send order), their rows by
        assignment, and the kept mask (None when nothing is dropped)."""
        t0, t1 = bounds[i], bounds[i + 1]
        assign_M = plan.assign_M[chunk_M == i] - t0 * K
        row_A = torch.zeros((t1 - t0) * K, dtype=torch.long, device=device)
        row_A[assign_M] = torch.arange(assign_M.numel(), device=device)
        kept_A = None if plan.kept_A is None else plan.kept_A[t0 * K : t1 * K]
        return assign_M, row_A, kept_A

    ex = where.exchange
    plans = [chunk_plan(i) for i in range(chunks)]
    # one split (its backward is one cat), not n slices (each slice's backward would zero-fill
    # and add a whole [T, D] gradient)
    sizes = [bounds[i + 1] - bounds[i] for i in range(chunks)]
    x_nTD, w_nTK = x_TD.split(sizes), plan.weights_TK.split(sizes)
    # every chunk's exchange starts now (two-level: its first phase); they complete in order
    started = [ex.start(send_rows(x_nTD[i], assign_M, row_A, kept_A, w_nTK[i], plan.weight_at), counts_nWW[i])
               for i, (assign_M, row_A, kept_A) in enumerate(plans)]
    started[0] = ex.relay(started[0])
    homes: list = []
    outs: list[torch.Tensor] = []

    def combine_chunk(i: int) -> None:  # chunk i's outputs are on their way home: sum them
        assign_M, row_A, kept_A = plans[i]
        rows_AD = gather_rows(ex.finish(homes[i]), row_A, kept_A, assign_M.view(-1, 1), None)
        outs.append(sum_token_rows(rows_AD.view(sizes[i], K, D), w_nTK[i], plan.weight_at))

    for i in range(chunks):
        if i + 1 < chunks:
            started[i + 1] = ex.relay(started[i + 1])
        recv_RD = ex.finish(started[i])
        local_R = received.local_R[chunk_R == i]
        by_slot = torch.sort(local_R, stable=True).indices
        expert_out = call.experts(permute_rows(recv_RD, by_slot), torch.bincount(local_R, minlength=e))
        back_RD = permute_rows(expert_out, inverse_permutation(by_slot))
        homes.append(ex.start(back_RD, [list(col) for col in zip(*counts_nWW[i])]))  # reverse routes
        if i:  # the previous chunk's outputs came home while this one was computed
            combine_chunk(i - 1)
    combine_chunk(chunks - 1)
    return torch.cat(outs)
