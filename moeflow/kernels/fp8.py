"""Float8 (e4m3) quantisation and grouped FP8 products (legend: moeflow.types; M rows, N columns,
G groups, P padded rows).

The scale rule, one fp32 scale per row (or per ``block`` consecutive elements of a row):
``scale = max(amax, 1e-12) / 448`` (448 is e4m3's largest finite value), ``q = clamp(x / scale,
-448, 448)`` cast to ``torch.float8_e4m3fn`` (round to nearest even), and ``x ~ q * scale``.
Scaling to the row's own largest value keeps the whole row inside e4m3's normal range unless an
element is below ``amax / 28672`` (``2^-6 * 448``), where subnormals start.

- ``quantize_reference``: that rule in plain fp32 torch, per row or per 128-block; every device.
- ``quantize_rows``: per row, the same rule as one Triton kernel (``moeflow.kernels.triton.fp8``:
  the amax, the scaling and the cast in one program per row, where eager torch takes five passes
  over the tensor) on CUDA, else the reference; ``quantize_columns_t``: per column, written
  transposed (Triton on CUDA: no transposed bf16 copy), else the reference.
- ``scaled_grouped_mm``: ``torch._scaled_grouped_mm`` (CUDA, compute capability 8.9+; torch
  2.11 takes e4m3 operands, fp32 row-wise scales and int32 group ends ``offs``, and returns
  bf16), in its two forms: ``[M, K] x [G, K, N] -> [M, N]`` (groups of rows) and
  ``[M, K] x [K, N] -> [G, M, N]`` (groups along K: the weight gradient). The first operand must
  be row-major and the second column-major; in the second form every group but the last must
  span a multiple of 16 columns (a device-side assert otherwise, which ends the process's CUDA
  context), so callers pad groups (``moeflow.experts.fp8``).
- ``scaled_grouped_mm_reference``: the same products with the operands dequantised to fp32.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from moeflow.kernels.triton import triton_available

__all__ = ["E4M3_MAX", "FP8_DTYPE", "ALIGN", "quantize_reference", "dequantize", "quantize_rows",
           "quantize_columns_t", "scaled_grouped_mm", "scaled_grouped_mm_reference", "fp8_supported",
           "check_fp8_device", "cuda_capability"]

E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
ALIGN = 16  # e4m3 elements per 16 bytes: the grouped GEMM's alignment of strides and K-groups
_TINY = 1e-12  # amax floor: an all-zero row gets a finite scale (and quantises to zeros)


def quantize_reference(x: torch.Tensor, *, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., N] -> (q [..., N] e4m3, scale [..., N / block] fp32)`` by the module's rule, one
    scale per row (``block=None``) or per ``block`` consecutive elements of a row (``N`` a
    multiple of ``block``). Readable fp32 torch: the definition the kernels are tested against."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"quantize_reference: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    n = x.shape[-1]
    if block is not None and (not isinstance(block, int) or block < 1 or n % block):
        raise ValueError(f"quantize_reference: block={block!r} must be a positive divisor of the last dimension {n}")
    b = n if block is None else block
    x_blocks = x.float().reshape(*x.shape[:-1], n // b, b)
    scale = x_blocks.abs().amax(dim=-1).clamp(min=_TINY) / E4M3_MAX
    q = (x_blocks / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE).reshape(x.shape)
    return q, (scale.squeeze(-1) if block is None else scale)


def dequantize(q: torch.Tensor, scale: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """fp32 ``q * scale`` (the inverse of ``quantize_reference`` up to e4m3's rounding)."""
    n = q.shape[-1]
    b = n if block is None else block
    s = scale.unsqueeze(-1) if block is None else scale
    return (q.float().reshape(*q.shape[:-1], n // b, b) * s.unsqueeze(-1)).reshape(q.shape)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise ``quantize_reference`` for ``x [..., N]``: one Triton kernel on CUDA (last
    dimension contiguous, Triton importable), the reference elsewhere (never the CPU interpreter,
    which is for the kernel's tests: ``quantize_rows_triton``)."""
    if (x.device.type == "cuda" and x.dim() >= 2 and x.shape[-1] > 0 and x.stride(-1) == 1
            and triton_available(x.device)):
        from moeflow.kernels.triton.fp8 import quantize_rows_triton

        q, scale = quantize_rows_triton(x.reshape(-1, x.shape[-1]))
        return q.reshape(x.shape), scale.reshape(x.shape[:-1])
    return quantize_reference(x)


def quantize_columns_t(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., M, N]`` quantised per column over its ``M`` rows, returned transposed:
    ``(q [..., N, M] e4m3 contiguous, scale [..., N])`` = ``quantize_reference`` of
    ``x.transpose(-2, -1)``. On CUDA two Triton kernels that read ``x`` in place (no transposed
    bf16 copy); elsewhere the reference."""
    if x.device.type == "cuda" and x.dim() in (2, 3) and x.numel() and triton_available(x.device):
        if x.stride(-2) == 1 and x.stride(-1) != 1:  # the transpose of a row-major tensor: its rows
            return quantize_rows(x.transpose(-2, -1))
        if x.stride(-1) == 1:
            from moeflow.kernels.triton.fp8 import quantize_columns_t_triton

            return quantize_columns_t_triton(x)
    q, scale = quantize_reference(x.transpose(-2, -1))
    return q.contiguous(), scale


@lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_capability(device: torch.device | str) -> tuple[int, int]:
    """The compute capability of a CUDA ``device`` (read once per device)."""
    device = torch.device(device)
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def fp8_supported(device: torch.device | str) -> tuple[bool, str]:
    """Can ``scaled_grouped_mm`` run on ``device``? ``(answer, why not)``."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"device {device.type} has no FP8 grouped GEMM (it needs CUDA, compute capability 8.9+)"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    cap = cuda_capability(device)
    if cap < (8, 9):
        return False, f"CUDA compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores (needs 8.9+)"
    return True, ""


def check_fp8_device(device: torch.device | str, where: str) -> None:
    """Raise a ``RuntimeError`` naming ``where`` when ``device`` cannot run FP8 products."""
    ok, why = fp8_supported(device)
    if not ok:
        raise RuntimeError(f"{where}: fp8 needs an FP8 device: {why}; fp8_gemm='reference' runs the emulated "
                           "products on any device")


def _check_operands(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    offs: torch.Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if t.dtype != FP8_DTYPE:
            raise TypeError(f"scaled_grouped_mm: {name} must be {FP8_DTYPE}, got {t.dtype}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32:
            raise TypeError(f"scaled_grouped_mm: {name} must be float32, got {t.dtype}")
    if offs.dtype != torch.int32 or offs.dim() != 1:
        raise TypeError(f"scaled_grouped_mm: offs must be a 1-D int32 tensor, got {offs.dtype} of shape {tuple(offs.shape)}")
    if a.dim() != 2 or b.dim() not in (2, 3):
        raise ValueError(f"scaled_grouped_mm: a must be 2-D and b 2-D or 3-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"scaled_grouped_mm: inner dimensions differ: a {tuple(a.shape)}, b {tuple(b.shape)}")


def scaled_grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                                offs: torch.Tensor, *, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``scaled_grouped_mm`` with the operands dequantised to fp32 and one fp32 ``mm`` per group
    (reads the group ends on the host). Any device, any strides.

    ``b`` 3-D: ``a [M, K]`` rows grouped by ``offs``, ``scale_a [M]``, ``b [G, K, N]``,
    ``scale_b [G, N]`` -> ``[M, N]``. ``b`` 2-D: ``a [M, Ktot]``, ``b [Ktot, N]`` with K grouped by
    ``offs``, ``scale_a [G*M]``, ``scale_b [G*N]`` (group-major) -> ``[G, M, N]``."""
    _check_operands(a, b, scale_a, scale_b, offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        a32 = a.float() * scale_a.float().unsqueeze(1)
        b32 = b.float() * scale_b.float().unsqueeze(1)
        out = a32.new_zeros(a.shape[0], b.shape[-1])
        for g, (s, t) in enumerate(zip(starts, ends)):
            out[s:t] = a32[s:t] @ b32[g]
        return out.to(out_dtype)
    m, n = a.shape[0], b.shape[1]
    sa, sb = scale_a.float().view(len(ends), m), scale_b.float().view(len(ends), n)
    out = a.new_zeros(len(ends), m, n, dtype=torch.float32)
    for g, (s, t) in enumerate(zip(starts, ends)):
        out[g] = (a[:, s:t].float() * sa[g].unsqueeze(1)) @ (b[s:t].float() * sb[g])
    return out.to(out_dtype)


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor, *, fast_accum: bool = False) -> torch.Tensor:
    """``torch._scaled_grouped_mm`` (bf16 out) with its preconditions checked here, where a
    wrong stride or dtype gets a clear error instead of a device-side assert (shapes and scale
    layouts as in ``scaled_grouped_mm_reference``). ``a`` row-major, ``b`` column-major (the
    transpose of a contiguous tensor), strides multiples of 16 elements. ``fast_accum``: Hopper's
    FP8 tensor-core accumulation without the periodic promotion to fp32 (faster, a little less
    exact over long K; the common recipe's choice for forward products, not gradients)."""
    _check_operands(a, b, scale_a, scale_b, offs)
    check_fp8_device(a.device, "scaled_grouped_mm")
    if a.stride(-1) != 1 or a.stride(-2) % ALIGN:
        raise ValueError(f"scaled_grouped_mm: a must be row-major with a row stride a multiple of {ALIGN}, "
                         f"got strides {a.stride()}")
    if b.stride(-2) != 1 or b.stride(-1) % ALIGN:
        raise ValueError(f"scaled_grouped_mm: b must be column-major with a column stride a multiple of {ALIGN}, "
                         f"got strides {b.stride()}")
    if b.shape[-1] % 8:
        raise ValueError(f"scaled_grouped_mm: the output's columns ({b.shape[-1]}) must be a multiple of 8 (16 bytes of bf16)")
    return torch._scaled_grouped_mm(a, b, scale_a.contiguous(), scale_b.contiguous(), offs=offs,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
