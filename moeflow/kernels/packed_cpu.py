"""The CPU's few-row grouped product over packed weights: what the experts of a compiled decode
step multiply with on the CPU (legend: moeflow.types; ``S`` strips of ``STRIP`` columns).

``y_RN[rows of expert e] = x_RK[rows of expert e] @ w_EKN[e]``, as ``grouped_mm_loop`` (the
readable reference the tests compare with) and ``F.grouped_mm`` compute it, but over a copy of
the weight packed as ``[E, S, K, STRIP]`` (``pack_weight``): strip ``s`` holds columns
``16s .. 16s+15`` of every row, so each strip is one contiguous run of memory.

Why: a decode step multiplies a few rows per expert (16 rows over 8 experts at batch 8, top-2)
by weights that come from memory, so the product is bound by how fast the weight streams. The
BLAS GEMM copies its operand into its own blocked layout on every call; this kernel holds a strip's 16 columns of
up to 6 rows in registers over the whole of ``K``, so each weight streams past once. On this
project's 2-core AMD EPYC VM (fp32, ``bench/expert_products.py``: a decode step's expert FFN
over four layers of weights, ``docs/benchmarks.md``) MKL's grouped GEMM read the weights at
2.8-6.6 GiB/s at batch 1-16, the packed kernel at 6.1-11.5 GiB/s: 1.2-2.5x faster on one
thread, 1.7-3.3x on two. The copy costs the packed weights' memory once more; the caller keeps
it (``moeflow.models.compiled_decode``: per model, packed again at every generation).

The kernel is C++ (``csrc/packed_grouped_mm.cpp``), built on first use with the host's C++
compiler (the one inductor needs on the CPU anyway) for this CPU (``-march=native``, OpenMP),
cached by source, compiler, flags and CPU in ``KERNEL_CACHE`` and loaded through ``ctypes``.
fp32 only; any other dtype is the caller's to send elsewhere.
"""

from __future__ import annotations

import ctypes
import getpass
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["STRIP", "KERNEL_CACHE", "MAX_ROWS_PER_EXPERT", "PackedExperts", "packed_cpu_available", "pack_weight",
           "packed_grouped_mm", "packs_in_use", "packs_for"]

STRIP = 16  # columns per strip of a packed weight (two 8-wide vectors of the kernel)
SOURCE = Path(__file__).parent / "csrc" / "packed_grouped_mm.cpp"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


KERNEL_CACHE = Path(tempfile.gettempdir()) / f"moeflow_kernels_{_user()}"
_FLAGS = (("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"),
          ("-O3", "-march=native", "-shared", "-fPIC", "-std=c++17"),  # without OpenMP: one thread
          ("-O3", "-shared", "-fPIC", "-std=c++17"))  # a compiler without -march=native: the base ISA
_COMPILERS = ("g++", "c++", "clang++")  # GCC first: its OpenMP is the libgomp torch loads
# ``packs_for`` answers None above this many rows per expert (batch 256 at top-2 of 8 experts):
# the products are no longer few-row ones there. On the VM of the module docstring the packed
# kernel still led at 64 rows per expert (1.3x on one thread, 1.7x on two) and at 128 (1.1x,
# 1.3x); a BLAS's blocking can win at such sizes on other CPUs, so the limit keeps a margin
MAX_ROWS_PER_EXPERT = 64
_IN_USE = threading.local()  # .packs: this thread's {(w_in address, w_out address): PackedExperts}


def _compiler() -> str | None:
    for name in _COMPILERS:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def _cpu_name() -> str:
    """The CPU's model name where Linux tells it (``-march=native`` code is for this CPU only)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@lru_cache(maxsize=None)
def packed_cpu_available() -> bool:
    """Whether the kernel is built here (on the first call: a C++ compiler on the ``PATH`` builds
    it, or a former build is loaded). A compiler that fails is reported once, as a
    ``RuntimeWarning`` naming the error, and the answer is False: callers then multiply the
    weights themselves (the same products)."""
    if _compiler() is None:
        return False
    try:
        _library()
    except (RuntimeError, OSError) as err:  # the compiler's error, or the cache's or the loader's
        warnings.warn(f"moeflow: the packed CPU kernel did not build, so compiled decode on the CPU multiplies the "
                      f"expert weights themselves: {err}", RuntimeWarning, stacklevel=2)
        return False
    return True


def _check_cache_dir() -> None:
    """Make ``KERNEL_CACHE`` (mode 700) or check it is this user's and nobody else's to write: a
    library loaded from there runs in this process."""
    KERNEL_CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
    if hasattr(os, "getuid"):
        st = KERNEL_CACHE.stat()
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise RuntimeError(f"{KERNEL_CACHE} (the packed CPU kernel's cache) must belong to this user and be "
                               f"writable by nobody else (owner uid {st.st_uid}, mode {oct(st.st_mode & 0o777)})")


@lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    """The built kernel, compiled once per source, compiler, flags and CPU (and cached on disk)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"the packed CPU kernel needs a C++ compiler on the PATH (one of {list(_COMPILERS)})")
    source = SOURCE.read_bytes()
    errors = []
    for flags in _FLAGS:
        key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags).encode(),
                                         platform.machine().encode(), _cpu_name().encode(),
                                         torch.backends.cpu.get_cpu_capability().encode()])).hexdigest()[:20]
        path = KERNEL_CACHE / f"packed_grouped_mm_{key}.so"
        _check_cache_dir()
        if not path.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=KERNEL_CACHE)
            os.close(fd)
            done = subprocess.run([compiler, *flags, str(SOURCE), "-o", tmp], capture_output=True, text=True)
            if done.returncode != 0:
                os.unlink(tmp)
                errors.append(f"{compiler} {' '.join(flags)}: {done.stderr.strip()[-2000:]}")
                continue
            os.replace(tmp, path)  # atomic: processes building at once each publish a whole file
        lib = ctypes.CDLL(str(path))
        lib.moeflow_packed_grouped_mm.argtypes = [
            ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        lib.moeflow_packed_grouped_mm.restype = None
        return lib
    raise RuntimeError("building the packed CPU kernel failed:\n" + "\n".join(errors))


def pack_weight(w_EKN: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[E, S, K, STRIP]`` (``S = ceil(N / STRIP)``, missing columns zero) copy of ``w_EKN``
    (fp32, CPU, any strides), into ``out`` when given (a former pack of the same shape)."""
    if not isinstance(w_EKN, torch.Tensor) or w_EKN.dim() != 3:
        raise ValueError(f"w_EKN must be a 3-d tensor [E, K, N], got {getattr(w_EKN, 'shape', w_EKN)!r}")
    if w_EKN.dtype != torch.float32 or w_EKN.device.type != "cpu":
        raise ValueError(f"w_EKN must be fp32 on the CPU, got {w_EKN.dtype} on {w_EKN.device}")
    E, K, N = w_EKN.shape
    S = -(-N // STRIP)
    w = w_EKN.detach()
    if S * STRIP != N:
        w = torch.nn.functional.pad(w, (0, S * STRIP - N))
    packed = w.reshape(E, K, S, STRIP).permute(0, 2, 1, 3)
    if out is None:
        return packed.contiguous()
    if out.shape != (E, S, K, STRIP) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous fp32 [{E}, {S}, {K}, {STRIP}] tensor, got "
                         f"{out.dtype} {tuple(out.shape)}")
    return out.copy_(packed)


def packed_grouped_mm(x_RK: torch.Tensor, w_ESKP: torch.Tensor, counts_E: torch.Tensor, n: int) -> torch.Tensor:
    """``[R, n]``: ``x_RK``'s rows of expert ``e`` (``counts_E[e]`` of them, in expert order)
    times expert ``e``'s weight, packed by ``pack_weight`` from ``[E, K, n]``; rows past
    ``counts_E.sum()`` are zeros. fp32 CPU tensors; the product itself runs outside torch, on
    ``torch.get_num_threads()`` OpenMP threads."""
    if x_RK.dtype != torch.float32 or x_RK.device.type != "cpu" or x_RK.dim() != 2:
        raise ValueError(f"x_RK must be a 2-d fp32 CPU tensor, got {x_RK.dtype} {tuple(x_RK.shape)} on {x_RK.device}")
    if w_ESKP.dim() != 4 or w_ESKP.shape[-1] != STRIP or w_ESKP.shape[2] != x_RK.shape[1] \
            or w_ESKP.dtype != torch.float32 or not w_ESKP.is_contiguous() or w_ESKP.device.type != "cpu":
        raise ValueError(f"w_ESKP must be a contiguous fp32 CPU [E, S, {x_RK.shape[1]}, {STRIP}] pack (pack_weight), "
                         f"got {w_ESKP.dtype} {tuple(w_ESKP.shape)} on {w_ESKP.device}")
    E, S = w_ESKP.shape[:2]
    if isinstance(n, bool) or not isinstance(n, int) or not (S - 1) * STRIP < n <= S * STRIP:
        raise ValueError(f"n must be the packed weight's column count ({(S - 1) * STRIP + 1}..{S * STRIP}), got {n!r}")
    if counts_E.shape != (E,) or counts_E.dtype.is_floating_point or counts_E.device.type != "cpu":
        raise ValueError(f"counts_E must be an integer CPU tensor of shape ({E},), got {counts_E.dtype} "
                         f"{tuple(counts_E.shape)} on {counts_E.device}")
    x = x_RK.contiguous()
    counts = counts_E.to(torch.int64).contiguous()
    y_RN = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] and n:
        _library().moeflow_packed_grouped_mm(x.data_ptr(), x.shape[0], x.shape[1], w_ESKP.data_ptr(), E, n,
                                             counts.data_ptr(), y_RN.data_ptr(), torch.get_num_threads())
    return y_RN


def _identity(w: torch.Tensor) -> tuple:
    """What tells a weight apart without holding it: address, shape, strides and version counter
    (None for inference tensors, which keep none). A write through ``.data`` or numpy moves no
    version, which is why ``ExpertPacks`` packs again on every generation."""
    return (w.data_ptr(), tuple(w.shape), w.stride(), None if w.is_inference() else w._version)


@dataclass(frozen=True)
class PackedExperts:
    """The packs (``pack_weight``) of one expert FFN's weights (``w_in [E, D, F]``, ``w_out
    [E, H, D]``) and what identifies those weights as they were packed (``_identity``): no
    reference to the weights, so packs never keep a replaced or cast weight alive. ``matches``
    tells whether given weights are these, unchanged as far as their version counters tell."""

    packed_in: torch.Tensor
    packed_out: torch.Tensor
    identity: tuple[tuple, tuple]

    @staticmethod
    def of(w_in: torch.Tensor, w_out: torch.Tensor, reuse: PackedExperts | None = None) -> PackedExperts:
        """Pack both weights as they are now, into ``reuse``'s packs where the shapes allow (no
        new memory: ~9 ms for the 48 MiB of the bench model's experts on this project's VM)."""
        w_in, w_out = w_in.detach(), w_out.detach()
        fits = reuse is not None and reuse.identity[0][1] == tuple(w_in.shape) \
            and reuse.identity[1][1] == tuple(w_out.shape)
        return PackedExperts(pack_weight(w_in, out=reuse.packed_in if fits else None),  # type: ignore[union-attr]
                             pack_weight(w_out, out=reuse.packed_out if fits else None),  # type: ignore[union-attr]
                             (_identity(w_in), _identity(w_out)))

    @property
    def key(self) -> tuple[int, int]:
        return self.identity[0][0], self.identity[1][0]

    def matches(self, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
        return (_identity(w_in), _identity(w_out)) == self.identity


@contextmanager
def packs_in_use(packs: Iterable[PackedExperts]) -> Iterator[None]:
    """Within the block (in this thread), ``packs_for`` finds the packs of ``packs``' weights.
    What ``moeflow.models.compiled_decode`` wraps each CPU decode step in; nothing else sees packs."""
    before = getattr(_IN_USE, "packs", None)
    _IN_USE.packs = {p.key: p for p in packs}
    try:
        yield
    finally:
        _IN_USE.packs = before


def packs_for(w_in: torch.Tensor, w_out: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The packs ``(packed_in, packed_out)`` of ``packs_in_use`` for these weights, when they
    still match them (``PackedExperts.matches``) and ``rows`` is at most ``MAX_ROWS_PER_EXPERT``
    times the experts (on average per expert); else None."""
    packs = getattr(_IN_USE, "packs", None)
    if not packs:
        return None
    entry = packs.get((w_in.data_ptr(), w_out.data_ptr()))
    if entry is None or rows > MAX_ROWS_PER_EXPERT * w_in.shape[0] or not entry.matches(w_in, w_out):
        return None
    return entry.packed_in, entry.packed_out
