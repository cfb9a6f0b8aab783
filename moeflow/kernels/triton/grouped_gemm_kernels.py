"""Triton kernels of the grouped expert GEMMs (legend: moeflow.types; contract of the row groups
and their offsets: ``moeflow.kernels.triton.grouped_gemm``; launchers: ``grouped_gemm_launch``).

Both kernels accumulate in fp32 and read every operand through its strides, so a transposed
weight view (``w_out^T`` in the backward, a Hugging Face ``[E, F, D]`` parameter's transpose)
costs no copy.

- ``gmm_kernel``: ``out[rows of e] = epilogue(x[rows of e] @ w[e])`` with three epilogues
  (``MODE``): ``MODE_PLAIN`` (store the product), ``MODE_ACT`` (the expert's input projection:
  store the pre-activation ``h`` for backward and ``a = act(h)``; a gated activation keeps two
  accumulators, gate columns ``n`` and up columns ``H + n`` of ``w_in``, so ``h`` never makes a
  round trip through memory before the gate multiplies it; ``act(gate) * _up(up)``, where
  ``_up`` is the identity but for swiglu_oai), and ``MODE_DACT`` (backward of the
  output projection fused with the activation backward: ``dh = act'(h) * (dy @ w_out[e]^T)``).
  Tiles are scheduled without a host sync: the grid has ``ceil(R / BLOCK_M) + min(E + 1, R)``
  row tiles (an upper bound, ``row_tiles_bound``; the ``+ 1`` is the zero-filled tail group of the
  rows after the last offset),
  each program finds its expert from the cumulative tile counts and idle programs return at
  once. Programs walk the tiles in groups of 8 row tiles (``_swizzle``) so operands are reused
  from L2. With ``STORE_PRE`` off the ``act`` epilogue skips storing ``h`` (no gradient wanted).
- ``gmm_wgrad_kernel``: the weight gradient ``dw[e] = x[rows of e]^T @ dy[rows of e]``; one
  program per ``(k-tile x n-tile, e)`` (the tile count on grid axis 0, which has no 65535 cap;
  ``E`` on axis 1) loops over the group's rows; empty groups get exact zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["TRITON_ACTIVATIONS", "SWIGLU_OAI_ALPHA", "SWIGLU_OAI_LIMIT", "MODE_PLAIN", "MODE_ACT", "MODE_DACT",
           "gmm_kernel", "gmm_wgrad_kernel"]

# activation name -> (the ``ACT`` code of ``_act``/``_act_grad`` for its elementwise function, gated):
# the kernels' codes for the names of ``moeflow.kernels.activation.ACTIVATIONS``, which this package
# cannot import (it sits below the ops); tests/test_config.py checks that both hold the same names
TRITON_ACTIVATIONS: dict[str, tuple[int, bool]] = {
    "gelu": (1, False),
    "silu": (2, False),
    "relu": (3, False),
    "geglu": (1, True),
    "swiglu": (2, True),
    "swiglu_oai": (4, True),  # gpt-oss: code 4 is its clamped gate function, and its up half is transformed (``_up``)
}
# swiglu_oai's constants (``moeflow.kernels.activation``'s, which a test checks these against)
SWIGLU_OAI_ALPHA = tl.constexpr(1.702)
SWIGLU_OAI_LIMIT = tl.constexpr(7.0)
# the epilogues of ``gmm_kernel`` (its ``MODE``)
MODE_PLAIN, MODE_ACT, MODE_DACT = 0, 1, 2


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:  # exact (erf) GELU, like F.gelu's default
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 2:  # SiLU
        return x / (1.0 + tl.exp(-x))
    elif ACT == 3:
        return tl.maximum(x, 0.0)
    elif ACT == 4:  # swiglu_oai's gate: g * sigmoid(alpha g) on g = min(x, limit)
        g = tl.minimum(x, SWIGLU_OAI_LIMIT)
        return g / (1.0 + tl.exp(g * -SWIGLU_OAI_ALPHA))
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
    elif ACT == 4:  # zero above the clamp (torch.clamp's backward passes the limit itself)
        s = 1.0 / (1.0 + tl.exp(x * -SWIGLU_OAI_ALPHA))
        return tl.where(x <= SWIGLU_OAI_LIMIT, s * (1.0 + x * SWIGLU_OAI_ALPHA * (1.0 - s)), 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


@triton.jit
def _up(u, ACT: tl.constexpr):
    """The up half of a gated activation as it multiplies the gate: itself, but for swiglu_oai
    ``clamp(u, -limit, limit) + 1``."""
    if ACT == 4:
        return tl.minimum(tl.maximum(u, -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT) + 1.0
    else:
        return u


@triton.jit
def _up_grad(u, ACT: tl.constexpr):
    """``d _up(u) / du``: 1, but for swiglu_oai 0 outside ``[-limit, limit]``."""
    if ACT == 4:
        return ((u >= -SWIGLU_OAI_LIMIT) & (u <= SWIGLU_OAI_LIMIT)).to(tl.float32)
    else:
        return tl.full(u.shape, 1.0, tl.float32)


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
def gmm_kernel(
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
            y = _act(acc, ACT) * _up(acc_up, ACT)
        else:
            y = _act(acc, ACT)
        tl.store(out_at, y.to(out_ptr.dtype.element_ty), mask=ok)
    else:  # acc is the gradient of the activation output, tile [rows, hidden cols]
        g = tl.load(pre_at, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(pre_at + N * s_pn, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_at, (acc * _up(u, ACT) * _act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=ok)
            tl.store(out_at + N * s_on, (acc * _act(g, ACT) * _up_grad(u, ACT)).to(out_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(out_at, (acc * _act_grad(g, ACT)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def gmm_wgrad_kernel(
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
