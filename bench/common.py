"""What the benchmarks share: where the repository and the results are, the environment a
benchmark's child process needs to import both ``moeflow`` and ``bench`` from this checkout,
device synchronisation, the device's copy bandwidth, the device memory a candidate's calls
reach (``PeakMemory``), and a count of what ``torch.compile`` did during a call
(``CompileWatch``). torch is imported where it is used: the GPU check's
orchestrator imports this module and stays light."""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["REPO", "RESULTS", "child_env", "sync", "copy_bandwidth_gbps", "PeakMemory", "CompileWatch", "median_ms_timer"]

REPO = Path(__file__).resolve().parent.parent  # the checkout: ``moeflow/`` and ``bench/`` side by side
RESULTS = REPO / "bench" / "results"


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) with the checkout first on ``PYTHONPATH``, so that a
    child started with ``sys.executable -m bench.X`` (or ``-c`` code importing ``bench``) finds
    this checkout's ``bench`` and ``moeflow`` whatever its working directory."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    return env


def sync(device: torch.device | str) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on the CPU, whose work is done when a
    call returns."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbps(device: torch.device | str, *, nbytes: int | None = None, repeats: int = 5) -> float:
    """The device's memory bandwidth as a large copy reaches it: ``dst.copy_(src)`` of ``nbytes``
    (default 1 GiB on CUDA, 256 MiB on the CPU: well past the caches), read and write bytes
    counted (as ``bench.gpu_kernels``' copy ceiling), GB/s, median of ``repeats`` after one
    warm-up copy; timed with CUDA events on CUDA, ``time.perf_counter`` on the CPU. What a
    bandwidth-bound kernel, such as a decode step reading every weight it needs once, can
    hope to reach."""
    import torch

    device = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**28
    if not isinstance(nbytes, int) or nbytes < 2**20:
        raise ValueError(f"nbytes must be an int >= 1 MiB, got {nbytes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(seconds) / 1e9


def median_ms_timer(device: torch.device, repeats: int, warmup: int) -> Callable[[Callable[[], object]], float]:
    """A function giving the median milliseconds of ``fn()`` over ``repeats`` calls after
    ``warmup``: CUDA events around each call on the GPU (the host waits only after a call
    ends), wall clock elsewhere."""
    import torch

    def measure(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return measure


class PeakMemory:
    """The most device memory held during any call that ``wrap`` watched: on CUDA the caching
    allocator's ``max_memory_allocated``, its peak counter reset before each watched call, so
    that candidates taking turns in one process each get their own peak (what the others keep
    allocated between their calls, such as their weights or caches, counts in every peak: compare
    the peaks, not their sizes alone). ``bytes`` is None on the CPU, where the candidates share
    one process's resident set and no counter tells them apart, and before any call."""

    def __init__(self, device: torch.device | str) -> None:
        import torch

        self.device = torch.device(device)
        self.bytes: int | None = None

    def wrap(self, fn):  # type: ignore[no-untyped-def]
        """``fn`` with its calls watched (the same arguments and result)."""
        if self.device.type != "cuda":
            return fn

        def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize(self.device)
                peak = int(torch.cuda.max_memory_allocated(self.device))
                self.bytes = peak if self.bytes is None else max(self.bytes, peak)
        return watched

    @property
    def gib(self) -> float | None:
        return None if self.bytes is None else self.bytes / 2**30


class _RecompileMessages(logging.Handler):
    """Collects dynamo's recompile messages (the ``recompiles`` log artifact)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class CompileWatch:
    """What ``torch.compile`` did while the ``with`` block ran: ``graphs`` dynamo compiled (a
    first compilation or a recompilation), ``cuda_graphs`` captured (CUDA graph trees record a
    graph again when, say, a static input moved), and ``recompiles``, the first lines of
    dynamo's recompile messages (which guard failed). A compiled decode that is warmed up must
    show none of them during its timed calls: one that recompiles or re-records is timing its
    own compilation.

    The first watch of a process turns dynamo's ``recompiles`` log on (it also goes to stderr)
    and wraps ``torch.cuda.graphs.CUDAGraph.capture_begin`` (where CUDA exists) to count."""

    _handler: _RecompileMessages | None = None
    _captures = 0

    def __init__(self) -> None:
        self.graphs = self.cuda_graphs = 0
        self.recompiles: list[str] = []

    @classmethod
    def _install(cls) -> _RecompileMessages:
        import torch

        if cls._handler is None:
            torch._logging.set_logs(recompiles=True)
            cls._handler = _RecompileMessages()
            logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(cls._handler)
            if torch.cuda.is_available():
                graph_class = torch.cuda.graphs.CUDAGraph
                capture_begin = graph_class.capture_begin

                def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                    CompileWatch._captures += 1
                    return capture_begin(self, *args, **kwargs)
                graph_class.capture_begin = counted  # type: ignore[method-assign]
        return cls._handler

    @staticmethod
    def _graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    def __enter__(self) -> CompileWatch:
        handler = self._install()
        self._start = (self._graphs(), CompileWatch._captures, len(handler.messages))
        return self

    def __exit__(self, *exc: object) -> None:
        graphs, captures, messages = self._start
        self.graphs = self._graphs() - graphs
        self.cuda_graphs = CompileWatch._captures - captures
        new = self._install().messages[messages:]
        self.recompiles = [m.strip().splitlines()[-1].strip(" -") for m in new]

    def as_dict(self) -> dict:
        return {"graphs": self.graphs, "cuda_graphs": self.cuda_graphs, "recompiles": self.recompiles}
