"""Hidden slices of experts moved between ranks for one call (legend: moeflow.types).

The hidden units of an FFN expert are independent, so an expert split into ``n`` slices of
``H/n`` hidden units computes the same output as the sum of its slices' outputs. The sharded
and hybrid modes run every expert as slices spread over the ranks for one call: the slices
travel from the experts' owners (contiguous blocks of whole experts) in one differentiable
all-to-all, whose backward returns each slice's gradient to its owner.

Slice ``v = j*E + x`` is hidden part ``j`` of expert ``x`` (slice-major, the layout of
``GroupedExperts.hidden_slices``): rank ``q`` holds slices ``[q*E*n/W, (q+1)*E*n/W)``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from moeflow.experts.ffn import GroupedExperts
from moeflow.parallel.comm import all_to_all_rows

__all__ = ["gather_slices", "slice_routes"]


@lru_cache(maxsize=None)
def slice_routes(E: int, W: int, rank: int, n: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Which slices this rank sends and receives when rank ``x // (E/W)`` owns expert ``x``:
    ``(local expert and part j of each sent slice, in destination order; send and receive
    splits; the receive position of each held slice)``. Depends only on the sizes, so it is
    computed once."""
    e, e_held = E // W, E * n // W
    owner = lambda v: (v % E) // e  # noqa: E731
    sent = [v for d in range(W) for v in range(d * e_held, (d + 1) * e_held) if owner(v) == rank]
    send_split = [sum(1 for v in range(d * e_held, (d + 1) * e_held) if owner(v) == rank) for d in range(W)]
    held = range(rank * e_held, (rank + 1) * e_held)
    recv_split = [sum(1 for v in held if owner(v) == src) for src in range(W)]
    arrival = [v - rank * e_held for src in range(W) for v in held if owner(v) == src]
    position = [0] * e_held
    for i, slot in enumerate(arrival):
        position[slot] = i
    return [v % E - rank * e for v in sent], [v // E for v in sent], send_split, recv_split, position


def gather_slices(experts: GroupedExperts, n: int, group: dist.ProcessGroup | None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This rank's hidden slices of the slice-major layout over the group, from the contiguous
    expert shards: ``(w_in [e, D, F/n], w_out [e, H/n, D], b_in [e, F/n] or None)`` with
    ``e = E * n / W`` slices held here; gated activations keep their (gate, up) halves. One
    gather of the slices to send and one differentiable all-to-all. ``n = W`` gives every rank
    part ``rank`` of every expert (the sharded-expert mode)."""
    W, rank, e_owned, H, D = dist.get_world_size(group), dist.get_rank(group), experts.num_experts, experts.hidden, experts.dim
    h, halves = H // n, experts.halves
    local, part, send_split, recv_split, position = slice_routes(e_owned * W, W, rank, n)
    device = experts.w_in.device
    sent_local = torch.tensor(local, dtype=torch.long, device=device)
    sent_part = torch.tensor(part, dtype=torch.long, device=device)
    # ``experts.ffn.cut_hidden_slice``'s layout, gathered for all (expert, part) pairs at once
    pieces = [experts.w_in.unflatten(-1, (halves, n, h))[sent_local, :, :, sent_part].reshape(len(local), -1),
              experts.w_out.unflatten(1, (n, h))[sent_local, sent_part].reshape(len(local), -1)]
    if experts.b_in is not None:
        pieces.append(experts.b_in.unflatten(-1, (halves, n, h))[sent_local, :, sent_part].reshape(len(local), -1))
    recv = all_to_all_rows(torch.cat(pieces, dim=1), send_split, recv_split, group)
    held = recv.index_select(0, torch.tensor(position, dtype=torch.long, device=device))
    e, n_in, n_out = len(position), D * halves * h, h * D
    w_in = held[:, :n_in].view(e, D, halves * h)
    w_out = held[:, n_in : n_in + n_out].view(e, h, D)
    b_in = held[:, n_in + n_out :] if experts.b_in is not None else None
    return w_in, w_out, b_in
