"""Key/value cache for incremental decoding of ``MoEGPT`` (legend below).

Generation runs the prompt once (*prefill*), then one token per row at a time (*decode*):
each block's attention writes the new keys and values behind the cached ones and attends over
all of them, so a step costs one token's work per row instead of re-running the whole window.

Rows of a batch are left-padded to one length (``pad_B`` pad columns in front of row ``b``),
so every row writes its new token into the same cache column. A pad column is never a key for
a real token (``attention_mask``), its rotary position does not count (row ``b``'s token in
column ``j`` sits at position ``j - pad_B[b]``), and the FFN/MoE of every block sees only the
real tokens (``StepInputs.real_T``): padding takes no expert capacity and no work, and with
dropless experts a batch gives each row what it gets alone (up to rounding).

Legend: ``B`` rows, ``G`` key/value heads, ``L`` cache capacity (columns), ``S`` columns of
this call, ``Hd`` head dim, ``T = B*S`` token slots of this call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCache", "StepInputs", "step_inputs"]


class KVCache:
    """Per block, keys and values ``[B, G, L, Hd]`` preallocated for ``L = capacity`` columns;
    ``length`` columns are filled (the same for every row: rows are left-padded). ``cos_LH``
    and ``sin_LH`` are the rotary tables of positions ``0 .. L-1`` (``MoEGPT.new_cache``
    computes them once per generation, not per step)."""

    def __init__(self, *, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 pad_B: torch.Tensor, cos_LH: torch.Tensor, sin_LH: torch.Tensor,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if cos_LH.shape != (capacity, head_dim) or sin_LH.shape != (capacity, head_dim):
            raise ValueError(f"cos_LH and sin_LH must be [{capacity}, {head_dim}], got {tuple(cos_LH.shape)}, "
                             f"{tuple(sin_LH.shape)}")
        self.cos_LH, self.sin_LH = cos_LH, sin_LH
        shape = (batch, kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0
        if pad_B.shape != (batch,):
            raise ValueError(f"pad_B must have shape ({batch},), got {tuple(pad_B.shape)}")
        self.pad_B = pad_B.to(device=device, dtype=torch.long)
        self.max_pad = int(self.pad_B.max()) if batch else 0  # read once, not per step

    @property
    def batch(self) -> int:
        return self.pad_B.shape[0]

    def write(self, layer: int, start: int, k_BGSH: torch.Tensor, v_BGSH: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values at columns ``[start, start + S)`` of block ``layer`` and
        return views of the filled columns ``[B, G, start + S, Hd]`` (no copy of the old ones)."""
        end = start + k_BGSH.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} columns; writing up to column {end}")
        self.k[layer][:, :, start:end] = k_BGSH
        self.v[layer][:, :, start:end] = v_BGSH
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def keep_rows(self, rows_B: torch.Tensor) -> None:
        """Keep only rows ``rows_B`` (an index tensor), in that order (finished rows leave the
        batch, so later steps do not spend work on them)."""
        self.k = [t.index_select(0, rows_B) for t in self.k]
        self.v = [t.index_select(0, rows_B) for t in self.v]
        self.pad_B = self.pad_B.index_select(0, rows_B)
        self.max_pad = int(self.pad_B.max()) if rows_B.numel() else 0


@dataclass(frozen=True)
class StepInputs:
    """What every block of one cached call shares (built once per call by ``step_inputs``).

    ``cos/sin [B, 1, S, Hd]``: the rotary tables at each row's positions. ``mask [B, 1, S,
    start+S]`` (bool, True = attend) or None when no row is padded, then ``causal`` tells
    SDPA to apply the causal mask itself (a prefill) or that every cached key is visible (a
    one-token decode). ``real_T``: flat indices of the real tokens, None when all are real."""

    cache: KVCache
    start: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    real_T: torch.Tensor | None


def step_inputs(cache: KVCache, seq_len: int) -> StepInputs:
    """``StepInputs`` of a call writing ``seq_len`` columns behind the ``cache.length`` filled
    ones: a prefill (``seq_len`` columns into an empty cache) or a decode step (one column)."""
    start, S, device = cache.length, seq_len, cache.pad_B.device
    if start and S != 1:
        raise ValueError(f"a call on a filled cache (length {start}) decodes one column, got seq_len={S}")
    if start + S > cache.capacity:
        raise ValueError(f"KV cache holds {cache.capacity} columns; {start} are filled, {S} more do not fit")
    cos_LH, sin_LH = cache.cos_LH, cache.sin_LH
    if not cache.max_pad:
        cos, sin = cos_LH[start:start + S], sin_LH[start:start + S]
        return StepInputs(cache=cache, start=start, cos=cos, sin=sin, mask=None, causal=S > 1, real_T=None)
    col_S = torch.arange(start, start + S, device=device)
    pad_B1 = cache.pad_B.unsqueeze(1)
    pos_BS = (col_S.unsqueeze(0) - pad_B1).clamp(min=0)  # pad columns take position 0 (unused)
    cos, sin = cos_LH[pos_BS].unsqueeze(1), sin_LH[pos_BS].unsqueeze(1)
    key_L = torch.arange(start + S, device=device)
    # a real key at or before the query; a pad query attends to itself only (its row of the
    # softmax must not be empty, which would give NaN; its output is never read by a real token)
    visible_BSL = (key_L >= pad_B1.unsqueeze(2)) & (key_L <= col_S.unsqueeze(1))
    mask = (visible_BSL | (key_L == col_S.unsqueeze(1))).unsqueeze(1)
    # decode columns lie behind every pad: all real, and no index (nor host sync) is needed
    real_T = None if start >= cache.max_pad else (col_S.unsqueeze(0) >= pad_B1).flatten().nonzero().squeeze(1)
    return StepInputs(cache=cache, start=start, cos=cos, sin=sin, mask=mask, causal=False, real_T=real_T)
