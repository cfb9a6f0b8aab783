"""What a rebalancing run (``rebalance_every``) keeps across a restart: the experts' placement
and the load seen since the last move.

Without them a resumed run would start from the contiguous placement with an empty load window,
so its next move would be planned from fewer steps than the uninterrupted run's and the two runs
would part. Every checkpoint of such a run records, in its ``extra["rebalance"]``:

- ``world``: the number of ranks the placements are for;
- ``placements``: per MoE layer, the ``slots`` and ``shares`` of its ``Placement``;
- ``window``: per MoE layer, the group's per-expert row counts since the last move
  (``[L][E]``, summed over the ranks; counts, so exact in float64).

A resume on the same number of ranks moves the experts back to the saved placements before the
weights are loaded (a checkpoint loads into any placement) and continues the window; on another
number of ranks the placements cannot apply and the experts start contiguous, but the window
(a per-expert total, whatever the world size) still carries over.
"""

from __future__ import annotations

import torch
from torch import nn

import moeflow
from moeflow.parallel import Placement, apply_placement, placement_of
from moeflow.parallel.comm import ProcessGroup, all_reduce_sum

__all__ = ["rebalance_record", "restore_rebalance"]


def rebalance_record(model: nn.Module, window_LE: torch.Tensor, group: ProcessGroup | None, world: int) -> dict:
    """The ``extra["rebalance"]`` of a checkpoint taken now (a collective: every rank calls it
    at the same step). ``window_LE``: this rank's counts since the last move."""
    layers = moeflow.moe_layers(model)
    placements = [placement_of(layer) for layer in layers]
    return {
        "world": world,
        "placements": [None if p is None else {"slots": [list(r) for r in p.slots],
                                               "shares": None if p.shares is None else [list(r) for r in p.shares]}
                       for p in placements],
        "window": all_reduce_sum(window_LE.clone(), group).tolist(),
    }


def restore_rebalance(model: nn.Module, record: object, *, world: int, rank: int, window_LE: torch.Tensor,
                      slots: int | None = None) -> bool:
    """Continue a rebalancing run from a checkpoint's ``record`` (``rebalance_record``; None for
    checkpoints without one): on ``world`` ranks as saved, move the experts to the saved
    placements (call before the weights are loaded and before the optimizer is built); put the
    saved window into rank 0's ``window_LE`` (the others start at zero: a move sums the ranks).
    ``slots``: the slots per rank this run moves experts into (``--expert-slots``): a saved
    placement of another slot count is not applied (the run starts contiguous and its next move
    uses its own count). Returns whether the placements were applied. Raises ``ValueError`` for
    a record that does not fit the model."""
    if record is None:
        return False
    if not isinstance(record, dict) or not {"world", "placements", "window"} <= set(record):
        raise ValueError(f"the checkpoint's rebalance record is malformed: {str(record)[:200]}")
    layers = moeflow.moe_layers(model)
    window = torch.as_tensor(record["window"], dtype=window_LE.dtype, device=window_LE.device)
    if tuple(window.shape) != tuple(window_LE.shape) or len(record["placements"]) != len(layers):
        raise ValueError(f"the checkpoint's rebalance record is for {len(record['placements'])} MoE layers with a "
                         f"{tuple(window.shape)} window; the model has {len(layers)} layers, {tuple(window_LE.shape)}")
    window_LE.zero_()
    if rank == 0:
        window_LE.copy_(window)
    placements = record["placements"]
    for i, p in enumerate(placements):
        if p is not None and not (isinstance(p, dict) and isinstance(p.get("slots"), list) and "shares" in p):
            raise ValueError(f"the checkpoint's rebalance record is malformed: placements[{i}] = {str(p)[:200]}")
    if record["world"] != world or any(p is None for p in placements):
        return False
    if slots is not None and any(len(p["slots"][0]) != slots for p in placements):
        return False
    E = int(window_LE.shape[1])
    apply_placement(model, [Placement(E, p["slots"], p["shares"]) for p in placements])
    return True
