"""The expert FFN as autograd Functions that save only what their backward needs
(legend: moeflow.types; F = width of ``w_in``: 2H for gated activations, else H; N rows).

``y = act(x W_in[e]) W_out[e]`` over rows grouped by expert, in either layout of the experts
protocol: padded ``[E, C, D]`` (batched matmul) or grouped ``[R, D]`` (grouped matmul). No biases
(``GroupedExperts`` with ``bias=True`` takes the plain autograd path).

Why: plain autograd through ``bmm -> chunk -> silu -> mul -> bmm`` saves the input rows, the
whole pre-activation ``h [N, F]`` (twice referenced), ``silu(gate) [N, H]`` and the activation
``a [N, H]`` for the second GEMM, and its backward allocates the gate and up gradients, their
concatenation and the weight gradients while all of those are alive. Here:

- forward saves ``x`` and ``h`` only (``recompute=True``: ``x`` only, and ``h`` is recomputed
  in backward, chunk by chunk, see below: Megatron-Core's MoE recompute, ScatterMoE's choice of
  not saving the hidden activation); ``a`` is never saved, it is a cheap elementwise recompute
  from ``h``;
- backward rebuilds ``a = act(h)``, takes ``dW_out = a^T dy`` (``a`` freed), ``da = dy W_out^T``,
  turns ``h`` into ``dh`` **in place** (``h`` is dead after that; the activation's backward runs
  in two row steps with the kernels autograd uses, so the gradients equal plain autograd's to
  the bit), then ``dx = dh W_in^T`` and ``dW_in = x^T dh``: the gate/up gradients are never
  concatenated and ``silu(gate)`` is never kept. The two GEMMs are two autograd nodes
  (``_FirstGEMM``, ``_ActSecondGEMM``), so that autograd frees ``dy`` between them (one node
  for both held it until ``dW_in`` was allocated: +32 MiB at the peak of T=4096, D=1024).

With ``recompute`` (``_RecomputeFFN``, one node) forward and backward run over a few chunks
of whole experts (``_expert_chunks``: ``h_c`` about 1/8 of ``h`` and at most 16 MiB, at least
1 MiB, and at most one chunk per expert; not one chunk per expert by default: every ATen call is a parallel region, and on a busy CPU each
waits for a descheduled thread). Forward computes ``y`` chunk by chunk (``h`` is never whole)
and saves a private copy of ``x``. Backward allocates ``dW_in`` and ``dW_out`` once, then per
chunk recomputes ``h_c``, writes ``dW_out[c]``, turns ``h_c`` into ``dh_c`` in place, writes
``dW_in[c]`` and last ``dx_c`` **over the chunk's rows of that copy**, which then is ``dx``: no
``[rows, D]`` gradient is allocated. So the backward holds the weight gradients, the copy, ``dy``
and one chunk's ``h_c``, ``act(gate_c)`` and ``a_c`` or ``da_c``. Bit-identical to the default
path in fp64 (same kernels per element; cuBLAS/MKL may pick other fp32 GEMM kernels for a
smaller batch, so fp32 can differ in the last bits). Costs: one row copy in forward and about
fifteen ATen calls per chunk (on an idle machine the same time as unchunked; slower where
another busy process competes for the cores: see docs/benchmarks.md).

Why the default path is not chunked the same way: each weight gradient is one ``[E, ...]``
tensor (a 3-D parameter), allocated before the first chunk writes into it, while every chunk's
saved ``h`` is still alive (``h_c`` can be freed only once ``dW_in[c]`` and ``dx_c`` are
written). So the default backward's peak is at least gradients + ``h`` + ``x`` + ``dx``, which
is what the two-node backward already reaches; per-expert ``nn.Linear`` (DeepSpeed) avoid it
by allocating each expert's gradient while the other experts' activations are freed. Where
``.grad`` already exists (later micro-batches of gradient accumulation) both paths add the weight
gradients into it and allocate none (``moeflow.experts.weight_grads``).

Overwriting the saved ``h`` means a second backward through the same graph
(``retain_graph=True``) fails loudly in PyTorch's saved-tensor version check instead of giving
wrong gradients. The readable reference is ``ffn_reference`` (plain autograd), and the tests
compare outputs and every gradient against it in fp64.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from moeflow.experts.weight_grads import (add_weight_grad_, expert_row_ranges, grad_buffer, mm_weight_grad,
                                          no_grad_to_add, records_grad_mode, weight_grad_into)
from moeflow.kernels.activation import ACTIVATIONS, activate, activate_backward_, activate_reference
from moeflow.kernels.grouped_mm import grouped_mm_loop

__all__ = ["LEAN_GEMMS", "ffn_reference", "lean_ffn", "lean_ffn_no_grad"]

LEAN_GEMMS = ("bmm", "grouped_mm", "loop")  # padded layout; grouped native; grouped reference
# Each ATen op is a parallel region, and on a busy machine every region waits for its slowest
# thread (many small chunks were far slower than one piece: docs/benchmarks.md), so the
# elementwise backward takes few, large steps.
_CHUNK_BYTES = 16 << 20  # recompute (forward and backward): h_c [rows_c, F] at most this ...
_CHUNKS = 8  # ... and at most 1/_CHUNKS of h ...
_MIN_CHUNK_BYTES = 1 << 20  # ... but not below this (small problems: one chunk)


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``a = act(h)`` as one op (``moeflow.kernels.activation.activate``: one fused pass on CUDA).
    A module-level name, so ``bench.stage_profile`` can label it."""
    return activate(h, activation)


def _act_backward_(h_NF: torch.Tensor, da_NH: torch.Tensor, activation: str) -> torch.Tensor:
    """Overwrite ``h`` with ``dh = d act(h) / dh * da`` as one op
    (``moeflow.kernels.activation.activate_backward_``); returns ``h``."""
    return activate_backward_(h_NF, da_NH, activation)


def _mm(gemm: str, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Per-group ``x @ w[e]`` (no autograd)."""
    if gemm == "bmm":
        return torch.bmm(x, w)
    if gemm == "grouped_mm":
        return F.grouped_mm(x, w, offs=offs)
    return grouped_mm_loop(x, w, offs)


def _weight_grad(ctx, edge: int, gemm: str, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor | None,
                 w: torch.Tensor) -> torch.Tensor | None:
    """The gradient a two-node backward returns for weight ``w`` (``edge``: its argument index):
    None if not needed; added into the parameter's ``.grad`` and a zero tensor returned where
    ``weight_grads.grad_buffer`` allows; else a new tensor."""
    if not ctx.needs_input_grad[edge]:
        return None
    acc = grad_buffer(ctx, edge, w)
    if acc is None:
        return mm_weight_grad(gemm, x, g, offs, w)
    add_weight_grad_(gemm, x, g, offs, acc)
    return no_grad_to_add(w)


def _first_gemm_backward(ctx, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``_FirstGEMM.backward``: ``dx = dh W_in^T`` and ``dW_in = x^T dh``. (The backwards are
    module functions, so that mutation testing reaches them: mutmut leaves decorated functions
    alone.)"""
    x, w_in, offs = ctx.saved_tensors
    with torch.autocast(dh.device.type, enabled=False):
        dx = _mm(ctx.gemm, dh, w_in.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
        dw_in = _weight_grad(ctx, 1, ctx.gemm, x, dh, offs, w_in)
    return dx, dw_in, None, None


def _act_second_gemm_backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``_ActSecondGEMM.backward``: ``dW_out = act(h)^T dy``, then ``dh`` over the saved ``h``."""
    h, w_out, offs = ctx.saved_tensors
    act, gemm = ctx.activation, ctx.gemm
    with torch.autocast(dy.device.type, enabled=False):
        dy = dy.contiguous()
        # (the guard spares act(h) when w_out needs no gradient)
        dw_out = _weight_grad(ctx, 1, gemm, _activate(h, act), dy, offs, w_out) if ctx.needs_input_grad[1] else None
        da = _mm(gemm, dy, w_out.transpose(-2, -1), offs)
        dh = _act_backward_(h.view(-1, h.shape[-1]), da.view(-1, da.shape[-1]), act).view(h.shape)
    return dh, dw_out, None, None, None


class _FirstGEMM(torch.autograd.Function):
    """``h = x W_in[e]``; saves ``x`` (needed for ``dW_in``), never ``h``."""

    @staticmethod
    def forward(ctx, x, w_in, offs, gemm):  # type: ignore[override]
        ctx.gemm = gemm
        ctx.save_for_backward(x, w_in, offs)
        with torch.autocast(x.device.type, enabled=False):  # the caller cast the operands
            return _mm(gemm, x, w_in, offs)

    @staticmethod
    @records_grad_mode
    @once_differentiable
    def backward(ctx, dh):  # type: ignore[override]
        return _first_gemm_backward(ctx, dh)


class _ActSecondGEMM(torch.autograd.Function):
    """``y = act(h) W_out[e]``; saves ``h``. Its own node, so that autograd frees ``dy`` before
    the first GEMM's backward allocates ``dx`` and ``dW_in``."""

    @staticmethod
    def forward(ctx, h, w_out, offs, activation, gemm):  # type: ignore[override]
        ctx.activation, ctx.gemm = activation, gemm
        ctx.save_for_backward(h, w_out, offs)
        with torch.autocast(h.device.type, enabled=False):
            return _mm(gemm, _activate(h, activation), w_out, offs)

    @staticmethod
    @records_grad_mode
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        return _act_second_gemm_backward(ctx, dy)


def _expert_chunks(x: torch.Tensor, offs: torch.Tensor | None, E: int, F_: int, gemm: str,
                   chunks: int | None) -> list[tuple[int, int, int, int]]:
    """``(e0, e1, r0, r1)`` per chunk: experts ``e0:e1`` own rows ``r0:r1`` (``bmm``: the first
    dim of ``x``). Boundaries between whole experts, at about equal rows; ``chunks`` None picks
    the count from the size of ``h`` (module constants), else at most ``chunks``. Grouped
    layouts read ``offs`` on the host (one sync)."""
    if gemm == "bmm":
        ends = [(e + 1) * x.shape[1] for e in range(E)]
    else:
        ends = [int(v) for v in offs.tolist()]
    N = ends[-1] if ends else 0
    if chunks is None:
        h_bytes = N * F_ * x.element_size()
        target = max(_MIN_CHUNK_BYTES, min(_CHUNK_BYTES, h_bytes // _CHUNKS))
        chunks = math.ceil(h_bytes / target)
    chunks = max(1, min(chunks, E))
    bounds, e0, r0 = [], 0, 0
    for k in range(1, chunks + 1):
        goal = N * k / chunks  # end this chunk at the first expert whose end reaches it
        e1 = e0 + 1
        while e1 < E and ends[e1 - 1] < goal:
            e1 += 1
        if k == chunks:
            e1 = E
        bounds.append((e0, e1, r0, ends[e1 - 1]))
        e0, r0 = e1, ends[e1 - 1]
        if e0 == E:
            break
    return bounds


def _mm_into(gemm: str, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = _mm(gemm, x, w, offs)``, written in place (``grouped_mm`` has no ``out=``: a
    chunk-size temporary)."""
    if gemm == "bmm":
        torch.bmm(x, w, out=out)
    elif gemm == "loop":
        for e, (s, t) in enumerate(expert_row_ranges(offs)):
            if t > s:
                torch.mm(x[s:t], w[e], out=out[s:t])
    else:
        out.copy_(F.grouped_mm(x, w, offs=offs))


class _RecomputeFFN(torch.autograd.Function):
    """The whole FFN with expert recompute: saves a private copy of ``x`` (overwritten with
    ``dx`` in backward) and the weights; forward and backward over expert chunks (module
    docstring), so neither ever holds the whole ``h``."""

    @staticmethod
    def forward(ctx, x, w_in, w_out, offs, activation, gemm, chunks):  # type: ignore[override]
        ctx.activation, ctx.gemm = activation, gemm
        ctx.bounds = _expert_chunks(x, offs, w_in.shape[0], w_in.shape[-1], gemm, chunks)
        # our own copy of the rows: backward writes dx over it (x itself may be anyone's)
        rows = x.detach().clone(memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else x
        ctx.save_for_backward(rows, w_in, w_out, offs)
        y = x.new_empty(*x.shape[:-1], w_out.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            for e0, e1, r0, r1 in ctx.bounds:  # chunks here too: h is never whole
                if gemm != "bmm" and r1 == r0:  # experts without rows: nothing to compute (no 0-row GEMM)
                    continue
                s = slice(e0, e1) if gemm == "bmm" else slice(r0, r1)
                offs_c = offs if gemm == "bmm" else offs[e0:e1] - r0
                a_c = _activate(_mm(gemm, x[s], w_in[e0:e1], offs_c), activation)
                _mm_into(gemm, a_c, w_out[e0:e1], offs_c, out=y[s])
                del a_c
        return y

    @staticmethod
    @records_grad_mode
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        return _recompute_ffn_backward(ctx, dy)


def _recompute_ffn_backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """``_RecomputeFFN.backward``: per expert chunk, recompute ``h_c``, write ``dW_out[c]``, turn
    ``h_c`` into ``dh_c``, write ``dW_in[c]`` and ``dx_c`` over the saved copy of ``x``."""
    x, w_in, w_out, offs = ctx.saved_tensors
    act, gemm = ctx.activation, ctx.gemm
    need_x, need_w_in, need_w_out = ctx.needs_input_grad[:3]
    # the weights' existing .grad when the gradients can be added into it (weight_grads), else new
    acc_in, acc_out = grad_buffer(ctx, 1, w_in), grad_buffer(ctx, 2, w_out)
    dw_in = (acc_in if acc_in is not None else torch.empty_like(w_in)) if need_w_in else None
    dw_out = (acc_out if acc_out is not None else torch.empty_like(w_out)) if need_w_out else None
    into_in = add_weight_grad_ if acc_in is not None else weight_grad_into
    into_out = add_weight_grad_ if acc_out is not None else weight_grad_into
    with torch.autocast(dy.device.type, enabled=False):
        dy = dy.contiguous()
        for e0, e1, r0, r1 in ctx.bounds:
            if gemm != "bmm" and r1 == r0:  # experts without rows: zero weight gradients, no 0-row GEMM
                for dw, acc in ((dw_in, acc_in), (dw_out, acc_out)):
                    if dw is not None and acc is None:
                        dw[e0:e1].zero_()
                continue
            s = slice(e0, e1) if gemm == "bmm" else slice(r0, r1)
            x_c, dy_c = x[s], dy[s]
            w_in_c, w_out_c = w_in[e0:e1], w_out[e0:e1]
            offs_c = offs if gemm == "bmm" else offs[e0:e1] - r0
            h_c = _mm(gemm, x_c, w_in_c, offs_c)
            a = _activate(h_c, act)
            if need_w_out:
                into_out(gemm, a, dy_c, offs_c, dw_out[e0:e1])
            del a
            da = _mm(gemm, dy_c, w_out_c.transpose(-2, -1), offs_c)
            _act_backward_(h_c.view(-1, h_c.shape[-1]), da.view(-1, da.shape[-1]), act)
            del da  # h_c is dh_c now
            if need_w_in:
                into_in(gemm, x_c, h_c, offs_c, dw_in[e0:e1])
            if need_x:  # x_c is dead: dx_c goes over it
                _mm_into(gemm, h_c, w_in_c.transpose(-2, -1), offs_c, out=x_c)
            del h_c
    if acc_in is not None:
        dw_in = no_grad_to_add(w_in)
    if acc_out is not None:
        dw_out = no_grad_to_add(w_out)
    return (x if need_x else None), dw_in, dw_out, None, None, None, None


def lean_ffn(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    offs_E: torch.Tensor | None,
    *,
    activation: str,
    gemm: str,
    recompute: bool = False,
    chunks: int | None = None,
) -> torch.Tensor:
    """``act(x W_in[e]) W_out[e]`` per expert with the lean backward (module docstring).

    Args:
        x: ``[E, C, D]`` with ``gemm="bmm"``, or ``[R, D]`` grouped by expert.
        w_in: ``[E, D, F]``; w_out: ``[E, H, D]`` (any strides for the grouped GEMMs).
        offs_E: inclusive cumulative row counts (grouped layouts; int32 for ``"grouped_mm"``),
            None for ``"bmm"``.
        activation: one of ``moeflow.kernels.activation.ACTIVATIONS``; gemm: one of ``LEAN_GEMMS``.
        recompute: save only (a copy of) ``x`` and recompute ``h = x W_in`` in backward, over
            expert chunks.
        chunks: with ``recompute``, at most this many expert chunks in backward (None: from the
            size of ``h``, see the module docstring); the gradients do not depend on it.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if gemm not in LEAN_GEMMS:
        raise ValueError(f"gemm must be one of {list(LEAN_GEMMS)}, got {gemm!r}")
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive int or None, got {chunks!r}")
    if recompute:
        return _RecomputeFFN.apply(x, w_in, w_out, offs_E, activation, gemm, chunks)
    h = _FirstGEMM.apply(x, w_in, offs_E, gemm)
    return _ActSecondGEMM.apply(h, w_out, offs_E, activation, gemm)


def lean_ffn_no_grad(x_RD: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts_E: torch.Tensor, *,
                     activation: str) -> torch.Tensor:
    """``lean_ffn``'s forward with ``gemm="grouped_mm"`` for calls autograd records nothing for
    (inference, a decode step): the same two products, without the autograd Functions and
    offset casts (a decode step's few rows pay for every op: ``docs/benchmarks.md``); bit-equal
    to ``lean_ffn`` (tests compare).

    Under ``torch.compile`` it is one opaque op (``moeflow::lean_ffn_no_grad``, output
    ``[R, D]``): torch's fake implementation of ``F.grouped_mm`` accepts bf16 only, so a traced
    fp32 or fp16 call would fail; eager calls skip the op's dispatch (microseconds a decode
    step pays per MoE block). (The CPU's compiled decode puts ``moeflow.experts.packed``'s
    experts in place of the built-in ones for a generation; nothing here knows of them.)"""
    if torch.compiler.is_compiling():
        return _lean_ffn_no_grad_op(x_RD, w_in, w_out, counts_E, activation)
    return _lean_ffn_no_grad(x_RD, w_in, w_out, counts_E, activation)


def _lean_ffn_no_grad(x_RD: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts_E: torch.Tensor,
                      activation: str) -> torch.Tensor:
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    # the torch ops themselves: a decode step's few rows gain nothing from one more op's dispatch
    return F.grouped_mm(activate_reference(F.grouped_mm(x_RD, w_in, offs=offs_E), activation), w_out, offs=offs_E)


@torch.library.custom_op("moeflow::lean_ffn_no_grad", mutates_args=())
def _lean_ffn_no_grad_op(x_RD: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts_E: torch.Tensor,
                         activation: str) -> torch.Tensor:
    return _lean_ffn_no_grad(x_RD, w_in, w_out, counts_E, activation)


@_lean_ffn_no_grad_op.register_fake
def _(x_RD: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, counts_E: torch.Tensor,
      activation: str) -> torch.Tensor:
    return x_RD.new_empty((x_RD.shape[0], w_out.shape[-1]))


def ffn_reference(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, offs_E: torch.Tensor | None, *,
                  activation: str) -> torch.Tensor:
    """The same FFN through plain autograd (``bmm`` for ``[E, C, D]``, a loop over groups for
    ``[R, D]``): what ``lean_ffn`` must match, outputs and gradients."""
    if x.dim() == 3:
        return torch.bmm(activate_reference(torch.bmm(x, w_in), activation), w_out)
    return grouped_mm_loop(activate_reference(grouped_mm_loop(x, w_in, offs_E), activation), w_out, offs_E)
