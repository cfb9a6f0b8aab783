"""The slow tiers and the copy engine that moves bytes between tiers.

- ``DiskFile``: a safetensors file, memory-mapped read-write, whose tensors are torch views of
  the mapping (no copy until a byte is touched). Reads can drop the bytes they touched from the
  page cache (``POSIX_FADV_DONTNEED``) so every read is a real disk read.
- ``pin``: host tensors, page-locked when the fast device is CUDA (asynchronous H2D copies need
  pinned sources).
- ``CopyEngine``: runs copy jobs in order on one background thread, so loads overlap the
  compute of the main thread (torch ops and file reads release the GIL). On CUDA each job also
  issues its device copies on a dedicated copy stream and records an event the consumer's
  stream waits on; the host never blocks on a GPU copy.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

__all__ = ["DiskFile", "CopyEngine", "pin", "tensor_bytes", "aligned_empty", "new_file", "PAGE"]

_PAGE = 4096  # file offsets and buffers aligned to this allow O_DIRECT reads
_CHUNK = 8 << 20  # bytes per O_DIRECT request

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


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


class DiskFile:
    """A safetensors file written once, then mapped read-write: ``file[key]`` is a tensor view
    of the mapped bytes (writes to it go to the file through the page cache).

    The safetensors layout is an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and byte range, then the data. We write it ourselves so that every
    tensor starts on a 4096-byte boundary of the file: the header is padded with spaces (the
    format allows trailing whitespace) and the gaps between tensors are filled by ``uint8``
    padding tensors named ``__pad__.<i>`` (the format forbids holes). Any safetensors reader
    loads the file. Aligned offsets let ``read_into`` use ``O_DIRECT``: the device writes
    straight into the destination buffer, bypassing the page cache, which costs far less CPU
    than a buffered read (on a 2-core machine the copy thread then barely slows the compute).
    """

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        self.path = Path(path)
        self._ranges: dict[str, tuple[int, int]] = {}
        self._write(tensors)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+")
        self._fd = os.open(self.path, os.O_RDWR)
        try:
            self._direct_fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT"))
        except (OSError, AttributeError):  # no O_DIRECT here (tmpfs, macOS): buffered reads
            self._direct_fd = None
        flat = torch.from_numpy(self._map)
        self._views: dict[str, torch.Tensor] = {
            key: flat[a:b].view(tensors[key].dtype).view(tensors[key].shape) for key, (a, b) in self._ranges.items()
        }

    @property
    def direct_io(self) -> bool:
        """Whether aligned reads bypass the page cache (``O_DIRECT``)."""
        return self._direct_fd is not None

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        names = {v: k for k, v in _DTYPES.items()}
        entries, layout, offset = {}, [], 0
        for i, (key, t) in enumerate(tensors.items()):
            if t.dtype not in names:
                raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which the disk tier does not store")
            pad = -offset % _PAGE
            if pad:
                entries[f"__pad__.{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
                layout.append(pad)
                offset += pad
            n = tensor_bytes(t)
            entries[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            layout.append(t)
            offset += n
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-(8 + len(header)) % _PAGE)
        data_start = 8 + len(header)
        for key, info in entries.items():
            if not key.startswith("__pad__."):
                a, b = info["data_offsets"]
                self._ranges[key] = (data_start + a, data_start + b)
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for item in layout:
                if isinstance(item, int):
                    f.write(bytes(item))
                else:
                    f.write(memoryview(item.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())  # clean pages: evictable from the page cache, visible to O_DIRECT

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._views[key]

    def keys(self) -> list[str]:
        return list(self._views)

    def byte_range(self, key: str, index: int | None = None) -> tuple[int, int]:
        """File offsets ``[start, end)`` of tensor ``key`` (of its slice ``[index]`` if given)."""
        start, end = self._ranges[key]
        if index is None:
            return start, end
        rows = self._views[key].shape[0]
        step = (end - start) // rows
        return start + index * step, start + (index + 1) * step

    def read_into(self, dst: torch.Tensor, start: int, end: int) -> int:
        """Read file bytes ``[start, end)`` into the contiguous host tensor ``dst``; returns
        how many bytes bypassed the page cache.

        System calls (``preadv``) release the GIL and never map the pages into this process
        (so ``evict`` can drop them again). When ``dst`` and ``start`` are 4096-byte aligned the
        whole pages are read with ``O_DIRECT`` in chunks, the tail (under a page) buffered.
        """
        if dst.device.type != "cpu" or not dst.is_contiguous() or tensor_bytes(dst) != end - start:
            raise ValueError(f"dst must be a contiguous host tensor of {end - start} bytes, got "
                             f"{tensor_bytes(dst)} bytes on {dst.device}")
        view = memoryview(dst.view(-1).view(torch.uint8).numpy()).cast("B")
        done = 0
        if self._direct_fd is not None and start % _PAGE == 0 and dst.data_ptr() % _PAGE == 0:
            aligned = len(view) // _PAGE * _PAGE
            while done < aligned:
                n = os.preadv(self._direct_fd, [view[done : min(aligned, done + _CHUNK)]], start + done)
                if n <= 0:
                    raise OSError(f"{self.path}: short read at byte {start + done} (file truncated?)")
                done += n
        direct = done
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], start + done)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {start + done} (file truncated?)")
            done += n
        return direct

    def write_from(self, src: torch.Tensor, start: int, end: int) -> None:
        """Write the contiguous host tensor ``src`` to file bytes ``[start, end)`` (``pwritev``;
        ``flush`` makes it durable and evictable)."""
        if src.device.type != "cpu" or not src.is_contiguous() or tensor_bytes(src) != end - start:
            raise ValueError(f"src must be a contiguous host tensor of {end - start} bytes, got "
                             f"{tensor_bytes(src)} bytes on {src.device}")
        view = memoryview(src.view(-1).view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.pwritev(self._fd, [view[done:]], start + done)
            if n <= 0:
                raise OSError(f"{self.path}: short write at byte {start + done} (disk full?)")
            done += n

    def evict(self, start: int, end: int) -> None:
        """Drop ``[start, end)`` of the file from the page cache. Only clean pages that no
        process maps are dropped: call ``flush`` after writing through the mapping, and read
        with ``read_into`` (not through ``file[key]``) the bytes you want evictable."""
        os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def flush(self) -> None:
        """Make writes (through the mapping or ``write_from``) durable; written pages become
        clean, hence evictable."""
        self._map.flush()
        os.fsync(self._fd)

    def close(self) -> None:
        """Unmap and close the file (idempotent). Drop every view of ``file[key]`` first:
        touching one after ``close`` reads unmapped memory."""
        self._views.clear()
        if self._map is not None:
            self._map.flush()
            self._map._mmap.close()  # type: ignore[attr-defined]
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None

    @staticmethod
    def create(directory: Path, prefix: str, tensors: dict[str, torch.Tensor]) -> "DiskFile":
        """A ``DiskFile`` of ``tensors`` in a new file of its own in ``directory`` (see
        ``new_file``); the file is removed again if writing it fails."""
        path = new_file(Path(directory), prefix)
        try:
            return DiskFile(path, tensors)
        except BaseException:
            path.unlink(missing_ok=True)
            raise


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
