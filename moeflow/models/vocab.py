"""Vocabulary-parallel embedding and output projection with a vocabulary-parallel cross-entropy
(model parallelism; their collectives are ``moeflow.parallel.vocab``).

Legend (moeflow.types, plus): ``V`` vocabulary size, ``v`` rows of the vocabulary held here
(``[start, start+v)``, the ranks' parts differ by at most one row), T tokens of this rank,
N tokens of the whole group (every rank's, in rank order).

Large embedding tables are split by rows over a group (SE-MoE's partitioned embeddings,
Megatron's ``VocabParallelEmbedding``). Unlike tensor parallelism, the ranks of an expert-parallel
group see *different* tokens (they are data parallel outside the experts), so:

- Embedding: every rank all-gathers the group's token ids (small), looks up the rows it holds
  (zeros for the others) for all ``N`` tokens, and the partial rows are summed onto each token's
  own rank with one uneven all-to-all (a reduce-scatter; gloo has none for uneven parts). The
  backward is the reverse exchange, so each shard gets the gradient of every rank's tokens.
- Output projection + loss: the hidden states are all-gathered (``N x D``, differentiable), each
  rank computes logits for its ``v`` vocabulary rows only (``[N, v]``: as many numbers as the
  unsplit ``[T, V]``), and the cross-entropy is assembled from three all-reduces (max, sum of
  exponentials, target logit). The full ``[N, V]`` logits never exist.

Each shard's gradient is the sum over every rank's loss, like an expert's: the parameters are
tagged ``moeflow_vocab_shard`` and excluded from ``dense_parameters`` (not averaged again), and
``clip_grad_norm_`` counts them once across the group. Checkpoints hold the gathered, unsplit
tables (and optimizer state), so they load into split and unsplit models alike. The results
equal the unsplit model's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeflow.parallel.comm import ProcessGroup, all_gather_rows, all_to_all_rows, group_rank, group_size
from moeflow.parallel.dcp.guard import mark_rank_local
from moeflow.parallel.vocab import (gather_tokens, group_tokens, mark_vocab_shard, sum_to_owners, vocab_cross_entropy,
                                    vocab_range)

__all__ = ["VocabParallelEmbedding", "VocabParallelHead", "vocab_parallel", "vocab_range"]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split over ``group`` (see module docstring).

    Build it from the full table (the same on every rank): ``VocabParallelEmbedding(weight_VD,
    group)`` keeps this rank's rows. ``forward(ids)`` -> ``[*ids.shape, D]``, the same values as
    the full table; ids outside ``[0, V)`` raise ``ValueError``.
    """

    def __init__(self, weight_VD: torch.Tensor, group: ProcessGroup | None = None) -> None:
        super().__init__()
        if weight_VD.dim() != 2:
            raise ValueError(f"weight_VD must be [vocab, dim], got shape {tuple(weight_VD.shape)}")
        self.group = group
        self.rank, self.world = group_rank(group), group_size(group)
        self.num_embeddings, self.embedding_dim = weight_VD.shape
        if self.num_embeddings < self.world:
            raise ValueError(f"vocab size {self.num_embeddings} is smaller than the group size {self.world}")
        self.start, count = vocab_range(self.num_embeddings, self.rank, self.world)
        self.weight = mark_vocab_shard(nn.Parameter(weight_VD.detach()[self.start : self.start + count].clone()),
                                       self.start, self.num_embeddings)
        self.register_state_dict_post_hook(mark_rank_local)  # DCP refuses the rows in model.state_dict()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.start}, {self.start + self.weight.shape[0]})"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"ids must be int64/int32, got {ids.dtype}")
        ids_T = ids.reshape(-1).to(torch.long)
        if ids_T.numel() and (int(ids_T.min()) < 0 or int(ids_T.max()) >= self.num_embeddings):
            raise ValueError(f"ids must lie in [0, {self.num_embeddings}), got range "
                             f"[{int(ids_T.min())}, {int(ids_T.max())}]")
        parts = all_gather_rows(ids_T.unsqueeze(1), self.group)
        tokens_W = [p.shape[0] for p in parts]
        all_ids_N = torch.cat(parts).view(-1)
        local_N = all_ids_N - self.start
        here_N = (local_N >= 0) & (local_N < self.weight.shape[0])
        rows_ND = F.embedding(local_N.clamp(0, self.weight.shape[0] - 1), self.weight)
        rows_ND = rows_ND * here_N.unsqueeze(1).to(rows_ND.dtype)
        out_TD = sum_to_owners(rows_ND, tokens_W, self.rank, self.group)
        return out_TD.view(*ids.shape, self.embedding_dim)


class VocabParallelHead(nn.Module):
    """Output projection over a vocabulary split like ``VocabParallelEmbedding`` (``weight_vD``:
    this rank's rows; pass the embedding's parameter to tie them).

    - ``cross_entropy(h_TD, targets_T)`` -> per-token losses ``[T]`` of this rank's tokens (fp32
      or wider), without building full logits (module docstring).
    - ``forward(h)`` -> full logits ``[..., V]`` of this rank's tokens (gathers the hidden states,
      then sends every rank its tokens' columns; for sampling and evaluation: the training loss
      should use ``cross_entropy``, which never builds them).
    """

    def __init__(self, weight_vD: nn.Parameter, *, vocab_size: int, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.rank, self.world = group_rank(group), group_size(group)
        self.vocab_size = vocab_size
        self.start, count = vocab_range(vocab_size, self.rank, self.world)
        if weight_vD.shape[0] != count:
            raise ValueError(f"weight_vD has {weight_vD.shape[0]} rows; rank {self.rank} of {self.world} holds "
                             f"{count} of vocab_size={vocab_size}")
        self.weight = mark_vocab_shard(weight_vD, self.start, vocab_size)
        self.register_state_dict_post_hook(mark_rank_local)  # DCP refuses the rows in model.state_dict()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h_TD = h.reshape(-1, h.shape[-1])
        T, W = h_TD.shape[0], self.world
        tokens_W = group_tokens(T, self.group, h_TD.device)
        h_ND = gather_tokens(h_TD, tokens_W, self.group)
        counts = [vocab_range(self.vocab_size, r, W)[1] for r in range(W)]
        logits_Nv = F.pad(h_ND @ self.weight.t(), (0, max(counts) - self.weight.shape[0]))  # equal widths
        # each rank's tokens' columns back to it: [W, T, v_max] -> the valid columns in rank order
        mine_WTv = all_to_all_rows(logits_Nv, tokens_W, [T] * W, self.group).view(W, T, max(counts))
        logits_TV = torch.cat([mine_WTv[r, :, : counts[r]] for r in range(W)], dim=1)
        return logits_TV.reshape(*h.shape[:-1], self.vocab_size)

    def cross_entropy(self, h_TD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
        if h_TD.dim() != 2 or targets_T.shape != h_TD.shape[:1]:
            raise ValueError(f"h_TD must be [T, D] and targets_T [T], got {tuple(h_TD.shape)} and {tuple(targets_T.shape)}")
        targets_T = targets_T.to(torch.long)
        parts = all_gather_rows(targets_T.unsqueeze(1), self.group)
        tokens_W = [p.shape[0] for p in parts]
        targets_N = torch.cat(parts).view(-1)
        h_ND = gather_tokens(h_TD, tokens_W, self.group)
        logits_Nv = h_ND @ self.weight.t()
        logits_Nv = logits_Nv.to(torch.promote_types(logits_Nv.dtype, torch.float32))
        loss_N = vocab_cross_entropy(logits_Nv, targets_N, self.start, self.group)
        first = sum(tokens_W[: self.rank])
        return loss_N[first : first + h_TD.shape[0]]


def vocab_parallel(model: nn.Module, group: ProcessGroup | None = None) -> nn.Module:
    """Split ``model.embed`` (``nn.Embedding``) and ``model.lm_head`` (``nn.Linear`` without bias)
    over ``group`` by vocabulary rows, keeping them tied when they were (``MoEGPT`` and any model
    with those two attributes; ``MoEGPT.loss`` then uses the vocabulary-parallel cross-entropy).
    Every rank must hold the same full weights first (same seed or same checkpoint). Returns
    ``model``, changed in place."""
    embed, head = getattr(model, "embed", None), getattr(model, "lm_head", None)
    if not isinstance(embed, nn.Embedding) or not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"vocab_parallel needs model.embed (nn.Embedding) and model.lm_head (nn.Linear, no bias); "
                        f"got {type(embed).__name__} and {type(head).__name__}")
    tied = head.weight is embed.weight
    model.embed = VocabParallelEmbedding(embed.weight, group)
    V = embed.num_embeddings
    if tied:
        weight = model.embed.weight
    else:
        start, count = vocab_range(V, model.embed.rank, model.embed.world)
        weight = nn.Parameter(head.weight.detach()[start : start + count].clone())
    model.lm_head = VocabParallelHead(weight, vocab_size=V, group=group)
    return model
