"""The collectives of vocabulary parallelism (the modules are ``moeflow.models.vocab``).

Legend (moeflow.types, plus): ``V`` vocabulary size, ``v`` rows of the vocabulary held here
(``[start, start+v)``, the ranks' parts differ by at most one row), T tokens of this rank,
N tokens of the whole group (every rank's, in rank order).

The ranks of an expert-parallel group see *different* tokens, so a vocabulary-split table is
used through token exchanges: every rank's rows gathered in rank order (``gather_tokens``,
differentiable), partial rows summed onto each token's own rank (``sum_to_owners``: a
reduce-scatter of uneven parts, which gloo lacks), and the cross-entropy assembled from three
all-reduces over vocabulary-split logits (``vocab_cross_entropy``), so the full ``[N, V]`` logits
never exist. A shard's parameter is tagged (``mark_vocab_shard``) with where its rows start and the
whole table's rows: gradients, checkpoints and DCP read the tags, not the module's type.
"""

from __future__ import annotations

import torch
from torch import nn

from moeflow.parallel.comm import ProcessGroup, all_gather_rows, all_reduce_max, all_reduce_sum, all_to_all_rows

__all__ = ["vocab_range", "group_tokens", "gather_tokens", "sum_to_owners", "vocab_cross_entropy",
           "mark_vocab_shard", "gather_vocab_weight"]


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, count)`` of the vocabulary rows rank ``rank`` of ``world`` holds."""
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def group_tokens(n: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's token count, in rank order (one small all-gather; a host read of the counts,
    which the uneven exchanges need as split sizes)."""
    sizes = all_gather_rows(torch.tensor([[n]], dtype=torch.long, device=device), group)
    return [int(s) for s in torch.cat(sizes).view(-1)]


def gather_tokens(x_TX: torch.Tensor, tokens_W: list[int], group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows in rank order (``[N, ...]``), differentiable: the backward sends each
    rank the gradient rows of its own tokens from every rank and sums them."""
    W = len(tokens_W)
    send = x_TX.repeat(W, *([1] * (x_TX.dim() - 1)))
    return all_to_all_rows(send, [x_TX.shape[0]] * W, tokens_W, group)


def sum_to_owners(rows_NX: torch.Tensor, tokens_W: list[int], rank: int, group: ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter of uneven parts: rank ``r`` gets the sum over ranks of rows
    ``[offset_r, offset_r + T_r)``."""
    W, T = len(tokens_W), tokens_W[rank]
    recv = all_to_all_rows(rows_NX, tokens_W, [T] * W, group)
    return recv.view(W, T, *rows_NX.shape[1:]).sum(0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocabulary-split logits ``[N, v]`` (fp32 or wider).

    Forward: ``loss_n = log sum_V exp(z) - z[target]`` from a group max, a group sum of
    exponentials and a group sum of the target logit (held by one rank). Backward:
    ``dz = g * (softmax - onehot)`` on the local columns, with ``g`` the upstream gradient of
    every rank's tokens (each rank's loss depends on every shard), all-reduced first.
    """

    @staticmethod
    def forward(ctx, logits_Nv, targets_N, start, group):  # type: ignore[override]
        v = logits_Nv.shape[1]
        max_N = logits_Nv.max(dim=1).values if v else logits_Nv.new_full((logits_Nv.shape[0],), float("-inf"))
        all_reduce_max(max_N, group)
        exp_Nv = torch.exp(logits_Nv - max_N.unsqueeze(1))
        sum_N = exp_Nv.sum(dim=1)
        all_reduce_sum(sum_N, group)
        local_N = targets_N - start
        here_N = (local_N >= 0) & (local_N < v)
        idx_N = local_N.clamp(0, max(v - 1, 0))
        target_N = torch.where(here_N, logits_Nv.gather(1, idx_N.unsqueeze(1)).squeeze(1) if v else max_N * 0,
                               logits_Nv.new_zeros(()))
        all_reduce_sum(target_N, group)
        ctx.save_for_backward(exp_Nv / sum_N.unsqueeze(1), idx_N, here_N)
        ctx.group = group
        return torch.log(sum_N) + max_N - target_N

    @staticmethod
    def backward(ctx, grad_N):  # type: ignore[override]
        softmax_Nv, idx_N, here_N = ctx.saved_tensors
        grad_N = grad_N.contiguous().clone()
        all_reduce_sum(grad_N, ctx.group)
        grad_Nv = softmax_Nv * grad_N.unsqueeze(1)
        if grad_Nv.shape[1]:
            grad_Nv.scatter_add_(1, idx_N.unsqueeze(1), (-grad_N * here_N.to(grad_N.dtype)).unsqueeze(1))
        return grad_Nv, None, None, None


def vocab_cross_entropy(logits_Nv: torch.Tensor, targets_N: torch.Tensor, start: int,
                        group: ProcessGroup | None) -> torch.Tensor:
    """Per-token losses ``[N]`` of every rank's tokens from this rank's logit columns
    ``[start, start + v)`` (``_VocabParallelCrossEntropy``); differentiable in ``logits_Nv``."""
    return _VocabParallelCrossEntropy.apply(logits_Nv, targets_N, start, group)


def mark_vocab_shard(p: nn.Parameter, start: int, vocab_size: int) -> nn.Parameter:
    """Tag a vocabulary shard, where its rows start and the whole table's rows: gradients are
    summed over the group like an expert's (``gradients.dense_parameters`` leaves it out),
    checkpoints save the gathered table and load this slice of it, and DCP places it."""
    p.moeflow_vocab_shard = True  # type: ignore[attr-defined]
    p.moeflow_vocab_start = start  # type: ignore[attr-defined]
    p.moeflow_vocab_size = vocab_size  # type: ignore[attr-defined]
    return p


def gather_vocab_weight(weight_vD: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """The full ``[V, D]`` table from every rank's rows (for export)."""
    with torch.no_grad():
        return torch.cat(all_gather_rows(weight_vD, group))
