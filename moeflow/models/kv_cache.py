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

Blocks that attend through a sliding window (``AttentionConfig.slides``) keep every column
too and read a second mask, the first one narrowed to the last ``window`` columns of each
query (``q - k < window``, in columns, which within a row are positions); both masks are made
once per call (``step_inputs``) or step (``static_step``), never per block.

A cache's keys and values may differ in their trailing size (``k_dim``, ``v_dim``) and hold any
number of heads: grouped-query attention stores ``[B, G, L, Hd]`` twice, latent attention may
store its latent as the "keys" and its rotary part as the "values".

A *static* decode step (``StaticStep``, ``MoEGPT.decode_step``) has the same shapes at every
step, so ``torch.compile`` compiles it once and CUDA graphs can replay it: the step's column is
a device tensor ``pos``, its keys/values go into column ``pos`` of the whole cache
(``index_copy_``), and the queries attend over all ``L`` columns through a mask that hides the
pad columns and the columns not yet written (which hold zeros: ``KVCache(zeroed=True)``, so a
masked column never brings NaN from uninitialised memory). Nothing in it reads a value on the
host. ``pos`` may also be ``[B]``, a column per row (the decode slots of ``moeflow serve``, each
row a request of its own length): row ``b`` writes column ``pos[b]`` (a scatter), sits at
rotary position ``pos[b] - pad_B[b]`` and attends to its real columns up to ``pos[b]``.

A call may also append several columns to a filled cache (a prompt prefilled in chunks between
decode steps): the chunk's queries see every earlier column and, within the chunk, the columns
up to their own, through an explicit mask (SDPA's ``is_causal`` aligns its triangle to the top
left, right only when the chunk starts at column 0). ``KVCache.rows`` is a cache over some
rows of another one, sharing its storage: what a call on the view writes lands in the big
cache, and the view keeps its own ``length`` (a slot's prefill runs on its row's view).

Legend: ``B`` rows, ``G`` key/value heads, ``L`` cache capacity (columns), ``S`` columns of
this call, ``K`` / ``V`` the trailing sizes of keys / values (``Hd``, the head dim, in
grouped-query attention), ``R`` rotated dims of a head, ``T = B*S`` token slots of this call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeflow.checks import _int

__all__ = ["KVCache", "StepInputs", "step_inputs", "StaticStep", "static_step"]


class KVCache:
    """Per block, keys ``[B, G, L, K]`` and values ``[B, G, L, V]`` preallocated for ``L =
    capacity`` columns (``G = kv_heads``, ``K = k_dim``, ``V = v_dim``); ``length`` columns are
    filled (the same for every row: rows are left-padded). ``cos_LR`` and ``sin_LR`` are the
    rotary tables of positions ``0 .. L-1`` (``moeflow.models.rope``; ``MoEGPT.new_cache``
    computes them once per generation, not per step). ``window``: the sliding window of the
    blocks that slide (None: none does), for which every call also makes a window mask.
    ``zeroed``: the columns start as zeros (a static step attends over all of them, the
    unwritten ones masked)."""

    def __init__(self, *, n_layers: int, batch: int, kv_heads: int, k_dim: int, v_dim: int, capacity: int,
                 pad_B: torch.Tensor, cos_LR: torch.Tensor, sin_LR: torch.Tensor, window: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 zeroed: bool = False) -> None:
        for name, value in (("n_layers", n_layers), ("batch", batch), ("kv_heads", kv_heads), ("k_dim", k_dim),
                            ("v_dim", v_dim), ("capacity", capacity)):
            _int(name, value, minimum=0 if name == "batch" else 1)
        if window is not None:
            _int("window", window, minimum=1)
        R = cos_LR.shape[-1] if cos_LR.dim() == 2 else -1
        if cos_LR.shape != (capacity, R) or sin_LR.shape != cos_LR.shape or R < 2 or R % 2:
            raise ValueError(f"cos_LR and sin_LR must both be [{capacity}, R] with R even, got {tuple(cos_LR.shape)}, "
                             f"{tuple(sin_LR.shape)}")
        self.cos_LR, self.sin_LR = cos_LR, sin_LR
        self.window = window
        make = torch.zeros if zeroed else torch.empty
        self.k = [make((batch, kv_heads, capacity, k_dim), device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [make((batch, kv_heads, capacity, v_dim), device=device, dtype=dtype) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0
        if pad_B.shape != (batch,):
            raise ValueError(f"pad_B must have shape ({batch},), got {tuple(pad_B.shape)}")
        self.pad_B = pad_B.to(device=device, dtype=torch.long)
        self.max_pad = int(self.pad_B.max()) if batch else 0  # read once, not per step

    @property
    def batch(self) -> int:
        return self.pad_B.shape[0]

    def write(self, layer: int, start: int, k_BGSK: torch.Tensor, v_BGSV: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this call's keys/values at columns ``[start, start + S)`` of block ``layer`` and
        return views of the filled columns ``[B, G, start + S, K]``, ``[..., V]`` (no copy of
        the old ones)."""
        end = start + k_BGSK.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} columns; writing up to column {end}")
        self.k[layer][:, :, start:end] = k_BGSK
        self.v[layer][:, :, start:end] = v_BGSV
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def write_at(self, layer: int, pos: torch.Tensor, k_BG1K: torch.Tensor, v_BG1V: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store one column's keys/values at column ``pos`` (an int64 device tensor: 0-dim, the
        same column in every row, or ``[B]``, row ``b`` at column ``pos[b]``) of block ``layer``
        and return the whole cache ``[B, G, L, K]``, ``[B, G, L, V]`` (a static step's shapes)."""
        k, v = self.k[layer], self.v[layer]
        if pos.dim() == 0:
            k.index_copy_(2, pos.reshape(1), k_BG1K)
            v.index_copy_(2, pos.reshape(1), v_BG1V)
        else:  # a column per row: scatter along the columns
            B, G = k_BG1K.shape[:2]
            k.scatter_(2, pos.view(B, 1, 1, 1).expand(B, G, 1, k_BG1K.shape[-1]), k_BG1K)
            v.scatter_(2, pos.view(B, 1, 1, 1).expand(B, G, 1, v_BG1V.shape[-1]), v_BG1V)
        return k, v

    def rows(self, start: int, stop: int) -> KVCache:
        """A cache over rows ``[start, stop)`` of this one sharing its storage (its keys, values
        and ``pad_B`` are views: a call on it writes into this cache), with the same rotary
        tables and window and a ``length`` of its own, 0 (the caller sets it to the columns its
        rows hold). ``reset`` on the view zeroes its rows here; ``keep_rows`` detaches it."""
        _int("start", start, minimum=0)
        _int("stop", stop, minimum=start + 1)
        if stop > self.batch:
            raise ValueError(f"stop={stop} is past the cache's {self.batch} rows")
        view = object.__new__(KVCache)
        view.__dict__.update(self.__dict__)
        view.k, view.v = [t[start:stop] for t in self.k], [t[start:stop] for t in self.v]
        view.pad_B, view.length = self.pad_B[start:stop], 0
        view.max_pad = int(view.pad_B.max()) if self.max_pad else 0  # (no read where no row is padded)
        return view

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

    ``cos/sin [B, 1, S, R]`` (``[S, R]`` when no row is padded): the rotary tables at each
    row's positions. ``mask [B, 1, S, start+S]`` (bool, True = attend) or None when no row is
    padded, then ``causal`` tells SDPA to apply the causal mask itself (a prefill) or that
    every cached key is visible (a one-token decode). ``window_mask`` (when the cache has a
    ``window``): ``mask`` narrowed to each query's last ``window`` columns, ``[B, 1, S,
    start+S]`` or, no row padded, ``[S, start+S]``. ``real_T``: flat indices of the real
    tokens, None when all are real."""

    cache: KVCache
    start: int
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    real_T: torch.Tensor | None
    window_mask: torch.Tensor | None = None


def step_inputs(cache: KVCache, seq_len: int) -> StepInputs:
    """``StepInputs`` of a call writing ``seq_len`` columns behind the ``cache.length`` filled
    ones: a prefill (``seq_len`` columns into an empty cache), a chunk of a prompt behind
    earlier ones, or a decode step (one column)."""
    start, S, device = cache.length, seq_len, cache.pad_B.device
    _int("seq_len", S, minimum=1)
    if start + S > cache.capacity:
        raise ValueError(f"KV cache holds {cache.capacity} columns; {start} are filled, {S} more do not fit")
    cos_LR, sin_LR, W = cache.cos_LR, cache.sin_LR, cache.window
    chunk = start > 0 and S > 1  # behind filled columns: SDPA's causal triangle would sit top left
    if not cache.max_pad and W is None and not chunk:
        cos, sin = cos_LR[start:start + S], sin_LR[start:start + S]
        return StepInputs(cache=cache, start=start, cos=cos, sin=sin, mask=None, causal=S > 1, real_T=None)
    col_S1 = torch.arange(start, start + S, device=device).unsqueeze(1)
    key_L = torch.arange(start + S, device=device)
    near_SL = None if W is None else col_S1 - key_L < W  # within the window (behind or ahead)
    if not cache.max_pad:
        cos, sin = cos_LR[start:start + S], sin_LR[start:start + S]
        upto_SL = key_L <= col_S1
        return StepInputs(cache=cache, start=start, cos=cos, sin=sin, mask=upto_SL if chunk else None,
                          causal=S > 1 and not chunk, real_T=None,
                          window_mask=None if near_SL is None else near_SL & upto_SL)
    col_S = col_S1.squeeze(1)
    pad_B1 = cache.pad_B.unsqueeze(1)
    pos_BS = (col_S.unsqueeze(0) - pad_B1).clamp(min=0)  # pad columns take position 0 (unused)
    cos, sin = cos_LR[pos_BS].unsqueeze(1), sin_LR[pos_BS].unsqueeze(1)
    # a real key at or before the query; a pad query attends to itself only (its row of the
    # softmax must not be empty, which would give NaN; its output is never read by a real token)
    visible_BSL = (key_L >= pad_B1.unsqueeze(2)) & (key_L <= col_S1)
    itself_SL = key_L == col_S1
    mask = (visible_BSL | itself_SL).unsqueeze(1)
    window = None if near_SL is None else ((visible_BSL & near_SL) | itself_SL).unsqueeze(1)
    # decode columns lie behind every pad: all real, and no index (nor host sync) is needed
    real_T = None if start >= cache.max_pad else (col_S.unsqueeze(0) >= pad_B1).flatten().nonzero().squeeze(1)
    return StepInputs(cache=cache, start=start, cos=cos, sin=sin, mask=mask, causal=False, real_T=real_T,
                      window_mask=window)


@dataclass(frozen=True)
class StaticStep:
    """What every block of one static decode step shares (``static_step``): ``pos`` (int64,
    0-dim or ``[B]``) the column written (in every row, or per row), ``cos/sin [B, 1, 1, R]``
    the rotary tables at each row's position ``pos - pad_B``, ``mask [B, 1, 1, L]`` (True =
    attend) the row's real columns up to its ``pos``; ``window_mask`` (when the cache has a
    ``window``) those of them fewer than ``window`` columns behind ``pos``."""

    cache: KVCache
    pos: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    window_mask: torch.Tensor | None = None


def static_step(cache: KVCache, pos: torch.Tensor) -> StaticStep:
    """``StaticStep`` of a one-column step writing column ``pos`` (an int64 tensor on the
    cache's device, 0-dim or ``[B]``; below ``cache.capacity``: the caller keeps count). Every
    shape depends on the cache and the rank of ``pos`` alone; no value is read on the host."""
    L, B = cache.capacity, cache.batch
    if pos.dim() not in (0, 1) or (pos.dim() == 1 and pos.shape[0] != B):
        raise ValueError(f"pos must be 0-dim or [{B}] (a column per row), got shape {tuple(pos.shape)}")
    key_L = torch.arange(L, device=cache.pad_B.device)
    col = pos.unsqueeze(1) if pos.dim() else pos  # [B, 1] or 0-dim: broadcasts against [B, L]
    rot_B = (pos - cache.pad_B).clamp(min=0)
    cos = cache.cos_LR.index_select(0, rot_B).view(B, 1, 1, -1)
    sin = cache.sin_LR.index_select(0, rot_B).view(B, 1, 1, -1)
    visible_BL = (key_L.unsqueeze(0) >= cache.pad_B.unsqueeze(1)) & (key_L <= col)
    window = None if cache.window is None else (visible_BL & (col - key_L < cache.window)).view(B, 1, 1, L)
    return StaticStep(cache=cache, pos=pos, cos=cos, sin=sin, mask=visible_BL.view(B, 1, 1, L), window_mask=window)

