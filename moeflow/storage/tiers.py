"""Host buffers of the slow tiers and the copy engine that moves bytes between tiers.

- ``aligned_empty`` / ``new_file``: page-aligned host buffers and uniquely named files, what
  the disk tier (``moeflow.storage.disk``) reads into and writes.
- ``pin``: host tensors, page-locked when the fast device is CUDA (asynchronous H2D copies need
  pinned sources).
- ``CopyEngine``: runs copy jobs in order on one background thread, so loads overlap the
  compute of the main thread (torch ops and file reads release the GIL). On CUDA each job also
  issues its device copies on a dedicated copy stream and records an event the consumer's
  stream waits on; the host never blocks on a GPU copy.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["CopyEngine", "pin", "tensor_bytes", "aligned_empty", "new_file", "PAGE"]

_PAGE = 4096  # file offsets and buffers aligned to this allow O_DIRECT reads


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


PAGE = _PAGE


def aligned_empty(nbytes: int, *, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """A ``uint8 [nbytes]`` buffer; on the host its first byte is 4096-byte aligned (what
    ``O_DIRECT`` reads need; the allocator only promises 64)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8, pin_memory=pin_memory)
    skip = -raw.data_ptr() % _PAGE
    return raw[skip : skip + nbytes]


def new_file(directory: Path, prefix: str) -> Path:
    """A new, empty ``<prefix>XXXXXXXX.safetensors`` file in ``directory`` that no other caller
    gets (``mkstemp``): stores sharing a directory never write into each other's files."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".safetensors")
    os.close(fd)
    return Path(name)


def pin(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host copy of ``t``; page-locked when ``device`` is CUDA (so H2D copies can be async)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=device.type == "cuda")
    out.copy_(t.detach())
    return out


class CopyEngine:
    """Ordered asynchronous copies: ``submit(job) -> Future``; ``job(stream)`` runs on one
    background thread, in submission order, with ``stream`` the CUDA copy stream (``None`` on
    CPU). A job that issues device copies records a ``torch.cuda.Event`` on that stream and
    returns it; ``wait(future)`` makes the caller's current stream wait on it (CUDA) after the
    host-side part finished, and returns the seconds the caller spent blocked (the stall)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeflow-copy")

    def submit(self, job: Callable[[torch.cuda.Stream | None], object]) -> Future:
        stream = self.stream

        def run() -> object:
            if stream is None:
                return job(None)
            # a new thread starts on device 0: select the store's device, then its copy stream
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                return job(stream)

        return self._pool.submit(run)

    def wait(self, future: Future) -> float:
        t0 = time.perf_counter()
        result = future.result()
        stalled = time.perf_counter() - t0
        if isinstance(result, torch.cuda.Event):
            torch.cuda.current_stream(self.device).wait_event(result)
        return stalled

    def close(self) -> None:
        self._pool.shutdown(wait=True)
