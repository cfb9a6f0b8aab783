"""The layout of hidden slices of grouped experts (legend: moeflow.types; ``H`` an expert's
hidden size, ``n`` slices).

The hidden units of an FFN are independent, so an expert splits into ``n`` slices of ``H / n``
units whose outputs add up to the expert's: ``GroupedExperts.hidden_slices``, the sharded and
hybrid expert-parallel strategies and world-size-independent checkpoints all cut and join them
here, so that there is one definition of which columns of ``w_in`` (gate and up alike) and which
rows of ``w_out`` slice ``j`` holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cut_hidden_slice", "join_hidden_slices"]


def cut_hidden_slice(name: str, full: torch.Tensor, n: int, j: int, halves: int) -> torch.Tensor:
    """Slice ``j`` of ``n`` of an expert tensor ``name``: ``"w_in"`` ``[..., D, halves*H]`` (the
    gate and up columns of hidden units ``[j*H/n, (j+1)*H/n)``) or ``"w_out"`` ``[..., H, D]``
    (those rows), or anything shaped like them (optimizer moments); leading dims (experts) are
    kept. The one definition of the slice layout (``GroupedExperts.hidden_slices`` uses it);
    ``join_hidden_slices`` inverts it."""
    if name == "w_in":
        F = full.shape[-1]
        return full.unflatten(-1, (halves, n, F // (halves * n)))[..., j, :].flatten(-2)
    if name == "w_out":
        return full.unflatten(-2, (n, full.shape[-2] // n))[..., j, :, :]
    raise ValueError(f"hidden slices exist for 'w_in' and 'w_out' only, got {name!r}")


def join_hidden_slices(name: str, slices: Sequence[torch.Tensor], halves: int) -> torch.Tensor:
    """One expert's whole tensor ``name`` from its ``n`` hidden slices in order (the inverse of
    ``cut_hidden_slice``)."""
    if name == "w_in":
        D, f = slices[0].shape
        parts = torch.stack([t.unflatten(-1, (halves, f // halves)) for t in slices], dim=2)  # [D, halves, n, h]
        return parts.reshape(D, halves * len(slices) * (f // halves))
    if name == "w_out":
        return torch.cat(list(slices), dim=0)
    raise ValueError(f"hidden slices exist for 'w_in' and 'w_out' only, got {name!r}")
