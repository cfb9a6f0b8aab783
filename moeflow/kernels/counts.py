"""Per-expert counts without a host synchronisation.

``torch.bincount`` reads the min and max of its input on the host on CUDA (two syncs per
call); a scatter-add into a fixed-size ``[E]`` tensor does not. Reference: ``torch.bincount``.
"""

from __future__ import annotations

import torch

__all__ = ["count_ids"]


def count_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``counts[e] = (ids == e).sum()`` as int64 ``[num_experts]``; ids must lie in ``[0, E)``."""
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.long))
