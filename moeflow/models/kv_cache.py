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

A *static* decode step (``StaticStep``, ``MoEGPT.decode_step``) has the same shapes at every
step, so ``torch.compile`` compiles it once and CUDA graphs can replay it: the step's column is
a device tensor ``pos``, its keys/values go into column ``pos`` of the whole cache
(``index_copy_``), and the queries attend over all ``L`` columns through a mask that hides the
pad columns and the columns not yet written (which hold zeros: ``KVCache(zeroed=True)``, so a
masked column never brings NaN from uninitialised memory). Nothing in it reads a value on the
host.

Legend: ``B`` rows, ``G`` key/value heads, ``L`` cache capacity (columns), ``S`` columns of
this call, ``Hd`` head dim, ``T = B*S`` token slots of this call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KVCache", "StepInputs", "step_inputs", "StaticStep", "static_step"]


class KVCache:
    """Per block, keys and values ``[B, G, L, Hd]`` preallocated for ``L = capacity`` columns;
    ``length`` columns are filled (the same for every row: rows are left-padded). ``cos_LH``
    and ``sin_LH`` are the rotary tables of positions ``0 .. L-1`` (``MoEGPT.new_cache``
    computes them once per generation, not per step). ``zeroed``: the columns start as zeros
    (a static step attends over all of them, the unwritten ones masked)."""

    def __init__(self, *, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 pad_B: torch.Tensor, cos_LH: torch.Tensor, sin_LH: torch.Tensor,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 zeroed: bool = False) -> None:
        if cos_LH.shape != (capacity, head_dim) or sin_LH.shape != (capacity, head_dim):
            raise ValueError(f"cos_LH and sin_LH must be [{capacity}, {head_dim}], got {tuple(cos_LH.shape)}, "
                             f"{tuple(sin_LH.shape)}")
        self.cos_LH, self.sin_LH = cos_LH, sin_LH
        shape = (batch, kv_heads, capacity, head_dim)
        make = torch.zeros if zeroed else torch.empty
        self.k = [make(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [make(shape, device=device, dtype=dtype) for _ in range(n_layers)]
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

    def write_at(self, layer: int, pos: torch.Tensor, k_BG1H: torch.Tensor, v_BG1H: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one column's keys/values at column ``pos`` (a 0-dim int64 device tensor) of
        block ``layer`` and return the whole cache ``[B, G, L, Hd]`` (a static step's shapes)."""
        index = pos.reshape(1)
        self.k[layer].index_copy_(2, index, k_BG1H)
        self.v[layer].index_copy_(2, index, v_BG1H)
        return self.k[layer], self.v[layer]

    def reset(self, pad_B: torch.Tensor) -> None:
        """Empty the cache for new rows of the same count (``pad_B``), in place: the same
        tensors (CUDA graphs replay on their addresses), zeroed."""
        if pad_B.shape != self.pad_B.shape:
            raise ValueError(f"pad_B must have shape {tuple(self.pad_B.shape)}, got {tuple(pad_B.shape)}")
        for t in (*self.k, *self.v):
            t.zero_()
        self.pad_B.copy_(pad_B)
        self.max_pad = int(self.pad_B.max()) if self.batch else 0
        self.length = 0

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


@dataclass(frozen=True)
class StaticStep:
    """What every block of one static decode step shares (``static_step``): ``pos`` (0-dim
    int64) the column written, ``cos/sin [B, 1, 1, Hd]`` the rotary tables at each row's
    position ``pos - pad_B``, ``mask [B, 1, 1, L]`` (True = attend) the real columns up to
    ``pos``."""

    cache: KVCache
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor


def static_step(cache: KVCache, pos: torch.Tensor) -> StaticStep:
    """``StaticStep`` of a one-column step writing column ``pos`` (a 0-dim int64 tensor on the
    cache's device, ``pos < cache.capacity``: the caller keeps count). Every shape depends on
    the cache alone; no value is read on the host."""
    L, B = cache.capacity, cache.batch
    key_L = torch.arange(L, device=cache.pad_B.device)
    pos_B = (pos - cache.pad_B).clamp(min=0)
    cos = cache.cos_LH.index_select(0, pos_B).view(B, 1, 1, -1)
    sin = cache.sin_LH.index_select(0, pos_B).view(B, 1, 1, -1)
    mask = ((key_L.unsqueeze(0) >= cache.pad_B.unsqueeze(1)) & (key_L <= pos)).view(B, 1, 1, L)
    return StaticStep(cache=cache, pos=pos, cos=cos, sin=sin, mask=mask)

