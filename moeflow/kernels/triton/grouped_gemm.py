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

Kernels (all fp32 accumulation):

- ``_gmm_kernel``: ``out[rows of e] = epilogue(x[rows of e] @ w[e])`` with three epilogues:
  ``plain`` (store the product), ``act`` (the expert's input projection: store the
  pre-activation ``h`` for backward and ``a = act(h)``; a gated activation keeps two
  accumulators, gate columns ``n`` and up columns ``H + n`` of ``w_in``, so ``h`` never makes a
  round trip through memory before the gate multiplies it), and ``dact`` (backward of the output
  projection fused with the activation backward: ``dh = act'(h) * (dy @ w_out[e]^T)``).
  Tiles are scheduled without a host sync: the grid has ``ceil(R / BLOCK_M) + E + 1`` row tiles
  (an upper bound; the ``+ 1`` is the zero-filled tail group), each program finds its expert from
  the cumulative tile counts and idle programs return at once. Programs walk the tiles in groups
  of 8 row tiles (``_swizzle``) so operands are reused from L2. Under no gradient the ``act``
  epilogue skips storing ``h`` (``save_h`` of the FFN op).
- ``_gmm_wgrad_kernel``: the weight gradient ``dw[e] = x[rows of e]^T @ dy[rows of e]``; one
  program per ``(k-tile x n-tile, e)`` (the tile count on grid axis 0, which has no 65535 cap;
  ``E`` on axis 1) loops over the group's rows; empty groups get exact zeros.

Weights are read through their strides, so a transposed view (``w_out^T`` in the backward, a
Hugging Face ``[E, F, D]`` parameter's transpose) costs no copy.

Differentiable entry points (``torch.library`` custom ops with fake kernels and autograd):
``grouped_mm_triton`` (reference ``moeflow.kernels.grouped_mm_loop``) and ``grouped_ffn_triton``
(reference ``moeflow.experts.ffn.grouped_ffn`` with the loop backend and no bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeflow.kernels.triton import check_triton_tensors, device_guard as _device_guard

__all__ = ["grouped_mm_triton", "grouped_ffn_triton", "TRITON_ACTIVATIONS"]

# name -> (elementwise activation code, gated)
TRITON_ACTIVATIONS: dict[str, tuple[int, bool]] = {
    "gelu": (1, False),
    "silu": (2, False),
    "relu": (3, False),
    "geglu": (1, True),
    "swiglu": (2, True),
}
_PLAIN, _ACT, _DACT = 0, 1, 2


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:  # exact (erf) GELU, like F.gelu's default
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # SiLU
        return x / (1.0 + tl.exp(-x))
    elif ACT == 3:
        return tl.maximum(x, 0.0)
    else:
        return x


@triton.jit
def _act_grad(x, ACT: tl.constexpr):
    if ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        return cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == 2:
        s = 1.0 / (1.0 + tl.exp(-x))
        return s * (1.0 + x * (1.0 - s))
    elif ACT == 3:
        return (x > 0).to(tl.float32)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _swizzle(pid, num_m, num_n, GROUP: tl.constexpr):
    """Linear program id -> (tile_m, tile_n), ``GROUP`` row tiles at a time.

    Programs that run together then share ``GROUP`` row tiles of the left operand and a band of
    column tiles of the right one, both of which stay in L2; plain row-major order would stream
    the whole left operand from memory once per column tile."""
    per_group = GROUP * num_n
    first_m = (pid // per_group) * GROUP
    size_m = tl.minimum(num_m - first_m, GROUP)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _dot(a, b, acc, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gmm_kernel(
    x_ptr, w_ptr, out_ptr, pre_ptr,
    row_start_ptr, row_end_ptr, tile_start_ptr, tile_end_ptr,
    N, KD, E, NUM_M,
    s_xr, s_xk, s_we, s_wk, s_wn, s_or, s_on, s_pr, s_pn,
    MODE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr, STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _swizzle(tl.program_id(0), NUM_M, tl.cdiv(N, BLOCK_N), GROUP_M)
    experts = tl.arange(0, BLOCK_E)
    # groups 0..E-1 are the experts, group E the rows after the last offset (zero-filled)
    tile_end = tl.load(tile_end_ptr + experts, mask=experts <= E, other=2147483647)
    e = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)  # first group whose tiles reach pid_m
    if e > E:
        return
    k_end = tl.where(e < E, KD, 0)  # the tail group: empty contraction, acc stays zero
    row0 = tl.load(row_start_ptr + e) + (pid_m - tl.load(tile_start_ptr + e)) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < tl.load(row_end_ptr + e)
    rows64 = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_base = w_ptr + e.to(tl.int64) * s_we

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < KD
        a = tl.load(x_ptr + rows64[:, None] * s_xr + kk[None, :] * s_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_base + kk[:, None] * s_wk + cols[None, :] * s_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot(a, b, acc, DOT_F32)
        if MODE == 1:
            if GATED:  # up half of w_in: columns N + n
                b_up = tl.load(w_base + kk[:, None] * s_wk + (cols + N)[None, :] * s_wn,
                               mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                acc_up = _dot(a, b_up, acc_up, DOT_F32)

    ok = row_ok[:, None] & col_ok[None, :]
    out_at = out_ptr + rows64[:, None] * s_or + cols[None, :] * s_on
    pre_at = pre_ptr + rows64[:, None] * s_pr + cols[None, :] * s_pn
    if MODE == 0:
        tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=ok)
    elif MODE == 1:
        if STORE_PRE:  # h is kept for the backward only
            tl.store(pre_at, acc.to(pre_ptr.dtype.element_ty), mask=ok)
            if GATED:
                tl.store(pre_at + N * s_pn, acc_up.to(pre_ptr.dtype.element_ty), mask=ok)
        if GATED:
            y = _act(acc, ACT) * acc_up
        else:
            y = _act(acc, ACT)
        tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # acc is the gradient of the activation output, tile [rows, hidden cols]
        g = tl.load(pre_at, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(pre_at + N * s_pn, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_at, (acc * u * _act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(out_at + N * s_on, (acc * _act(g, ACT)).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(out_at, (acc * _act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gmm_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, row_start_ptr, row_end_ptr,
    KD, N,
    s_ar, s_ak, s_br, s_bn, s_oe, s_ok, s_on,
    DOT_F32: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP_K: tl.constexpr,
):
    e = tl.program_id(1)
    pid_k, pid_n = _swizzle(tl.program_id(0), tl.cdiv(KD, BLOCK_K), tl.cdiv(N, BLOCK_N), GROUP_K)
    start = tl.load(row_start_ptr + e)
    end = tl.load(row_end_ptr + e)
    kk = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    nn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = kk < KD
    n_ok = nn < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < end
        rr64 = rr.to(tl.int64)
        a_t = tl.load(a_ptr + rr64[None, :] * s_ar + kk[:, None] * s_ak, mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rr64[:, None] * s_br + nn[None, :] * s_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _dot(a_t, b, acc, DOT_F32)
    out_at = out_ptr + e.to(tl.int64) * s_oe + kk[:, None] * s_ok + nn[None, :] * s_on
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------
# launchers


def _config(dtype: torch.dtype, device: torch.device, gated: bool) -> dict[str, int]:
    """Tile sizes. Interpreter: small tiles (fewer wasted lanes at test sizes). GPU: 16-bit
    types use the tensor cores with 128x128x64 tiles (64 columns when two accumulators are live);
    fp32 runs the IEEE path with smaller tiles. Untuned: see bench/gpu_kernels.py."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64 if gated else 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _dot_f32(dtype: torch.dtype, device: torch.device) -> bool:
    # the interpreter has no 16-bit dot; fp32 inputs take the IEEE path to match torch.mm
    return device.type != "cuda" or dtype == torch.float32


def _schedule(offs_E: torch.Tensor, block_m: int, R: int) -> tuple[torch.Tensor, ...]:
    """int32 ``(row_start_G, row_end_G, tile_start_G, tile_end_G)`` for ``G = E + 1`` groups from
    the inclusive offsets: the ``E`` experts, then the tail ``[end of the last group, R)``.

    The offsets are clamped to ``[0, R]`` and made non-decreasing on the device (no host sync),
    so no group reaches past ``R`` and every row is in exactly one group."""
    end_E = torch.cummax(offs_E.to(torch.int64).clamp(0, R), 0).values
    end_E = torch.cat([end_E, end_E.new_full((1,), R)])
    count_E = torch.diff(end_E, prepend=end_E.new_zeros(1))
    tiles_E = torch.div(count_E + block_m - 1, block_m, rounding_mode="floor")
    tile_end_E = torch.cumsum(tiles_E, 0)
    as32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return as32(end_E - count_E), as32(end_E), as32(tile_end_E - tiles_E), as32(tile_end_E)


def _launch_gmm(
    x_RK: torch.Tensor,
    w_EKN: torch.Tensor,
    offs_E: torch.Tensor,
    *,
    mode: int,
    activation: str = "none",
    pre_RF: torch.Tensor | None = None,
    store_pre: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``_gmm_kernel``; returns ``(out, pre)`` (``pre`` only for the act epilogue; with
    ``store_pre=False`` it is an empty ``[0, F]`` tensor and ``h`` is never written).

    plain: ``out [R, N]``. act: ``w`` is ``w_in [E, D, F]``, out ``a [R, H]``, pre ``h [R, F]``.
    dact: ``w`` is ``w_out^T [E, D, H]``, ``pre_RF`` is ``h``, out ``dh [R, F]``.
    """
    check_triton_tensors("grouped GEMM", x=x_RK)
    R, KD = x_RK.shape
    E = w_EKN.shape[0]
    act, gated = TRITON_ACTIVATIONS.get(activation, (0, False))
    width = w_EKN.shape[2]
    N = width // 2 if (mode == _ACT and gated) else width
    dev, dt = x_RK.device, x_RK.dtype
    if mode == _PLAIN:
        out = torch.empty(R, N, dtype=dt, device=dev)
        pre = None
    elif mode == _ACT:
        out = torch.empty(R, N, dtype=dt, device=dev)
        pre = torch.empty(R if store_pre else 0, width, dtype=dt, device=dev)
    else:
        out = torch.empty(R, 2 * N if gated else N, dtype=dt, device=dev)
        pre = pre_RF
    if R == 0 or N == 0:
        return out, pre
    if KD == 0:
        # empty contraction: the product is zero (and so is everything downstream of it)
        out.zero_()
        if mode == _ACT:
            pre.zero_()
        return out, pre
    cfg = _config(dt, dev, gated and mode != _PLAIN)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    row_start, row_end, tile_start, tile_end = _schedule(offs_E, bm, R)
    pre_arg = out if (pre is None or pre.shape[0] != R) else pre
    # an upper bound on the row tiles (E groups and the tail): no host sync for the real count
    num_m = triton.cdiv(R, bm) + E + 1
    with _device_guard(x_RK):
        _gmm_kernel[(num_m * triton.cdiv(N, bn),)](
            x_RK, w_EKN, out, pre_arg, row_start, row_end, tile_start, tile_end,
            N, KD, E, num_m,
            x_RK.stride(0), x_RK.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
            out.stride(0), out.stride(1), pre_arg.stride(0), pre_arg.stride(1),
            MODE=mode, ACT=act, GATED=gated, DOT_F32=_dot_f32(dt, dev), STORE_PRE=pre_arg is not out,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E + 1), GROUP_M=8,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out, pre


def _launch_wgrad(a_RK: torch.Tensor, b_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``dw_EKN[e] = a[rows of e]^T @ b[rows of e]`` (zeros for empty groups)."""
    check_triton_tensors("grouped GEMM weight gradient", a=a_RK)
    E = offs_E.shape[0]
    KD, N = a_RK.shape[1], b_RN.shape[1]
    out = torch.empty(E, KD, N, dtype=a_RK.dtype, device=a_RK.device)
    if E == 0 or KD == 0 or N == 0:
        return out
    if a_RK.shape[0] == 0:
        return out.zero_()
    cuda = a_RK.device.type == "cuda"
    br, bk, bn = (64, 128, 128) if cuda and a_RK.dtype != torch.float32 else ((32, 64, 64) if cuda else (16, 32, 32))
    row_start, row_end, _, _ = _schedule(offs_E, 1, a_RK.shape[0])  # the tail group is not launched
    grid = (triton.cdiv(KD, bk) * triton.cdiv(N, bn), E)  # tiles on axis 0 (no 65535 cap)
    with _device_guard(a_RK):
        _gmm_wgrad_kernel[grid](
            a_RK, b_RN, out, row_start, row_end, KD, N,
            a_RK.stride(0), a_RK.stride(1), b_RN.stride(0), b_RN.stride(1), out.stride(0), out.stride(1), out.stride(2),
            DOT_F32=_dot_f32(a_RK.dtype, a_RK.device), BLOCK_R=br, BLOCK_K=bk, BLOCK_N=bn, GROUP_K=8,
            num_warps=8 if cuda else 4, num_stages=3 if cuda else 1,
        )
    return out


# ---------------------------------------------------------------------------------------------
# custom ops


@torch.library.custom_op("moeflow::grouped_mm_wgrad", mutates_args=())
def _wgrad_op(a_RK: torch.Tensor, b_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _launch_wgrad(a_RK, b_RN, offs_E)


@_wgrad_op.register_fake
def _(a_RK, b_RN, offs_E):
    return a_RK.new_empty(offs_E.shape[0], a_RK.shape[1], b_RN.shape[1])


@torch.library.custom_op("moeflow::grouped_mm", mutates_args=())
def _gmm_op(x_RD: torch.Tensor, w_EDN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return _launch_gmm(x_RD, w_EDN, offs_E, mode=_PLAIN)[0]


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
    return _launch_gmm(grad_RD, w_out_EHD.transpose(1, 2), offs_E, mode=_DACT, activation=activation, pre_RF=h_RF)[0]


@_dact_op.register_fake
def _(grad_RD, w_out_EHD, offs_E, h_RF, activation):
    return grad_RD.new_empty(h_RF.shape)  # the real op allocates dh like the gradient


@torch.library.custom_op("moeflow::grouped_ffn", mutates_args=())
def _ffn_op(
    x_RD: torch.Tensor, w_in_EDF: torch.Tensor, w_out_EHD: torch.Tensor, offs_E: torch.Tensor, activation: str,
    save_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, h, a)``; ``save_h=False`` (no gradient wanted) skips writing ``h``, returned ``[0, F]``."""
    a_RH, h_RF = _launch_gmm(x_RD, w_in_EDF, offs_E, mode=_ACT, activation=activation, store_pre=save_h)
    y_RD = _launch_gmm(a_RH, w_out_EHD, offs_E, mode=_PLAIN)[0]
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

