"""Grouped matmul over variable-size row groups (legend: moeflow.types).

``y_RF[rows of group e] = x_RD[rows of group e] @ w_EDF[e]`` where group e owns rows
``offs_E[e-1] : offs_E[e]`` (``offs_E`` is the inclusive cumulative row count) and
``offs_E[-1] == R``: no padding rows (``F.grouped_mm`` leaves rows past the last offset
uninitialised, so the dispatcher never produces any).

Three backends:
- ``"loop"``: one ``mm`` per group; the reference, works for every dtype (fp64 included) but
  reads the group sizes on the host.
- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm``, one call, no host sync; only where the
  probe shows it supports the device and dtype (fp32/bf16/fp16 on CPU in torch 2.13).
- ``"triton"``: ``moeflow.kernels.triton.grouped_mm_triton``, no host sync; fp32/bf16/fp16 on
  CUDA, or on CPU under the Triton interpreter (tests only; see ``triton_available``).

``"auto"`` chooses by device, from measurements (``docs/benchmarks.md``):

- bf16/fp16 on a CUDA GPU of compute capability 9.0 or later (Hopper, Blackwell):
  ``"grouped_mm"``, where the probe shows it runs: torch's grouped GEMM there is CUTLASS's
  Hopper kernel, faster than the Triton FFN and lighter in memory on the Mixtral-like layer.
- bf16/fp16 on an older CUDA GPU: ``"triton"`` when Triton is importable (torch's grouped GEMM
  targets Hopper and later), else ``"grouped_mm"`` where the probe allows it.
- everything else (CPU, fp32 on CUDA): ``"grouped_mm"`` where the probe allows it, else
  ``"loop"``. Never Triton on CPU (the interpreter is for tests) nor for fp32 (the kernels'
  fp32 path is exact IEEE fp32 on CUDA cores, slower than cuBLAS); an explicit ``"triton"``
  accepts fp32.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F

from moeflow.kernels.triton import _constant_under_compile, triton_available

__all__ = [
    "grouped_mm",
    "grouped_mm_loop",
    "grouped_mm_native",
    "native_grouped_mm_supported",
    "resolve_grouped_mm_backend",
    "auto_grouped_mm_backend",
    "GROUPED_MM_BACKENDS",
    "TRITON_DTYPES",
    "triton_grouped_mm_supported",
]

# dtypes the Triton kernels take (fp32 accumulation for all of them), and those "auto" sends there
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO_TRITON_DTYPES = (torch.bfloat16, torch.float16)


def grouped_mm_loop(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Reference: one matmul per group."""
    ends = offs_E.tolist()
    if ends[-1] != x_RD.shape[0]:
        raise ValueError(f"grouped_mm: offs_E[-1]={ends[-1]} must equal the number of rows {x_RD.shape[0]}")
    starts = [0] + ends[:-1]
    return torch.cat([x_RD[s:t] @ w_EDF[e] for e, (s, t) in enumerate(zip(starts, ends))], dim=0)


def _grouped(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm(a, b, offs=offs_E)``; under ``torch.compile`` an opaque op
    (``moeflow::native_grouped_mm``) for every dtype but bf16: torch's fake implementation of
    ``grouped_mm`` takes bf16 only, so a traced fp32 or fp16 call fails where the kernel runs
    (the biased experts of a compiled CPU decode step: gpt-oss)."""
    if torch.compiler.is_compiling() and a.dtype != torch.bfloat16:
        return _grouped_mm_op(a, b, offs_E)
    return F.grouped_mm(a, b, offs=offs_E)


@torch.library.custom_op("moeflow::native_grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(a, b, offs=offs_E)


@_grouped_mm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:  # [R, K] x [E, K, N] -> [R, N]
        return a.new_empty((a.shape[0], b.shape[-1]))
    return a.new_empty((offs_E.shape[0], a.shape[0], b.shape[-1]))  # [K, R] x [R, N] -> [E, K, N]


class _NativeGroupedMM(torch.autograd.Function):
    """``F.grouped_mm`` forward and backward, each one grouped call.

    Autograd through ``F.grouped_mm`` on CPU differentiates its per-group slicing, which
    allocates a zero tensor of the full input size per group in backward (E full-size fills);
    here the backward is two more grouped products instead:
    ``dx = grouped(dy, w^T)`` and ``dw[e] = x_e^T dy_e`` (the 2-D x 2-D form with offsets).
    """

    @staticmethod
    def forward(ctx, x_RD, w_EDF, offs_E):  # type: ignore[override]
        ctx.save_for_backward(x_RD, w_EDF, offs_E)
        return _grouped(x_RD, w_EDF, offs_E)

    @staticmethod
    def backward(ctx, grad_RF):  # type: ignore[override]
        x_RD, w_EDF, offs_E = ctx.saved_tensors
        grad_RF = grad_RF.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _grouped(grad_RF, w_EDF.transpose(-2, -1), offs_E)
        if ctx.needs_input_grad[1]:
            if w_EDF.stride(-2) == 1 and not w_EDF.is_contiguous():
                # w is the transposed view of an [E, F, D] tensor (e.g. a Hugging Face
                # ``gate_up_proj``): produce dw in that layout, so it reaches the parameter
                # without a transposing copy (faster than copying afterwards)
                grad_w = _grouped(grad_RF.t(), x_RD, offs_E).transpose(-2, -1)
            else:
                grad_w = _grouped(x_RD.t(), grad_RF, offs_E)
        return grad_x, grad_w, None


def grouped_mm_native(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``F.grouped_mm`` with a grouped backward (see ``_NativeGroupedMM``)."""
    return _NativeGroupedMM.apply(x_RD, w_EDF, offs_E.to(torch.int32))


def grouped_mm_triton(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """``moeflow.kernels.triton.grouped_mm_triton``, imported on first call (it imports Triton)."""
    from moeflow.kernels.triton.grouped_gemm import grouped_mm_triton as impl

    return impl(x_RD, w_EDF, offs_E)


GROUPED_MM_BACKENDS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "loop": grouped_mm_loop,
    "grouped_mm": grouped_mm_native,
    "triton": grouped_mm_triton,
}


@lru_cache(maxsize=None)
def _probe(device_type: str, dtype: torch.dtype) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 8, device=device_type, dtype=dtype)
        w = torch.ones(2, 8, 16, device=device_type, dtype=dtype)
        y = F.grouped_mm(x, w, offs=torch.tensor([1, 4], device=device_type, dtype=torch.int32))
        return bool((y == 8).all())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def native_grouped_mm_supported(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = ()) -> bool:
    """Capability probe: does ``F.grouped_mm`` run (and give the right answer) here, for
    matrices whose inner dimensions are ``dims``? It needs every row stride to be a multiple
    of 16 bytes, i.e. each of ``dims`` a multiple of ``16 / itemsize``."""
    itemsize = dtype.itemsize  # no allocation: this runs on every grouped expert call
    if any((d * itemsize) % 16 for d in dims):
        return False
    return _probe(torch.device(device).type, dtype)


def triton_grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Capability probe for ``"triton"``: a supported dtype on a device where the kernels run
    (CUDA with Triton importable, or CPU under the Triton interpreter)."""
    return dtype in TRITON_DTYPES and triton_available(device)


@lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def auto_grouped_mm_backend(device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = (),
                            capability: tuple[int, int] | None = None) -> str:
    """The backend ``"auto"`` stands for on ``device`` and ``dtype`` (module docstring).
    ``capability``: the CUDA compute capability (read from the device when None; tests pass it)."""
    device = torch.device(device)
    native = native_grouped_mm_supported(device, dtype, dims)
    if device.type == "cuda" and dtype in AUTO_TRITON_DTYPES:
        if capability is None:
            capability = _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
        if capability >= (9, 0) and native:
            return "grouped_mm"
        if triton_grouped_mm_supported(device, dtype):
            return "triton"
    return "grouped_mm" if native else "loop"


@_constant_under_compile
def resolve_grouped_mm_backend(name: str, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = ()) -> str:
    """Map ``"auto"`` to a concrete backend (``auto_grouped_mm_backend``); reject a named
    backend that cannot run here.

    ``dims``: the feature sizes of the matrices involved (see ``native_grouped_mm_supported``).
    Under ``torch.compile`` the answer is taken once at trace time (the probe runs a grouped
    GEMM, which is not traced).
    """
    if name == "auto":
        return auto_grouped_mm_backend(device, dtype, dims)
    if name not in GROUPED_MM_BACKENDS:
        raise ValueError(f"grouped-mm backend must be one of {['auto', *GROUPED_MM_BACKENDS]}, got {name!r}")
    if name == "grouped_mm" and not native_grouped_mm_supported(device, dtype, dims):
        raise ValueError(
            f"backend='grouped_mm' does not support device={torch.device(device).type}, dtype={dtype}, "
            f"feature sizes {list(dims)} (needs row strides that are multiples of 16 bytes)"
        )
    if name == "triton" and not triton_grouped_mm_supported(device, dtype):
        raise ValueError(
            f"backend='triton' does not support device={torch.device(device).type}, dtype={dtype}: it needs "
            f"a dtype in {[str(d) for d in TRITON_DTYPES]} on CUDA with Triton installed, or CPU tensors under "
            "the Triton interpreter (TRITON_INTERPRET=1 set before importing triton; for tests)"
        )
    return name


def grouped_mm(x_RD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Grouped matmul through the registry (see module docstring)."""
    name = resolve_grouped_mm_backend(backend, x_RD.device, x_RD.dtype, (w_EDF.shape[-2], w_EDF.shape[-1]))
    return GROUPED_MM_BACKENDS[name](x_RD, w_EDF, offs_E)
