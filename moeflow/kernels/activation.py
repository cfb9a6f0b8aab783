"""The expert activation and its backward as single ops, on any device (legend: moeflow.types;
``N`` rows, ``F`` the first GEMM's width: ``2H`` for a gated activation, ``H`` otherwise).

    a_NH = activate(h_NF, activation)               # act(h), or act(gate) * up for swiglu / geglu
    activate_backward_(h_NF, da_NH, activation)     # h_NF := d act(h) / dh * da, in place
    activate_into / activate_backward_into          # the same into a caller's buffer (eager)

``activation``: one of ``ACTIVATIONS`` (``swiglu``, ``geglu``, ``silu``, ``gelu`` (exact, erf),
``relu``, ``swiglu_oai``). This module holds moeflow's one vocabulary of activation names:

    Activation   the names, as a ``typing.Literal`` (configs validate against it)
    ACTIVATIONS  the same names as a tuple (derived from ``Activation``)
    GATED        the gated kinds: ``act(gate) * up`` over the two halves of ``w_in``'s columns
    ELEMENTWISE  the elementwise function each kind applies (to the gate half when gated)

``swiglu_oai`` is gpt-oss's clamped SwiGLU (transformers' ``GptOssExperts._apply_gate``) with
its published constants ``SWIGLU_OAI_ALPHA = 1.702`` and ``SWIGLU_OAI_LIMIT = 7.0``:

    g = min(gate, limit);  a = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)

in moeflow's layout (gate columns, then up columns; gpt-oss interleaves them, which its weight
map undoes). Its gradient is autograd's through those ops, zero where a clamp is active (a gate
above ``limit``, an up value outside ``[-limit, limit]``; at the limit itself it passes, as
``torch.clamp``'s backward lets it), and the references compute it with the same kernels
autograd runs, in the same order, so it is bit-equal to plain autograd too.

Configs, experts, the CLI and the test references import them from here. The Triton kernels
below these ops cannot (``moeflow.kernels.triton`` imports nothing from outside itself): their
table of codes (``TRITON_ACTIVATIONS``) is checked against these names by a test.

Why ops: written in torch, a SwiGLU forward is two passes over the rows (``silu``, then the
product) and its backward five; the GPU needs one each, reading ``h`` (and ``da``) once and
writing ``a`` (or ``dh``) once. Both are ``torch.library`` custom ops (``moeflow::activate``,
``moeflow::activate_backward_``): on CUDA they run fused Triton kernels
(``moeflow.kernels.triton.activation``; Triton importable), elsewhere (and on CUDA without
Triton) the torch references beside them, which use the same kernels as autograd's own
backward (bit-equal to plain autograd). ``bench.traffic`` counts each as one op.

The backward overwrites ``h`` with ``dh`` (it is not needed afterwards), so it needs no second
``[N, F]`` buffer; the reference does it in a few large row steps with one step-sized
temporary (the up half of ``h`` serves as scratch).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
import torch.nn.functional as F

from moeflow.kernels.triton import triton_available

__all__ = ["Activation", "ACTIVATIONS", "GATED", "ELEMENTWISE", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT",
           "check_activation", "activate", "activate_backward_", "activate_reference", "activate_backward_reference_",
           "activate_into", "activate_backward_into"]

# this order: the layer matrix samples by it (a new name goes at the end)
Activation = Literal["relu", "gelu", "silu", "swiglu", "geglu", "swiglu_oai"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
GATED: frozenset[str] = frozenset({"swiglu", "geglu", "swiglu_oai"})
# (swiglu_oai's gate function is x * sigmoid(1.702 x), "quick GELU", on the clamped gate; its up
# half is clamped and shifted by one: ``_swiglu_oai``)
ELEMENTWISE: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "relu": "relu", "gelu": "gelu", "silu": "silu",
                               "swiglu_oai": "clamped_quick_gelu"}
SWIGLU_OAI_ALPHA = 1.702  # gpt-oss's published constants (config.json: swiglu_alpha, swiglu_limit)
SWIGLU_OAI_LIMIT = 7.0
_FUNCTIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}  # ELEMENTWISE's functions (but swiglu_oai's)
# Each ATen op is a parallel region, and on a busy machine every region waits for its slowest
# thread, so the reference backward takes few, large steps.
_ROW_CHUNKS = 2  # h in this many row steps (temporaries: two [N/2, H])
_MIN_ROW_STEP = 1 << 20  # ... of at least this many elements


def check_activation(activation: object) -> None:
    """``ValueError`` naming ``activation`` unless it is one of ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")


def activate_reference(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``a = act(h)`` in torch ops (gated: ``act(gate) * up`` on the two halves of the last dim);
    differentiable, the gradients of plain autograd. Where autograd records the call the gate's
    product is a new tensor; where it does not (inference, the lean experts' own backward) it is
    taken in place, one ``[..., H]`` buffer fewer: the same values either way."""
    check_activation(activation)
    if activation not in GATED:
        return _FUNCTIONS[activation](h)
    gate, up = h.chunk(2, dim=-1)
    recorded = torch.is_grad_enabled() and h.requires_grad
    if activation == "swiglu_oai":
        return _swiglu_oai(gate, up, recorded)
    a = _FUNCTIONS[ELEMENTWISE[activation]](gate)
    return a * up if recorded else a.mul_(up)


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor, recorded: bool) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU, the ops of ``GptOssExperts._apply_gate`` in its order (so the
    values and autograd's gradients are transformers' own); unrecorded, the same ops in place on
    three ``[..., H]`` temporaries."""
    limit = SWIGLU_OAI_LIMIT
    g = gate.clamp(max=limit)
    if recorded:
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * SWIGLU_OAI_ALPHA))
    glu = g.mul_(g.mul(SWIGLU_OAI_ALPHA).sigmoid_())
    return up.clamp(-limit, limit).add_(1).mul_(glu)


def _slope_times(grad: torch.Tensor, z: torch.Tensor, kind: str, out: torch.Tensor) -> torch.Tensor:
    """``out = f'(z) * grad`` for ``kind`` in silu / gelu / relu, by the kernels autograd's own
    backward uses (so the gradients match plain autograd to the bit); ``out`` may be ``z``."""
    aten = torch.ops.aten
    if kind == "silu":
        return aten.silu_backward.grad_input(grad, z, grad_input=out)
    if kind == "gelu":
        return aten.gelu_backward.grad_input(grad, z, grad_input=out)
    return aten.threshold_backward.grad_input(grad, z, 0, grad_input=out)


def activate_backward_reference_(h_NF: torch.Tensor, da_NH: torch.Tensor, activation: str) -> torch.Tensor:
    """Overwrite ``h`` with ``dh = d act(h) / dh * da`` in torch ops, in row steps with one
    step-size temporary (``h``'s up half is the scratch; ``da`` is only read); returns ``h``."""
    N, F_ = h_NF.shape
    step = max(1, math.ceil(N / _ROW_CHUNKS), _MIN_ROW_STEP // max(F_, 1))
    gated = activation in GATED
    kind = ELEMENTWISE[activation]
    for r in range(0, N, step):
        h, da = h_NF[r : r + step], da_NH[r : r + step]
        if activation == "swiglu_oai":
            _swiglu_oai_backward_(*h.chunk(2, dim=-1), da)
        elif gated:
            gate, up = h.chunk(2, dim=-1)
            f = F.silu(gate) if kind == "silu" else F.gelu(gate)
            f.mul_(da)  # d/dup = f(gate) * da
            up.mul_(da)  # d/dgate (f(gate) * up) = f'(gate) * up * da
            _slope_times(up, gate, kind, out=gate)
            up.copy_(f)
            del f
        else:
            _slope_times(da, h, kind, out=h)
    return h_NF


def _swiglu_oai_backward_(gate: torch.Tensor, up: torch.Tensor, da: torch.Tensor) -> None:
    """``gate := d a / d gate``, ``up := d a / d up`` for ``a = _swiglu_oai(gate, up)``: the
    kernels autograd runs backward through ``_swiglu_oai``'s ops, with its operand order
    (``mul``: ``grad * other``; ``sigmoid``: ``sigmoid_backward(grad, output)``; ``clamp``: the
    gradient where ``min <= x <= max``, else 0), so bit-equal to plain autograd. Temporaries:
    a few of ``gate``'s size (a reference; the GPU's fused kernel needs none)."""
    limit, alpha = SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA
    g = gate.clamp(max=limit)
    s = g.mul(alpha).sigmoid_()  # sigmoid(alpha * g)
    d_glu = up.clamp(-limit, limit).add_(1).mul_(da)  # da * (clamp(up) + 1)
    d_up = (g * s).mul_(da)  # da * glu, through "+ 1" and the up clamp below
    up.copy_(d_up.masked_fill_((up >= -limit).logical_and_(up <= limit).logical_not_(), 0))
    del d_up
    d_t = torch.ops.aten.sigmoid_backward(d_glu * g, s).mul_(alpha)  # through sigmoid(g * alpha)
    d_g = d_glu.mul_(s).add_(d_t)  # the two uses of g, summed
    gate.copy_(d_g.masked_fill_((gate <= limit).logical_not_(), 0))


@torch.library.custom_op("moeflow::activate", mutates_args=())
def _activate_op(h_NF: torch.Tensor, activation: str) -> torch.Tensor:
    return activate_reference(h_NF, activation)


@_activate_op.register_kernel("cuda")
def _(h_NF, activation):  # type: ignore[no-untyped-def]
    if not triton_available(h_NF.device) or h_NF.dtype == torch.float64:
        return activate_reference(h_NF, activation)
    from moeflow.kernels.triton.activation import launch_activate

    return launch_activate(h_NF, activation)


@_activate_op.register_fake
def _(h_NF, activation):  # type: ignore[no-untyped-def]
    F_ = h_NF.shape[-1]
    return h_NF.new_empty(*h_NF.shape[:-1], F_ // 2 if activation in GATED else F_)


@torch.library.custom_op("moeflow::activate_backward_", mutates_args=("h_NF",))
def _activate_backward_op(h_NF: torch.Tensor, da_NH: torch.Tensor, activation: str) -> None:
    activate_backward_reference_(h_NF, da_NH, activation)


@_activate_backward_op.register_kernel("cuda")
def _(h_NF, da_NH, activation):  # type: ignore[no-untyped-def]
    if not triton_available(h_NF.device) or h_NF.dtype == torch.float64:
        activate_backward_reference_(h_NF, da_NH, activation)
        return
    from moeflow.kernels.triton.activation import launch_activate_backward_

    launch_activate_backward_(h_NF, da_NH, activation)


@_activate_backward_op.register_fake
def _(h_NF, da_NH, activation):  # type: ignore[no-untyped-def]
    return None


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``a = act(h)`` as one op (module docstring); ``h [..., F]`` -> ``[..., F/2]`` gated, else
    ``[..., F]``. Not differentiable (the lean experts differentiate it themselves)."""
    check_activation(activation)
    return _activate_op(h, activation)


def activate_backward_(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """Overwrite ``h [N, F]`` with ``d act(h) / dh * da`` (``da [N, F/2]`` gated, else
    ``[N, F]``) as one op; returns ``h``."""
    check_activation(activation)
    if h.dim() != 2 or da.dim() != 2 or h.shape[0] != da.shape[0]:
        raise ValueError(f"activate_backward_: h and da must be 2-D with the same rows, got {tuple(h.shape)} and "
                         f"{tuple(da.shape)}")
    if not h.is_contiguous() or not da.is_contiguous():
        raise ValueError("activate_backward_: h and da must be contiguous (they are overwritten in place)")
    _activate_backward_op(h, da, activation)
    return h


def activate_into(h_NF: torch.Tensor, activation: str, out_NH: torch.Tensor) -> torch.Tensor:
    """``out := act(h)`` for ``h [N, F]``, ``out [N, F/2]`` gated (else ``[N, F]``) with unit
    column stride (a row slice of a bigger buffer: the pipelined experts gather every chunk's
    activation into one tensor this way, with no copy on CUDA); bit-equal to ``activate``.
    Eager only (no op for ``torch.compile``)."""
    check_activation(activation)
    if h_NF.is_cuda and triton_available(h_NF.device) and h_NF.dtype != torch.float64:
        from moeflow.kernels.triton.activation import launch_activate

        return launch_activate(h_NF, activation, out=out_NH)
    return out_NH.copy_(activate_reference(h_NF, activation))


def activate_backward_into(h_NF: torch.Tensor, da_NH: torch.Tensor, activation: str, out_NF: torch.Tensor) -> torch.Tensor:
    """``out := d act(h) / dh * da`` with ``h`` unchanged (``activate_backward_`` writes it over
    ``h``); ``out [N, F]`` with unit column stride (a row slice of a bigger buffer); bit-equal to
    ``activate_backward_``. Eager only."""
    check_activation(activation)
    if h_NF.is_cuda and triton_available(h_NF.device) and h_NF.dtype != torch.float64:
        from moeflow.kernels.triton.activation import launch_activate_backward_

        launch_activate_backward_(h_NF, da_NH.contiguous(), activation, out=out_NF)
        return out_NF
    out_NF.copy_(h_NF)  # the reference works in place (on the CPU the copy is the reference's)
    return activate_backward_reference_(out_NF, da_NH, activation)
