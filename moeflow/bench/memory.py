"""Peak memory of one call, on CPU and CUDA.

CUDA: the caching allocator's ``max_memory_allocated``. CPU has no such counter, so we sample
the C heap's allocated bytes (glibc ``mallinfo2``: in-use small blocks + mmapped large blocks,
which is where PyTorch's CPU allocator gets its memory) after every ATen op, forward and
backward, through a dispatch mode. Peaks *inside* a single op (its scratch space) are not seen;
everything any op returns or autograd saves is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["peak_memory_bytes", "keep_freed_heap"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def _load_mallinfo2() -> Callable[[], int] | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        libc = ctypes.CDLL(path)
        fn = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def allocated() -> int:
        info = fn()
        return int(info.uordblks + info.hblkhd)

    return allocated


_ALLOCATED = _load_mallinfo2()

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_heap(limit_bytes: int = 1 << 30) -> bool:
    """Ask glibc to serve blocks up to ``limit_bytes`` from the heap and keep freed memory.

    By default glibc ``mmap``s every block above 128 KiB-32 MiB and returns it to the OS when
    freed, so each large tensor of every step is page-faulted and zero-filled by the kernel
    again; on a 2-core machine that is up to a third of a step and very noisy. A long-running
    training process reuses its heap instead. Applied once per process, to every implementation
    alike. Returns False where ``mallopt`` is not available (non-glibc platforms).
    """
    path = ctypes.util.find_library("c")
    if path is None:
        return False
    try:
        mallopt = ctypes.CDLL(path).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, limit_bytes))


class _PeakHeap(TorchDispatchMode):
    def __init__(self, allocated: Callable[[], int]) -> None:
        super().__init__()
        self.allocated = allocated
        self.base = allocated()
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, self.allocated() - self.base)
        return out


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Peak bytes allocated while ``fn()`` runs, above what was allocated before it.

    Returns None on a CPU platform without glibc's ``mallinfo2``.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if _ALLOCATED is None:
        return None
    with _PeakHeap(_ALLOCATED) as mode:
        fn()
    return mode.peak
