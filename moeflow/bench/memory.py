"""Peak memory of one call, on CPU and CUDA, counted the same way for every implementation.

CUDA: the caching allocator's ``max_memory_allocated`` above what was allocated before.

CPU: the bytes of tensor storage that the call allocates and still holds, sampled after every
ATen op, forward and backward (a dispatch mode), and their peak: activations, saved tensors,
temporaries between ops and parameter gradients, i.e. what ``max_memory_allocated`` counts on
a GPU. A storage counts from the op that returned it (an output sharing no storage with the
op's inputs: views and in-place results are not new memory) until it is freed. Scratch space
an op allocates and frees inside itself is not seen; nor is memory that existed before the
call (parameters, inputs).

Why not the process's resident size (``/proc/self/statm`` after ``gc`` and ``malloc_trim``)?
It counts the same bytes in a fresh process, but in a process that has run other
implementations glibc serves new tensors from freed heap chunks whose pages stay resident when
freed again, so the figure depends on what ran before (measured: the same floor call read
120-200 MiB on four runs of one process). ``resident_bytes`` and ``release_freed_heap`` remain
for callers that measure one implementation per fresh process (``bench.activation``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable

import torch
import torch._library.custom_ops as _custom_ops
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["peak_memory_bytes", "keep_freed_heap", "release_freed_heap", "resident_bytes", "LiveTensorBytes"]


def _libc() -> ctypes.CDLL | None:
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


_LIBC = _libc()
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def resident_bytes() -> int:
    """The process's resident set size now (``/proc/self/statm``; Linux only)."""
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_freed_heap() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS (``malloc_trim(0)``)."""
    gc.collect()
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC is not None else None
    if trim is not None:
        trim(0)


def keep_freed_heap(limit_bytes: int = 1 << 30) -> bool:
    """Ask glibc to serve blocks up to ``limit_bytes`` from the heap and keep freed memory.

    By default glibc ``mmap``s every block above 128 KiB-32 MiB and returns it to the OS when
    freed, so each large tensor of every step is page-faulted and zero-filled by the kernel
    again; on a 2-core machine that is up to a third of a step and very noisy. A long-running
    training process reuses its heap instead. Applied once per process, to every implementation
    alike. Returns False where ``mallopt`` is not available (non-glibc platforms).
    """
    mallopt = getattr(_LIBC, "mallopt", None) if _LIBC is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, limit_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, limit_bytes))


class LiveTensorBytes(TorchDispatchMode):
    """Counts the storage bytes allocated inside the mode and still alive, after every op.

    ``current`` and ``peak`` are in bytes. A storage is new when an op returns it and it is not
    the storage of one of the op's tensor arguments; it stops counting once freed (a weak
    reference to it expires).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = self._inside(func, args, kwargs)
        if out is _NOT_CUSTOM:
            out = func(*args, **kwargs)
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t._is_zerotensor():
                continue  # (a zero tensor has no memory: its storage has no data)
            storage = t.untyped_storage()
            key = storage._cdata
            if key in inputs or key in self._live:
                continue
            self._live[key] = (StorageWeakRef(storage), storage.nbytes())
            self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


    def _inside(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        """A custom op with a Python implementation for this device (moeflow's fused ops: one
        kernel on CUDA, torch ops elsewhere) runs that implementation with this mode active, so
        its temporaries count as the ops' allocations they are; ``_NOT_CUSTOM`` otherwise."""
        opdef = _custom_ops._maybe_get_opdef(func)
        if opdef is None:
            return _NOT_CUSTOM
        device = next((t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        impl = opdef._backend_fns.get(device) or opdef._backend_fns.get(None) or opdef._init_fn
        with self:
            return impl(*args, **kwargs)


_NOT_CUSTOM = object()


def peak_memory_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes ``fn()`` adds to the device's memory while it runs (module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    gc.collect()
    with LiveTensorBytes() as mode:
        fn()
    return mode.peak
