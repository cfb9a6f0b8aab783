"""``tutel.jit_kernels.gating``: the slot-location scan.

Tutel's JIT kernel is a cumulative sum over a one-hot ``[T, E]`` mask; here it is
``torch.cumsum`` (moeflow's own dispatch never builds that mask: see ``moeflow.dispatch.slots``).
"""

from __future__ import annotations

import torch

__all__ = ["fast_cumsum_sub_one"]


def fast_cumsum_sub_one(data: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``cumsum(data, dim) - 1``.

    For a one-hot mask ``mask_TE`` (token t chose expert e) the entry at ``[t, e]`` is the
    0-based position of token t among the tokens that chose e, in token order: its slot.
    Entries where ``mask_TE`` is 0 are meaningless (Tutel multiplies them away).
    """
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"data must be a torch.Tensor, got {type(data).__name__}")
    if dim != 0:
        raise ValueError(f"dim must be 0 (as in Tutel), got {dim!r}")
    return torch.cumsum(data, dim=0) - 1
