"""The experts of a pipelined call chunk by chunk, with the unchunked call's weight gradients
(legend: moeflow.types; chunk ``i`` is the local slots ``[a, b)``, whose rows are rows
``[r_i, r_{i+1})`` of the slot-grouped layout of all ``R`` received rows; ``F``: ``w_in``'s width).

Why: a chunk's grouped GEMMs keep every row of its experts, so chunking costs them nothing, but
its weight gradients would be ``[b - a, ...]`` tensors that autograd then joins into the
parameter's ``[e, ...]`` gradient: a copy of the whole weight gradient, several percent of the
layer on many small experts (DeepSeek-like). ``F.grouped_mm`` cannot write into a slice of a
bigger tensor. So each chunk writes what the weight gradients are made of into its rows of four
``[R, ...]`` buffers instead, with gathers and activation kernels that write where they are told
(no more passes than the unchunked backward makes): the expert input ``X``, the output gradient
``dY``, the activation ``A`` and the pre-activation gradient ``dH``. Once every chunk's backward
has run, the weight gradients are the unchunked call's two grouped GEMMs, ``dW_out = A^T dY``
and ``dW_in = X^T dH``, over all experts: no copy, and the same per-expert products.

- ``_Chunk`` (one per chunk), forward: gather the received rows by slot into ``X``'s rows,
  ``h = X_i W_in[a:b]``, ``y = act(h) W_out[a:b]``, in arrival order again; saves ``h`` (as
  ``moeflow.experts.lean``). Backward: ``dY_i`` by slot, ``da = dY_i W_out^T``, ``A_i = act(h)``,
  ``dH_i = act'(h) da``, ``dx = dH_i W_in^T`` in arrival order: all the chunk's exchange waits for.
- ``_Weights``: takes the weights and gives every chunk a token; autograd runs its backward once
  every chunk's has run, and it computes the weight gradients (or adds them into existing
  ``.grad``: ``moeflow.experts.weight_grads``).

Memory: ``A`` and ``dY`` live until the weight gradients (the unchunked backward frees them
sooner): ``R * (H + D)`` elements more at the peak. For ``GroupedExperts`` without biases,
recompute or a custom activation, on the ``grouped_mm`` or ``loop`` backend (``eligible``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moeflow.experts.ffn import GroupedExperts, autocast_cast
from moeflow.experts.weight_grads import add_weight_grad_, grad_buffer, mm_weight_grad, no_grad_to_add, records_grad_mode
from moeflow.kernels.activation import ACTIVATIONS, activate, activate_backward_, activate_backward_into, activate_into
from moeflow.kernels.grouped_mm import grouped_mm_loop

__all__ = ["ChunkedFFN"]


def _mm(gemm: str, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offs) if gemm == "grouped_mm" else grouped_mm_loop(x, w, offs)


class _State:
    """What the chunks and ``_Weights`` share for one call."""

    def __init__(self, w_in, w_out, activation, gemm, ranges, row_off, offs_e, offs_n, dim) -> None:  # type: ignore[no-untyped-def]
        self.w_in, self.w_out, self.activation, self.gemm = w_in, w_out, activation, gemm
        self.ranges, self.row_off, self.offs_e, self.offs_n, self.dim = ranges, row_off, offs_e, offs_n, dim
        self.X = self.dY = self.A = self.dH = None

    def rows(self, i: int) -> slice:
        return slice(self.row_off[i], self.row_off[i + 1])

    def offs(self, i: int) -> torch.Tensor:
        """Chunk ``i``'s inclusive row offsets per slot of its range, from its first row."""
        return self.offs_n[i]

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.ranges[i]
        return self.w_in[a:b], self.w_out[a:b]


class _Weights(torch.autograd.Function):
    """Forward: an empty token for every chunk. Backward (after every chunk's): the weight
    gradients over all chunks' rows (module docstring)."""

    @staticmethod
    def forward(ctx, w_in, w_out, st):  # type: ignore[override]
        ctx.st = st
        return w_in.new_empty(0)

    @staticmethod
    @records_grad_mode
    @once_differentiable
    def backward(ctx, grad_token):  # type: ignore[override]
        st = ctx.st
        grads = []
        for edge, (w, x, g) in enumerate(((st.w_in, st.X, st.dH), (st.w_out, st.A, st.dY))):
            if not ctx.needs_input_grad[edge]:
                grads.append(None)
            elif x is None or g is None or x.shape[0] == 0:  # no rows here: zero gradients
                grads.append(torch.zeros_like(w))
            else:
                acc = grad_buffer(ctx, edge, w)
                with torch.autocast(w.device.type, enabled=False):
                    if acc is None:
                        grads.append(mm_weight_grad(st.gemm, x, g, st.offs_e, w))
                    else:
                        add_weight_grad_(st.gemm, x, g, st.offs_e, acc)
                        grads.append(no_grad_to_add(w))
        st.X = st.dY = st.A = st.dH = None
        return grads[0], grads[1], None


class _Chunk(torch.autograd.Function):
    """Chunk ``i``'s experts on its received rows (arrival order in, arrival order out)."""

    @staticmethod
    def forward(ctx, recv_RD, token, st, i, by_slot):  # type: ignore[override]
        ctx.st, ctx.i = st, i
        if st.X is None:
            st.X = recv_RD.new_empty((st.row_off[-1], recv_RD.shape[1]))
        x = st.X[st.rows(i)]
        torch.index_select(recv_RD, 0, by_slot, out=x)
        inv = torch.empty_like(by_slot)
        inv[by_slot] = torch.arange(by_slot.numel(), device=by_slot.device)
        if x.shape[0] == 0:
            ctx.save_for_backward(None, by_slot, inv)
            return recv_RD.new_empty((0, st.dim))
        w_in, w_out = st.weights(i)
        with torch.autocast(recv_RD.device.type, enabled=False):
            h = _mm(st.gemm, x, w_in, st.offs(i))
            y = _mm(st.gemm, activate(h, st.activation), w_out, st.offs(i))
        ctx.save_for_backward(h, by_slot, inv)
        return y.index_select(0, inv)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_RD):  # type: ignore[override]
        st, i = ctx.st, ctx.i
        h, by_slot, inv = ctx.saved_tensors
        R, rows = st.row_off[-1], st.rows(i)
        need_w = ctx.needs_input_grad[1]
        token_grad = dy_RD.new_zeros(0) if need_w else None
        if h is None:  # no rows in this chunk here
            return (dy_RD.new_empty((0, st.w_in.shape[1])) if ctx.needs_input_grad[0] else None), token_grad, None, None, None
        w_in, w_out = st.weights(i)
        with torch.autocast(dy_RD.device.type, enabled=False):
            if st.dY is None:
                st.dY = dy_RD.new_empty((R, dy_RD.shape[1]))
            dy = st.dY[rows]
            torch.index_select(dy_RD, 0, by_slot, out=dy)
            da = _mm(st.gemm, dy, w_out.transpose(-2, -1), st.offs(i))
            if need_w:
                if st.A is None:
                    st.A = h.new_empty((R, da.shape[1]))
                    st.dH = h.new_empty((R, h.shape[1]))
                activate_into(h, st.activation, st.A[rows])
                dh = activate_backward_into(h, da, st.activation, st.dH[rows])
            else:  # no weight gradient: dh over h, as the unchunked backward does
                dh = activate_backward_(h, da.contiguous(), st.activation)
            del da
            dx = _mm(st.gemm, dh, w_in.transpose(-2, -1), st.offs(i)).index_select(0, inv) if ctx.needs_input_grad[0] else None
        return dx, token_grad, None, None, None


class ChunkedFFN:
    """The experts of one pipelined call (module docstring): ``ffn(i, recv_RD, by_slot)`` runs
    chunk ``i`` on its received rows, ``by_slot`` being the stable order that groups them by
    slot. ``bounds``: the chunks' slot bounds, or None for token chunks of a rank holding one
    slot (every chunk: slot 0; its rows, chunk after chunk, are that slot's rows in another
    order, which only the weight gradients' summation order sees); ``rows_n``: rows each chunk
    receives here (on the host, from the split sizes); ``counts_e``: rows per local slot."""

    def __init__(self, experts: GroupedExperts, counts_e: torch.Tensor, bounds: list[int] | None, rows_n: list[int],
                 like: torch.Tensor) -> None:
        w_in, w_out = autocast_cast(like, experts.w_in, experts.w_out)
        self.dtype = w_in.dtype
        gemm = experts.grouped_backend(like.device, w_in.dtype)
        row_off = [0]
        for n in rows_n:
            row_off.append(row_off[-1] + n)
        offs_dtype = torch.int32 if gemm == "grouped_mm" else torch.long
        offs_e = torch.cumsum(counts_e, 0).to(offs_dtype)
        if bounds is None:  # token chunks of one slot: chunk i is one group of rows_n[i] rows
            ranges = [(0, 1)] * len(rows_n)
            offs_n = [torch.full((1,), r, dtype=offs_dtype, device=like.device) for r in rows_n]  # (a fill: no copy)
        else:
            ranges = list(zip(bounds[:-1], bounds[1:]))
            offs_n = [offs_e[a:b] - row_off[i] for i, (a, b) in enumerate(ranges)]
        self.state = _State(w_in, w_out, experts.config.activation, gemm, ranges, row_off, offs_e, offs_n,
                            w_out.shape[-1])
        self.token = _Weights.apply(w_in, w_out, self.state)

    @staticmethod
    def eligible(experts: object, like: torch.Tensor) -> bool:
        """Whether ``experts`` runs here: ``GroupedExperts`` (its own ``forward``) without biases,
        recompute or a custom activation, whose grouped backend is ``grouped_mm`` or ``loop``."""
        if not isinstance(experts, GroupedExperts) or type(experts).forward is not GroupedExperts.forward:
            return False
        cfg = experts.config
        if experts.b_in is not None or experts.b_out is not None or cfg.recompute or cfg.activation not in ACTIVATIONS:
            return False
        (w,) = autocast_cast(like, experts.w_in)
        return experts.grouped_backend(like.device, w.dtype) in ("grouped_mm", "loop")

    def __call__(self, i: int, recv_RD: torch.Tensor, by_slot: torch.Tensor) -> torch.Tensor:
        return _Chunk.apply(recv_RD.to(self.dtype), self.token, self.state, i, by_slot)
