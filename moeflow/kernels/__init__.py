"""Leaf kernels: per op a readable torch reference (the CPU path) and faster backends, with a
registry that picks one by a capability probe (device, dtype), never an environment variable.
The Triton kernels live in ``moeflow.kernels.triton``, which imports Triton only when used."""

from moeflow.kernels.grouped_mm import (
    GROUPED_MM_BACKENDS,
    TRITON_DTYPES,
    grouped_mm,
    grouped_mm_loop,
    grouped_mm_native,
    native_grouped_mm_supported,
    resolve_grouped_mm_backend,
    triton_grouped_mm_supported,
)
from moeflow.kernels.triton import triton_available

__all__ = [
    "GROUPED_MM_BACKENDS",
    "grouped_mm",
    "grouped_mm_loop",
    "grouped_mm_native",
    "native_grouped_mm_supported",
    "resolve_grouped_mm_backend",
    "triton_grouped_mm_supported",
    "triton_available",
    "TRITON_DTYPES",
]

from moeflow.kernels.gather import gather_rows, gather_rows_reference  # noqa: E402

__all__ += ["gather_rows", "gather_rows_reference"]
