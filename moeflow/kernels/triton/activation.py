"""Triton kernels of the expert activation and its backward (``moeflow.kernels.activation``;
legend there): one pass each, fp32 arithmetic, the same activation formulas as the fused
grouped-GEMM epilogues (``grouped_gemm_kernels._act`` / ``_act_grad``).

    forward:   a[n, c] = act(h[n, c])                   (gated: act(h[n, c]) * up(h[n, H + c]))
    backward:  h[n, c] := act'(h[n, c]) * da[n, c]      (gated: act'(g) * up(u) * da at the gate,
                                                         act(g) * up'(u) * da at the up half), in place

``up`` is the identity but for swiglu_oai (``clamp(u, -limit, limit) + 1``: ``_up``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard
from moeflow.kernels.triton.grouped_gemm_kernels import TRITON_ACTIVATIONS, _act, _act_grad, _up, _up_grad

__all__ = ["launch_activate", "launch_activate_backward_", "ACT_CODES"]

# activation -> (the epilogue helpers' code, gated): the grouped GEMM's table, not a second one
ACT_CODES = TRITON_ACTIVATIONS
_BLOCK_N = 8
_BLOCK_C = 256


@triton.jit
def _activate_kernel(h_ptr, a_ptr, N, C, s_h, s_a, ACT: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < N)[:, None] & (cols < C)[None, :]
    base = rows.to(tl.int64)[:, None] * s_h + cols[None, :]
    g = tl.load(h_ptr + base, mask=m, other=0.0).to(tl.float32)
    a = _act(g, ACT)
    if GATED:
        a = a * _up(tl.load(h_ptr + base + C, mask=m, other=0.0).to(tl.float32), ACT)
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * s_a + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def _activate_backward_kernel(h_ptr, da_ptr, out_ptr, N, C, s_h, s_da, s_out, ACT: tl.constexpr, GATED: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < N)[:, None] & (cols < C)[None, :]
    base = rows.to(tl.int64)[:, None] * s_h + cols[None, :]
    g = tl.load(h_ptr + base, mask=m, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows.to(tl.int64)[:, None] * s_da + cols[None, :], mask=m, other=0.0).to(tl.float32)
    dst = rows.to(tl.int64)[:, None] * s_out + cols[None, :]  # out_ptr may be h_ptr (in place)
    if GATED:
        u = tl.load(h_ptr + base + C, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + dst, (_act_grad(g, ACT) * _up(u, ACT) * da).to(out_ptr.dtype.element_ty), mask=m)
        tl.store(out_ptr + dst + C, (_act(g, ACT) * _up_grad(u, ACT) * da).to(out_ptr.dtype.element_ty), mask=m)
    else:
        tl.store(out_ptr + dst, (_act_grad(g, ACT) * da).to(out_ptr.dtype.element_ty), mask=m)


def _grid(N: int, C: int) -> tuple[int, int]:
    return triton.cdiv(N, _BLOCK_N), triton.cdiv(C, _BLOCK_C)


def launch_activate(h: torch.Tensor, activation: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a = act(h)`` for ``h [..., F]`` (contiguous copy if needed), in ``h``'s dtype; into
    ``out`` (``[N, C]``, rows of unit column stride, e.g. a row slice of a bigger buffer) when
    given."""
    check_triton_tensors("activate", h=h)
    code, gated = ACT_CODES[activation]
    F_ = h.shape[-1]
    C = F_ // 2 if gated else F_
    h2 = h.reshape(-1, F_).contiguous()
    N = h2.shape[0]
    if out is not None and (tuple(out.shape) != (N, C) or out.stride(-1) != 1 or out.dtype != h.dtype):
        raise ValueError(f"activate: out must be [{N}, {C}] {h.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    a = torch.empty(N, C, dtype=h.dtype, device=h.device) if out is None else out
    if N and C:
        with device_guard(h2):
            _activate_kernel[_grid(N, C)](h2, a, N, C, h2.stride(0), a.stride(0), ACT=code, GATED=gated,
                                          BLOCK_N=_BLOCK_N, BLOCK_C=_BLOCK_C)
    return a if out is not None else a.view(*h.shape[:-1], C)


def launch_activate_backward_(h: torch.Tensor, da: torch.Tensor, activation: str,
                              out: torch.Tensor | None = None) -> None:
    """``h [N, F]`` (contiguous) := ``act'(h) * da`` (``da [N, C]``), in place; or, ``out``
    given (``[N, F]`` with unit column stride, e.g. a row slice of a bigger buffer), into
    ``out``, ``h`` unchanged."""
    check_triton_tensors("activate_backward_", h=h, da=da)
    code, gated = ACT_CODES[activation]
    N, F_ = h.shape
    C = F_ // 2 if gated else F_
    da = da.contiguous()
    if out is None:
        out = h
    elif tuple(out.shape) != (N, F_) or out.stride(-1) != 1 or out.dtype != h.dtype:
        raise ValueError(f"activate_backward_: out must be [{N}, {F_}] {h.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if N and C:
        with device_guard(h):
            _activate_backward_kernel[_grid(N, C)](h, da, out, N, C, h.stride(0), da.stride(0), out.stride(0),
                                                   ACT=code, GATED=gated, BLOCK_N=_BLOCK_N, BLOCK_C=_BLOCK_C)
