"""``tutel.net``: the collectives Tutel's examples call, on ``moeflow.parallel``.

Only what code written for Tutel uses between its MoE calls (``helloworld*.py``): world size and
rank, ``simple_all_reduce`` (gradient averaging), the differentiable ``all_to_all`` between the
token layout ``[E, C, D]`` and the expert layout ``[e, W*C, D]``, ``zero_gather`` (parameters
sharded over ranks, gathered for use) and ``create_groups_from_world``. Every collective runs
through ``moeflow.parallel`` (the one package that touches torch.distributed); with one process
each is the identity, as in Tutel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeflow.compat.tutel.system import TutelSession, create_groups_from_world
from moeflow.parallel.comm import all_gather_shards, all_reduce_sum, all_to_all_rows, process_position, sync

__all__ = [
    "get_world_size",
    "get_world_rank",
    "barrier",
    "simple_all_reduce",
    "all_to_all",
    "zero_gather",
    "create_groups_from_world",
    "TutelSession",
]


def get_world_size(group: object | None = None) -> int:
    """Processes in ``group`` (the default group for None); 1 without torch.distributed."""
    return process_position(group)[1]  # type: ignore[arg-type]


def get_world_rank(group: object | None = None) -> int:
    """This process's rank in ``group``; 0 without torch.distributed."""
    return process_position(group)[0]  # type: ignore[arg-type]


def barrier(group: object | None = None) -> None:
    if get_world_size(group) > 1:
        sync(group)  # type: ignore[arg-type]


def simple_all_reduce(input: torch.Tensor, group: object | None = None, op: object | None = None,
                      inplace: bool = False) -> torch.Tensor:
    """The sum of ``input`` over ``group`` (not differentiable): a new tensor unless ``inplace``.
    ``op``: only a sum is supported (None or ``ReduceOp.SUM``; Tutel's default)."""
    if op is not None and str(op).rsplit(".", 1)[-1].upper() != "SUM":
        raise ValueError(f"simple_all_reduce supports only op=SUM, got op={op!r}")
    if get_world_size(group) == 1:
        return input
    out = input if inplace else input.clone(memory_format=torch.contiguous_format)
    return all_reduce_sum(out, group)  # type: ignore[arg-type]


def all_to_all(input: torch.Tensor, input_split_dim: int, output_concat_dim: int, group: object | None = None,
               use_2dh: bool = False) -> torch.Tensor:
    """Tutel's ``all_to_all(x, a, b)``: ``x`` is cut into W equal blocks along dim ``b``, block
    ``d`` goes to rank ``d``, and the blocks received (in rank order) are joined along dim ``a``.

    ``all_to_all(y, 1, 0)`` turns Tutel's dispatched ``[E, C, D]`` (E = W*e experts) into this
    rank's expert input ``[e, W*C, D]``; ``all_to_all(y, 0, 1)`` is its inverse. Differentiable
    (the backward is the reverse exchange). ``use_2dh`` is refused (see ``moe_layer``).
    """
    if use_2dh:
        raise ValueError("use_2dh=True is not supported by moeflow.compat.tutel.net.all_to_all")
    dims = input.dim()
    a, b = input_split_dim % dims, output_concat_dim % dims
    W = get_world_size(group)
    if a == b or W == 1:
        return input
    if input.shape[b] % W:
        raise ValueError(f"all_to_all: dim {b} of shape {tuple(input.shape)} does not split into {W} equal blocks")
    blocks = input.chunk(W, dim=b)
    rows_WN = torch.stack([blk.reshape(-1) for blk in blocks])
    got_WN = all_to_all_rows(rows_WN, [1] * W, [1] * W, group)  # type: ignore[arg-type]
    return torch.cat([row.view(blocks[0].shape) for row in got_WN.unbind(0)], dim=a)


def zero_gather(input: torch.Tensor, full_shape: Sequence[int] | None = None, group: object | None = None) -> torch.Tensor:
    """Every rank's equal shard of a flat parameter, joined and cut to ``full_shape`` (default:
    ``input.shape`` with dim 0 times W). Differentiable: the backward sums the gradient over
    the ranks and keeps this rank's shard (Tutel's fused reduce-scatter)."""
    W = get_world_size(group)
    if full_shape is None:
        full_shape = [input.shape[0] * W, *input.shape[1:]]
    numel = 1
    for size in full_shape:
        numel *= int(size)
    joined = input if W == 1 else all_gather_shards(input.reshape(1, -1), group)  # type: ignore[arg-type]
    return joined.reshape(-1)[:numel].view(*full_shape)
