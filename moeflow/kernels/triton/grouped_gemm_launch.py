"""Launchers of the grouped GEMM kernels (legend: moeflow.types): tile sizes, the host-sync-free
tile schedule, output allocation and the degenerate shapes the kernels never see.

The kernels are in ``grouped_gemm_kernels``; the differentiable ops and public entry points
built on these launchers (and the offsets contract) in ``grouped_gemm``.
"""

from __future__ import annotations

import torch
import triton

from moeflow.kernels.triton import check_triton_tensors, device_guard
from moeflow.kernels.triton.grouped_gemm_kernels import (
    MODE_ACT,
    MODE_PLAIN,
    TRITON_ACTIVATIONS,
    gmm_kernel,
    gmm_wgrad_kernel,
)

__all__ = ["launch_gmm", "launch_wgrad", "row_tiles_bound", "FEW_ROWS"]


# at most this many rows in all is a "few-row" call (a decode step: batch x top-k rows), whose
# groups hold a row or two each: it reads its experts' weights once and computes next to nothing
FEW_ROWS = 256


def _config(dtype: torch.dtype, device: torch.device, gated: bool, rows: int) -> dict[str, int]:
    """Tile sizes. Interpreter: small tiles (fewer wasted lanes at test sizes). GPU: 16-bit
    types use the tensor cores with 128x128x64 tiles (64 columns when two accumulators are live);
    fp32 runs the IEEE path with smaller tiles. Untuned: see moeflow/bench/gpu_kernels.py.
    A few-row call (``rows <= FEW_ROWS``, 16-bit, GPU) is bound by reading the weights: tiles of
    16 rows (the tensor cores' least), narrow columns and long contractions, so that the active
    experts' weights are split over many programs and each streams a long run of them."""
    if device.type != "cuda":
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    if rows <= FEW_ROWS:
        return {"BLOCK_M": 16, "BLOCK_N": 32 if gated else 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 64 if gated else 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def row_tiles_bound(R: int, E: int, block_m: int) -> int:
    """An upper bound on the row tiles of ``R`` rows in ``E`` expert groups and the tail group,
    known without reading the counts: a non-empty group of ``c`` rows has ``ceil(c / block_m) <
    c / block_m + 1`` tiles, and at most ``min(E + 1, R)`` groups are non-empty, so fewer than
    ``R / block_m + min(E + 1, R)``. (A decode step's 8 rows over 128 experts launch 9 row
    tiles, not 130, of which all but the active experts' would return at once.)"""
    return triton.cdiv(R, block_m) + min(E + 1, R)


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


def launch_gmm(
    x_RK: torch.Tensor,
    w_EKN: torch.Tensor,
    offs_E: torch.Tensor,
    *,
    mode: int,
    activation: str = "none",
    pre_RF: torch.Tensor | None = None,
    store_pre: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``gmm_kernel``; returns ``(out, pre)`` (``pre`` only for the act epilogue; with
    ``store_pre=False`` it is an empty ``[0, F]`` tensor and ``h`` is never written).

    ``mode`` is one of the kernel's epilogues. ``MODE_PLAIN``: ``out [R, N]``. ``MODE_ACT``:
    ``w`` is ``w_in [E, D, F]``, out ``a [R, H]``, pre ``h [R, F]``. ``MODE_DACT``: ``w`` is
    ``w_out^T [E, D, H]``, ``pre_RF`` is ``h``, out ``dh [R, F]``.
    """
    check_triton_tensors("grouped GEMM", x=x_RK)
    R, KD = x_RK.shape
    E = w_EKN.shape[0]
    act, gated = TRITON_ACTIVATIONS.get(activation, (0, False))
    width = w_EKN.shape[2]
    N = width // 2 if (mode == MODE_ACT and gated) else width
    dev, dt = x_RK.device, x_RK.dtype
    if mode == MODE_PLAIN:
        out = torch.empty(R, N, dtype=dt, device=dev)
        pre = None
    elif mode == MODE_ACT:
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
        if mode == MODE_ACT:
            pre.zero_()
        return out, pre
    cfg = _config(dt, dev, gated and mode != MODE_PLAIN, R)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    row_start, row_end, tile_start, tile_end = _schedule(offs_E, bm, R)
    pre_arg = out if (pre is None or pre.shape[0] != R) else pre
    # an upper bound on the row tiles (E groups and the tail): no host sync for the real count
    num_m = row_tiles_bound(R, E, bm)
    with device_guard(x_RK):
        gmm_kernel[(num_m * triton.cdiv(N, bn),)](
            x_RK, w_EKN, out, pre_arg, row_start, row_end, tile_start, tile_end,
            N, KD, E, num_m,
            x_RK.stride(0), x_RK.stride(1), w_EKN.stride(0), w_EKN.stride(1), w_EKN.stride(2),
            out.stride(0), out.stride(1), pre_arg.stride(0), pre_arg.stride(1),
            MODE=mode, ACT=act, GATED=gated, DOT_F32=_dot_f32(dt, dev), STORE_PRE=pre_arg is not out,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=triton.next_power_of_2(E + 1), GROUP_M=8,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out, pre


def launch_wgrad(a_RK: torch.Tensor, b_RN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
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
    with device_guard(a_RK):
        gmm_wgrad_kernel[grid](
            a_RK, b_RN, out, row_start, row_end, KD, N,
            a_RK.stride(0), a_RK.stride(1), b_RN.stride(0), b_RN.stride(1), out.stride(0), out.stride(1), out.stride(2),
            DOT_F32=_dot_f32(a_RK.dtype, a_RK.device), BLOCK_R=br, BLOCK_K=bk, BLOCK_N=bn, GROUP_K=8,
            num_warps=8 if cuda else 4, num_stages=3 if cuda else 1,
        )
    return out
