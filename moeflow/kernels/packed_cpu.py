"""The CPU's few-row grouped product over packed weights: what the experts of a compiled decode
step multiply with on the CPU (legend: moeflow.types; ``S`` strips of ``STRIP`` columns).

``y_RN[rows of expert e] = x_RK[rows of expert e] @ w_EKN[e]``, as ``grouped_mm_loop`` (the
readable reference the tests compare with) and ``F.grouped_mm`` compute it, but over a copy of
the weight packed as ``[E, S, K, STRIP]`` (``pack_weight``): strip ``s`` holds columns
``16s .. 16s+15`` of every row, so each strip is one contiguous run of memory.

Why: a decode step multiplies a few rows per expert (16 rows over 8 experts at batch 8, top-2)
by weights that come from memory, so the product is bound by how fast the weight streams. The
BLAS GEMM copies its operand into its own blocked layout on every call; this kernel holds a
strip's 16 columns of up to 6 rows in registers over the whole of ``K``, so each weight streams
past once (the measurements: ``docs/benchmarks.md``, ``bench/expert_products.py``). The copy
costs the packed weights' memory once more; the caller keeps it
(``moeflow.experts.packed.PackedCPUExperts``, packed again at every compiled generation).

The kernel is C++ (``csrc/packed_grouped_mm.cpp``, with a pybind11 binding), built on first use
by ``torch.utils.cpp_extension.load`` with the host's C++ compiler (the one inductor needs on the
CPU anyway) for this CPU (``-march=native``, OpenMP), in a directory of ``KERNEL_CACHE`` per
source, compiler, flags, CPU, torch and Python (``cpp_extension``'s lock and ninja's up-to-date
check make a second build, also by another process, a no-op). ``cpp_extension`` has no time
limit, so the build runs in a child process that is killed with its compiler after
``BUILD_TIMEOUT_S`` (all flag sets together); the parent loads the built module itself. Flag
sets are tried in turn (``_FLAG_SETS``) until one both builds and loads; a directory whose build
or load failed is removed. fp32 only; any other dtype is the caller's to send elsewhere.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import importlib.util
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
import warnings
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["STRIP", "KERNEL_CACHE", "BUILD_TIMEOUT_S", "MAX_ROWS_PER_EXPERT", "packed_cpu_available", "pack_weight",
           "pack_into", "copy_into", "packed_grouped_mm"]

STRIP = 16  # columns per strip of a packed weight (two 8-wide vectors of the kernel)
SOURCE = Path(__file__).parent / "csrc" / "packed_grouped_mm.cpp"
BUILD_TIMEOUT_S = 300.0  # the whole build, every flag set together: a compiler slower than that is stuck
# ``moeflow.experts.packed`` sends calls of more rows per expert (on average) to the weights
# themselves: the products are no longer few-row ones there (batch 256 at top-2 of 8 experts),
# and a BLAS's blocking can win at such sizes on some CPUs (docs/benchmarks.md)
MAX_ROWS_PER_EXPERT = 64


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (some containers)
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


KERNEL_CACHE = Path(tempfile.gettempdir()) / f"moeflow_kernels_{_user()}"
# (compiler flags, linker flags), tried in this order until one set builds and loads
_FLAG_SETS = ((("-O3", "-march=native", "-fopenmp"), ("-fopenmp",)),
              (("-O3", "-march=native"), ()),  # without OpenMP: one thread
              (("-O3",), ()))  # a compiler without -march=native: the base ISA
_COMPILERS = ("g++", "c++", "clang++")  # GCC first: its OpenMP is the libgomp torch loads
# what the child process runs: cpp_extension's build (its lock, ninja), argv: name source directory cflags ldflags
_BUILD = ("import sys\nfrom torch.utils.cpp_extension import load\n"
          "load(name=sys.argv[1], sources=[sys.argv[2]], build_directory=sys.argv[3], extra_cflags=sys.argv[4].split(),"
          " extra_ldflags=sys.argv[5].split())\n")


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
    it, or a former build is loaded). When no flag set builds and loads, that is reported once,
    as a ``RuntimeWarning`` naming the errors, and the answer is False: callers then multiply the
    weights themselves (``F.grouped_mm``: the same products)."""
    if _compiler() is None:
        return False
    try:
        _library()
    except (RuntimeError, OSError) as err:  # the compiler's errors, the loader's, or the cache's
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


def _name(compiler: str, cflags: tuple[str, ...], ldflags: tuple[str, ...]) -> str:
    """The module's name, and its build directory's: one per source, compiler, flags, CPU
    (``-march=native``), torch and Python (the binding links both)."""
    parts = [SOURCE.read_bytes(), compiler.encode(), " ".join(cflags).encode(), " ".join(ldflags).encode(),
             platform.machine().encode(), _cpu_name().encode(), torch.backends.cpu.get_cpu_capability().encode(),
             torch.__version__.encode(), sys.version.encode()]
    return "moeflow_packed_" + hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _build_in_child(compiler: str, name: str, directory: Path, cflags: tuple[str, ...], ldflags: tuple[str, ...],
                    deadline: float) -> None:
    """Run ``cpp_extension.load`` in a child process (its own session, so that its ninja and
    compiler can be killed with it), for at most until ``deadline`` (``time.monotonic``)."""
    cmd = [sys.executable, "-c", _BUILD, name, str(SOURCE), str(directory), " ".join(cflags), " ".join(ldflags)]
    child = subprocess.Popen(cmd, env={**os.environ, "CXX": compiler}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = child.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(child)
        raise RuntimeError(f"{compiler} {' '.join(cflags)}: the build did not finish within the "
                           f"{BUILD_TIMEOUT_S:g} s of BUILD_TIMEOUT_S (killed)") from None
    if child.returncode != 0:
        raise RuntimeError(f"{compiler} {' '.join(cflags)}: {out.strip()[-2000:]}")


def _kill_group(child: subprocess.Popen) -> None:
    """Kill ``child`` and everything it started, then reap it. ninja runs each command in a
    process group of its own (so the child's group does not hold the compiler) and stops them
    when signalled: the group gets ``SIGTERM``, then ``SIGKILL``, and on Linux whatever of the
    child's session is left (the compiler's group) gets ``SIGKILL`` too."""
    if not hasattr(os, "killpg"):
        child.kill()
        child.communicate()
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)
    for pid in _session(child.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    child.communicate()


def _session(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux ``/proc``; elsewhere none are found)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = entry.read_text().rsplit(")", 1)[1].split()  # (after the command's name)
            if int(fields[3]) == sid:
                found.append(int(entry.parent.name))
    return found


def _load(name: str, path: Path) -> types.ModuleType:
    """Import the built extension module at ``path``."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a loadable extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@lru_cache(maxsize=None)
def _library() -> types.ModuleType:
    """The built kernel's module: the first flag set that builds and loads (module docstring)."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError(f"the packed CPU kernel needs a C++ compiler on the PATH (one of {list(_COMPILERS)})")
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    errors = []
    for cflags, ldflags in _FLAG_SETS:
        name = _name(compiler, cflags, ldflags)
        directory = KERNEL_CACHE / name
        library = directory / f"{name}.so"
        try:
            _check_cache_dir()
            # built before, and no build under way (cpp_extension's lock): load it; else build
            # (the child waits on the lock of a build under way, then finds it done)
            if not library.exists() or (directory / "lock").exists():
                directory.mkdir(mode=0o700, exist_ok=True)
                _build_in_child(compiler, name, directory, cflags, ldflags, deadline)
            return _load(name, library)
        except (RuntimeError, ImportError, OSError) as err:
            errors.append(str(err))
            if directory.exists():  # a failed build or a library that does not load is not kept
                shutil.rmtree(directory, ignore_errors=True)
            if time.monotonic() >= deadline:
                break
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


def pack_into(w_EKN: torch.Tensor, old: torch.Tensor | None) -> torch.Tensor:
    """``pack_weight(w_EKN)``, into ``old`` (a former pack) when it has the pack's shape: a
    repack keeps the memory a compiled step reads."""
    E, K, N = w_EKN.shape
    fits = old is not None and tuple(old.shape) == (E, -(-N // STRIP), K, STRIP)
    return pack_weight(w_EKN, out=old if fits else None)


def copy_into(t: torch.Tensor | None, old: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy of ``t`` (None for None), into ``old`` when it has ``t``'s shape: what a
    stand-in holds of a bias, kept at the same address across repacks."""
    if t is None:
        return None
    if old is not None and old.shape == t.shape:
        return old.copy_(t)
    return t.detach().clone()


def packed_grouped_mm(x_RK: torch.Tensor, w_ESKP: torch.Tensor, counts_E: torch.Tensor, n: int,
                      bias_En: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, n]``: ``x_RK``'s rows of expert ``e`` (``counts_E[e]`` of them, in expert order)
    times expert ``e``'s weight, packed by ``pack_weight`` from ``[E, K, n]``, plus expert
    ``e``'s row of ``bias_En`` when given (the products start from it: one pass, no second
    read of the output); rows past ``counts_E.sum()`` are zeros. fp32 CPU tensors; the product
    itself runs outside torch, on ``torch.get_num_threads()`` OpenMP threads (the kernel is
    built on the first call)."""
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
    if bias_En is not None and (bias_En.shape != (E, n) or bias_En.dtype != torch.float32
                                or bias_En.device.type != "cpu"):
        raise ValueError(f"bias_En must be an fp32 CPU tensor of shape ({E}, {n}), got {bias_En.dtype} "
                         f"{tuple(bias_En.shape)} on {bias_En.device}")
    x = x_RK.contiguous()
    counts = counts_E.to(torch.int64).contiguous()
    bias = None if bias_En is None else bias_En.detach().contiguous()
    y_RN = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    if x.shape[0] and n:
        _library().packed_grouped_mm(x.data_ptr(), x.shape[0], x.shape[1], w_ESKP.data_ptr(), E, n,
                                     counts.data_ptr(), 0 if bias is None else bias.data_ptr(), y_RN.data_ptr(),
                                     torch.get_num_threads())
    return y_RN
