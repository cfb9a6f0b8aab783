"""The expert FFN as two autograd Functions that save only what their backward needs
(legend: moeflow.types; F = width of ``w_in``: 2H for gated activations, else H; N rows).

``y = act(x W_in[e]) W_out[e]`` over rows grouped by expert, in either layout of the experts
protocol: padded ``[E, C, D]`` (batched matmul) or grouped ``[R, D]`` (grouped matmul). No biases
(``GroupedExperts`` with ``bias=True`` takes the plain autograd path).

Why: plain autograd through ``bmm -> chunk -> silu -> mul -> bmm`` saves the input rows, the
whole pre-activation ``h [N, F]`` (twice referenced), ``silu(gate) [N, H]`` and the activation
``a [N, H]`` for the second GEMM, and its backward allocates the gate and up gradients, their
concatenation and the weight gradients while all of those are alive. Here:

- forward saves ``x`` and ``h`` only (``recompute=True``: ``x`` only, and ``h`` is recomputed
  in backward: Megatron-Core's MoE recompute, ScatterMoE's choice of not saving the hidden
  activation); ``a`` is never saved, it is a cheap elementwise recompute from ``h``;
- backward rebuilds ``a = act(h)``, takes ``dW_out = a^T dy`` (``a`` freed), ``da = dy W_out^T``,
  turns ``h`` into ``dh`` **in place** (``h`` is dead after that; the activation's backward runs
  in two row steps with the kernels autograd uses, so the gradients equal plain autograd's to
  the bit), then ``dx = dh W_in^T`` and ``dW_in = x^T dh``: the gate/up gradients are never
  concatenated and ``silu(gate)`` is never kept. The two GEMMs are two autograd nodes
  (``_FirstGEMM``, ``_ActSecondGEMM``), so that autograd frees ``dy`` between them (one node
  for both held it until ``dW_in`` was allocated: +32 MiB at the peak of T=4096, D=1024).

With ``recompute`` the memory saved is what lies between forward and backward (per layer, it
adds up over a model's layers); the backward itself holds the same tensors as without it.

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

from moeflow.kernels.grouped_mm import grouped_mm_loop

__all__ = ["lean_ffn", "ffn_reference", "LEAN_ACTIVATIONS", "LEAN_GEMMS"]

LEAN_ACTIVATIONS = ("swiglu", "geglu", "relu", "gelu", "silu")
LEAN_GEMMS = ("bmm", "grouped_mm", "loop")  # padded layout; grouped native; grouped reference
# Each ATen op is a parallel region, and on a busy machine every region waits for its slowest
# thread (measured on a loaded 2-core VM: a 64-expert FFN run in 64 one-expert chunks was 9x
# slower than in one piece), so the elementwise backward takes few, large steps.
_ROW_CHUNKS = 2  # elementwise backward: h in this many row steps (temporaries: two [N/2, H])
_MIN_ROW_STEP = 1 << 20  # ... of at least this many elements


def _activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``a = act(h)`` (gated: ``act(gate) * up`` on the two halves of the last dim)."""
    if activation in ("swiglu", "geglu"):
        gate, up = h.chunk(2, dim=-1)
        a = F.silu(gate) if activation == "swiglu" else F.gelu(gate)
        return a.mul_(up)
    return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[activation](h)


def _slope_times(grad: torch.Tensor, z: torch.Tensor, kind: str, out: torch.Tensor) -> torch.Tensor:
    """``out = f'(z) * grad`` for ``kind`` in silu / gelu / relu, by the kernels autograd's own
    backward uses (so the gradients match plain autograd to the bit); ``out`` may be ``z``."""
    aten = torch.ops.aten
    if kind == "silu":
        return aten.silu_backward.grad_input(grad, z, grad_input=out)
    if kind == "gelu":
        return aten.gelu_backward.grad_input(grad, z, grad_input=out)
    return aten.threshold_backward.grad_input(grad, z, 0, grad_input=out)


def _act_backward_(h_NF: torch.Tensor, da_NH: torch.Tensor, activation: str) -> torch.Tensor:
    """Overwrite ``h`` with ``dh = d act(h) / dh * da`` (row chunks, two chunk-size
    temporaries at most); returns ``h``."""
    N, F_ = h_NF.shape
    step = max(1, math.ceil(N / _ROW_CHUNKS), _MIN_ROW_STEP // max(F_, 1))
    gated = activation in ("swiglu", "geglu")
    kind = {"swiglu": "silu", "geglu": "gelu"}.get(activation, activation)
    for r in range(0, N, step):
        h, da = h_NF[r : r + step], da_NH[r : r + step]
        if gated:
            gate, up = h.chunk(2, dim=-1)
            da_up = da * up  # d/dgate (f(gate) * up) = f'(gate) * up * da
            f = F.silu(gate) if kind == "silu" else F.gelu(gate)
            torch.mul(f, da, out=up)  # d/dup = f(gate) * da
            del f
            _slope_times(da_up, gate, kind, out=gate)
        else:
            _slope_times(da, h, kind, out=h)
    return h_NF


def _mm(gemm: str, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Per-group ``x @ w[e]`` (no autograd)."""
    if gemm == "bmm":
        return torch.bmm(x, w)
    if gemm == "grouped_mm":
        return F.grouped_mm(x, w, offs=offs)
    return grouped_mm_loop(x, w, offs)


def _mm_weight_grad(gemm: str, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor | None,
                    like: torch.Tensor) -> torch.Tensor:
    """``dW[e] = x_e^T g_e`` shaped like ``like`` (``[E, D, F]``)."""
    if gemm == "bmm":
        return torch.bmm(x.transpose(1, 2), g)
    if gemm == "grouped_mm":
        if like.stride(-2) == 1 and not like.is_contiguous():
            # like is the transposed view of an [E, F, D] tensor: produce dW in that layout
            return F.grouped_mm(g.t(), x, offs=offs).transpose(-2, -1)
        return F.grouped_mm(x.t(), g, offs=offs)
    dw = like.new_zeros(like.shape)
    ends = offs.tolist()
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t > s:
            torch.mm(x[s:t].t(), g[s:t], out=dw[e])
    return dw


class _FirstGEMM(torch.autograd.Function):
    """``h = x W_in[e]``; saves ``x`` (needed for ``dW_in``), never ``h``."""

    @staticmethod
    def forward(ctx, x, w_in, offs, gemm):  # type: ignore[override]
        ctx.gemm = gemm
        ctx.save_for_backward(x, w_in, offs)
        with torch.autocast(x.device.type, enabled=False):  # the caller cast the operands
            return _mm(gemm, x, w_in, offs)

    @staticmethod
    @once_differentiable
    def backward(ctx, dh):  # type: ignore[override]
        x, w_in, offs = ctx.saved_tensors
        with torch.autocast(dh.device.type, enabled=False):
            dx = _mm(ctx.gemm, dh, w_in.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
            dw_in = _mm_weight_grad(ctx.gemm, x, dh, offs, w_in) if ctx.needs_input_grad[1] else None
        return dx, dw_in, None, None


class _ActSecondGEMM(torch.autograd.Function):
    """``y = act(h) W_out[e]``; saves ``h`` (or, with recompute, nothing but what recomputes it:
    ``x`` and ``W_in``, already saved by ``_FirstGEMM``). Its own node, so that autograd frees
    ``dy`` before the first GEMM's backward allocates ``dx`` and ``dW_in``."""

    @staticmethod
    def forward(ctx, h, x, w_in, w_out, offs, activation, gemm, recompute):  # type: ignore[override]
        ctx.activation, ctx.gemm, ctx.recompute = activation, gemm, recompute
        ctx.save_for_backward(*((x, w_in) if recompute else (h,)), w_out, offs)
        with torch.autocast(h.device.type, enabled=False):
            return _mm(gemm, _activate(h, activation), w_out, offs)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        *saved, w_out, offs = ctx.saved_tensors
        act, gemm = ctx.activation, ctx.gemm
        with torch.autocast(dy.device.type, enabled=False):
            dy = dy.contiguous()
            h = _mm(gemm, saved[0], saved[1], offs) if ctx.recompute else saved[0]
            dw_out = _mm_weight_grad(gemm, _activate(h, act), dy, offs, w_out) if ctx.needs_input_grad[3] else None
            da = _mm(gemm, dy, w_out.transpose(-2, -1), offs)
            dh = _act_backward_(h.view(-1, h.shape[-1]), da.view(-1, da.shape[-1]), act).view(h.shape)
        return dh, None, None, dw_out, None, None, None, None


def lean_ffn(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    offs_E: torch.Tensor | None,
    *,
    activation: str,
    gemm: str,
    recompute: bool = False,
) -> torch.Tensor:
    """``act(x W_in[e]) W_out[e]`` per expert with the lean backward (module docstring).

    Args:
        x: ``[E, C, D]`` with ``gemm="bmm"``, or ``[R, D]`` grouped by expert.
        w_in: ``[E, D, F]``; w_out: ``[E, H, D]`` (any strides for the grouped GEMMs).
        offs_E: inclusive cumulative row counts (grouped layouts; int32 for ``"grouped_mm"``),
            None for ``"bmm"``.
        activation: one of ``LEAN_ACTIVATIONS``; gemm: one of ``LEAN_GEMMS``.
        recompute: save only ``x`` and recompute ``h = x W_in`` in backward.
    """
    if activation not in LEAN_ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(LEAN_ACTIVATIONS)}, got {activation!r}")
    if gemm not in LEAN_GEMMS:
        raise ValueError(f"gemm must be one of {list(LEAN_GEMMS)}, got {gemm!r}")
    if not isinstance(recompute, bool):
        raise TypeError(f"recompute must be a bool, got {recompute!r}")
    if offs_E is None:
        offs_E = x.new_empty(0, dtype=torch.int32)  # save_for_backward needs a tensor
    h = _FirstGEMM.apply(x, w_in, offs_E, gemm)
    return _ActSecondGEMM.apply(h, x, w_in, w_out, offs_E, activation, gemm, recompute)


def ffn_reference(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, offs_E: torch.Tensor | None, *,
                  activation: str) -> torch.Tensor:
    """The same FFN through plain autograd (``bmm`` for ``[E, C, D]``, a loop over groups for
    ``[R, D]``): what ``lean_ffn`` must match, outputs and gradients."""
    from moeflow.experts.ffn import activate

    if x.dim() == 3:
        return torch.bmm(activate(torch.bmm(x, w_in), activation), w_out)
    return grouped_mm_loop(activate(grouped_mm_loop(x, w_in, offs_E), activation), w_out, offs_E)
