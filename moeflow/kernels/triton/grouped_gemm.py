"""Grouped expert GEMMs over variable-size row groups, activation fused (legend: moeflow.types).

Rows are grouped by expert: group ``e`` owns rows ``offs_E[e-1] : offs_E[e]`` of ``x_RD``
(``offs_E`` is the inclusive cumulative count, ``offs_E[-1] == R``, as in
``moeflow.kernels.grouped_mm``). Groups may be empty.

Offsets that break that contract: the public entry points raise ``ValueError`` like the
reference when the offsets are on the host (CPU ``offs_E``/``counts_E``: checking is free) and
the call is not being traced by ``torch.compile``. Offsets already on the GPU are *not* checked
(that would be a host sync in the hot path); the kernels then stay memory safe instead: the
offsets are clamped to ``[0, R]`` and made non-decreasing on the device (a group that runs past
``R`` is cut at ``R``), and rows after the last offset, which belong to no group, come out as
exact zeros (an extra "tail" group with an empty contraction), so their gradients are zeros too.

Three tiers, one module each: the Triton kernels (``grouped_gemm_kernels``: the product with a
plain, activation or activation-backward epilogue, and the weight gradient), their launchers
(``grouped_gemm_launch``: tiles, schedule, allocation) and, here, the differentiable
``torch.library`` custom ops (fake kernels and autograd, so ``torch.compile`` traces through
them) with the public entry points ``grouped_mm_triton`` (reference
``moeflow.kernels.grouped_mm_loop``) and ``grouped_ffn_triton`` (reference
``moeflow.experts.ffn.grouped_ffn`` with the loop backend and no bias).
"""

from __future__ import annotations

import torch

from moeflow.kernels.triton.grouped_gemm_kernels import MODE_ACT, MODE_DACT, MODE_PLAIN, TRITON_ACTIVATIONS
from moeflow.kernels.triton.grouped_gemm_launch import launch_gmm, launch_wgrad

__all__ = ["grouped_mm_triton", "grouped_ffn_triton", "TRITON_ACTIVATIONS"]


# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("moeflow::grouped_mm_wgrad", mutates_args=())
def _wgrad_op(a_RK: torch.Tensor, b_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return launch_wgrad(a_RK, b_RN, offs_E)


@_wgrad_op.register_fake
def _(a_RK, b_RN, offs_E):
    return a_RK.new_empty(offs_E.shape[0], a_RK.shape[1], b_RN.shape[1])


@torch.library.custom_op("moeflow::grouped_mm", mutates_args=())
def _gmm_op(x_RD: torch.Tensor, w_EDN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return launch_gmm(x_RD, w_EDN, offs_E, mode=MODE_PLAIN)[0]


@_gmm_op.register_fake
def _(x_RD, w_EDN, offs_E):
    return x_RD.new_empty(x_RD.shape[0], w_EDN.shape[2])


def _gmm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gmm_backward(ctx, grad_RN):
    x_RD, w_EDN, offs_E = ctx.saved_tensors
    grad_RN = grad_RN.contiguous()
    grad_x = _gmm_op(grad_RN, w_EDN.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
    grad_w = _wgrad_op(x_RD, grad_RN, offs_E) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


_gmm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)


@torch.library.custom_op("moeflow::grouped_mm_dact", mutates_args=())
def _dact_op(
    grad_RD: torch.Tensor, w_out_EHD: torch.Tensor, offs_E: torch.Tensor, h_RF: torch.Tensor, activation: str
) -> torch.Tensor:
    return launch_gmm(grad_RD, w_out_EHD.transpose(1, 2), offs_E, mode=MODE_DACT, activation=activation, pre_RF=h_RF)[0]


@_dact_op.register_fake
def _(grad_RD, w_out_EHD, offs_E, h_RF, activation):
    return grad_RD.new_empty(h_RF.shape)  # the real op allocates dh like the gradient


@torch.library.custom_op("moeflow::grouped_ffn", mutates_args=())
def _ffn_op(
    x_RD: torch.Tensor, w_in_EDF: torch.Tensor, w_out_EHD: torch.Tensor, offs_E: torch.Tensor, activation: str,
    save_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, a)``; ``save_h=False`` (no gradient wanted) skips writing ``h``, returned ``[0, F]``."""
    a_RH, h_RF = launch_gmm(x_RD, w_in_EDF, offs_E, mode=MODE_ACT, activation=activation, store_pre=save_h)
    y_RD = launch_gmm(a_RH, w_out_EHD, offs_E, mode=MODE_PLAIN)[0]
    return y_RD, h_RF, a_RH


@_ffn_op.register_fake
def _(x_RD, w_in_EDF, w_out_EHD, offs_E, activation, save_h=True):
    R = x_RD.shape[0]
    return (
        x_RD.new_empty(R, w_out_EHD.shape[2]),
        x_RD.new_empty(R if save_h else 0, w_in_EDF.shape[2]),
        x_RD.new_empty(R, w_out_EHD.shape[1]),
    )


def _ffn_setup(ctx, inputs, output):
    x_RD, w_in_EDF, w_out_EHD, offs_E, activation = inputs[:5]
    _, h_RF, a_RH = output
    ctx.activation = activation
    ctx.mark_non_differentiable(h_RF, a_RH)
    ctx.save_for_backward(x_RD, w_in_EDF, w_out_EHD, offs_E, h_RF, a_RH)


def _ffn_backward(ctx, grad_y_RD, _grad_h, _grad_a):
    x_RD, w_in_EDF, w_out_EHD, offs_E, h_RF, a_RH = ctx.saved_tensors
    grad_y_RD = grad_y_RD.contiguous()
    # dh = act'(h) * (dy @ w_out^T), one kernel; then the two weight gradients and dx
    grad_h_RF = _dact_op(grad_y_RD, w_out_EHD, offs_E, h_RF, ctx.activation)
    grad_w_out = _wgrad_op(a_RH, grad_y_RD, offs_E) if ctx.needs_input_grad[2] else None
    grad_w_in = _wgrad_op(x_RD, grad_h_RF, offs_E) if ctx.needs_input_grad[1] else None
    grad_x = _gmm_op(grad_h_RF, w_in_EDF.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
    return grad_x, grad_w_in, grad_w_out, None, None, None


_ffn_op.register_autograd(_ffn_backward, setup_context=_ffn_setup)


# ---------------------------------------------------------------------------------------------
# public entry points


def _check_grouped(op: str, x_RD: torch.Tensor, offs_E: torch.Tensor, *weights: tuple[str, torch.Tensor]) -> None:
    if x_RD.dim() != 2:
        raise ValueError(f"{op}: x_RD must be 2-D [R, D], got shape {tuple(x_RD.shape)}")
    if x_RD.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: x_RD must be float32, bfloat16 or float16, got {x_RD.dtype}")
    if offs_E.dim() != 1 or offs_E.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: offs_E must be a 1-D int32/int64 tensor, got {offs_E.dtype} shape {tuple(offs_E.shape)}")
    for name, w in weights:
        if w.dim() != 3 or w.shape[0] != offs_E.shape[0]:
            raise ValueError(f"{op}: {name} must be [E={offs_E.shape[0]}, ., .], got shape {tuple(w.shape)}")
        if w.dtype != x_RD.dtype:
            raise TypeError(f"{op}: {name} dtype {w.dtype} differs from x_RD dtype {x_RD.dtype}")


def _check_offsets_on_host(op: str, offs_E: torch.Tensor, R: int) -> None:
    """Raise like the reference when the offsets are on the host (free to read) and we are not
    being traced; offsets on the GPU are left to the kernels' clamping (module docstring)."""
    if offs_E.device.type != "cpu" or offs_E.numel() == 0 or torch.compiler.is_compiling():
        return
    if bool((offs_E[1:] < offs_E[:-1]).any()) or int(offs_E[0]) < 0:
        raise ValueError(f"{op}: offs_E must be non-decreasing and non-negative, got {offs_E.tolist()}")
    if int(offs_E[-1]) != R:
        raise ValueError(f"{op}: offs_E[-1]={int(offs_E[-1])} must equal the number of rows {R}")


def grouped_mm_triton(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``y_RF[rows of e] = x_RD[rows of e] @ w_EDF[e]`` (module docstring), differentiable.

    Same signature and contract as the other ``moeflow.kernels.GROUPED_MM_BACKENDS``.
    """
    _check_grouped("grouped_mm_triton", x_RD, offs_E, ("w_EDF", w_EDF))
    if w_EDF.shape[1] != x_RD.shape[1]:
        raise ValueError(f"grouped_mm_triton: w_EDF is {tuple(w_EDF.shape)}, x_RD has {x_RD.shape[1]} features")
    _check_offsets_on_host("grouped_mm_triton", offs_E, x_RD.shape[0])
    return _gmm_op(x_RD, w_EDF, offs_E.to(x_RD.device))


def grouped_ffn_triton(
    x_RD: torch.Tensor,
    counts_E: torch.Tensor,
    w_in_EDF: torch.Tensor,
    w_out_EHD: torch.Tensor,
    *,
    activation: str,
) -> torch.Tensor:
    """``y_RD = act(x_RD @ W_in[e]) @ W_out[e]`` on rows grouped by expert, activation fused.

    ``counts_E[e]`` rows belong to expert ``e`` (``R == counts_E.sum()``: checked, raising
    ``ValueError``, when ``counts_E`` is on the host; on the GPU see the module docstring). ``w_in_EDF`` is
    ``[E, D, F]`` with ``F = 2H`` for gated activations (gate columns first, then up),
    ``w_out_EHD`` is ``[E, H, D]``; any strides. ``activation`` is one of ``TRITON_ACTIVATIONS``.
    Saves the pre-activation ``h_RF`` and ``a_RH`` for the backward (as eager autograd does);
    when no gradient is wanted (grad mode off, or no input requires grad) ``h`` is not written.
    """
    if activation not in TRITON_ACTIVATIONS:
        raise ValueError(f"grouped_ffn_triton: activation must be one of {list(TRITON_ACTIVATIONS)}, got {activation!r}")
    if counts_E.device.type == "cpu" and not torch.compiler.is_compiling() and bool((counts_E < 0).any()):
        raise ValueError(f"grouped_ffn_triton: counts_E must be non-negative, got {counts_E.tolist()}")
    offs_E = torch.cumsum(counts_E, 0)
    _check_grouped("grouped_ffn_triton", x_RD, offs_E, ("w_in_EDF", w_in_EDF), ("w_out_EHD", w_out_EHD))
    _check_offsets_on_host("grouped_ffn_triton", offs_E, x_RD.shape[0])
    offs_E = offs_E.to(x_RD.device)
    gated = TRITON_ACTIVATIONS[activation][1]
    D, F = w_in_EDF.shape[1], w_in_EDF.shape[2]
    H = w_out_EHD.shape[1]
    if D != x_RD.shape[1] or F != (2 * H if gated else H):
        raise ValueError(
            f"grouped_ffn_triton: shapes do not chain: x_RD {tuple(x_RD.shape)}, w_in_EDF {tuple(w_in_EDF.shape)}, "
            f"w_out_EHD {tuple(w_out_EHD.shape)} with activation={activation!r}"
        )
    # h_RF is only read by the backward: skip writing it when no gradient will be taken
    save_h = torch.is_grad_enabled() and (x_RD.requires_grad or w_in_EDF.requires_grad or w_out_EHD.requires_grad)
    return _ffn_op(x_RD, w_in_EDF, w_out_EHD, offs_E, activation, save_h)[0]

