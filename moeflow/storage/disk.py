"""The disk tier: a safetensors file the store writes once and then reads (and the optimizer
rewrites) block by block, with a checksum per block.

Legend: a *block* is one row ``[e]`` of an expert tensor ``[E, ...]`` (one expert's slice; a
0-d tensor is one block). Every read lands in a buffer the caller owns and is checked against
the checksum computed when the block was written (``moeflow.storage.checksum``).

Why no memory map: a tensor that is a view of a mapped file reads the file's pages when it is
touched, long after any check, and if the file shrank meanwhile (truncated by another process,
a full disk, a user's ``> file``) the kernel answers the touch with ``SIGBUS``: the process dies
without a Python exception (``model.state_dict()`` did, before). Reads with ``preadv`` into owned
buffers instead fail as a short read (an ``OSError``), and the size is checked before each read;
checksums catch bytes changed in place, which a map would hand out silently. The store keeps
shapes and dtypes as meta tensors (``spec``), so no code path can touch the file's bytes except
through ``read`` and ``write``.

A file replaced (``mv other file``) or deleted under the store is not damage: the store keeps its
open descriptor, hence the inode it wrote, and reads the weights it wrote (``close`` then removes
only a path that still names that inode).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moeflow.storage import checksum
from moeflow.storage.tiers import PAGE, new_file, tensor_bytes

__all__ = ["DiskFile", "DiskTierError"]

_CHUNK = 8 << 20  # bytes per O_DIRECT request

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class DiskTierError(OSError):
    """The disk tier's file no longer holds what the store wrote: a block's checksum differs,
    or the file is shorter than the block. ``path``, ``key`` (``layers.<l>.<name>`` for expert
    weights), ``index`` (the expert, ``None`` for the whole tensor) and ``problem`` name it."""

    def __init__(self, path: Path, key: str, index: int | None, problem: str) -> None:
        block = f"{key}[{index}] (expert {index})" if index is not None else f"{key} (all experts)"
        super().__init__(f"the disk tier file {path} is damaged: block {block}: {problem}")
        self.path, self.key, self.index, self.problem = path, key, index, problem


@dataclass(frozen=True)
class _Entry:
    """Where one tensor lives in the file: ``rows`` blocks of ``row_bytes`` from ``start``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int
    rows: int
    row_bytes: int


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous host tensor ``t`` (no copy)."""
    return memoryview(t.view(-1).view(torch.uint8).numpy()).cast("B")


class DiskFile:
    """A safetensors file written once from ``tensors``; ``read``/``write`` move a tensor (or
    one block ``[index]`` of it) between the file and an owned host buffer, checking
    (``verify``) or renewing the blocks' checksums.

    The safetensors layout is an 8-byte little-endian header length, a JSON header giving each
    tensor's dtype, shape and byte range, then the data. We write it ourselves so that every
    tensor starts on a 4096-byte boundary of the file: the header is padded with spaces (the
    format allows trailing whitespace) and the gaps between tensors are filled by ``uint8``
    padding tensors named ``__pad__.<i>`` (the format forbids holes). Any safetensors reader
    loads the file. Aligned offsets let ``read_into`` use ``O_DIRECT``: the device writes
    straight into the destination buffer, bypassing the page cache, which costs far less CPU
    than a buffered read (on a 2-core machine the copy thread then barely slows the compute).

    Reads and writes of one file must not overlap in time for the same block (the store runs
    them on its one copy thread, or on the caller's thread with no load in flight).
    ``verified_bytes`` and ``verify_s`` count the bytes checked and the seconds the checks took.
    """

    def __init__(self, path: Path, tensors: dict[str, torch.Tensor], *, verify: bool = True, direct: bool = True) -> None:
        for name, flag in (("verify", verify), ("direct", direct)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        self.path = Path(path)
        self.verify = verify
        self.direct_requested = direct  # (``direct_io``: whether O_DIRECT is in use, where the file system has it)
        self._entries: dict[str, _Entry] = {}
        self._sums: dict[str, list[int]] = {}  # key -> per block, the checksum it was written with
        self._fd: int | None = None
        self._direct_fd: int | None = None
        self.verified_bytes = 0  # bytes read and checked, and the seconds the checks took
        self.verify_s = 0.0
        self._write(tensors)
        self._fd = os.open(self.path, os.O_RDWR)
        st = os.fstat(self._fd)
        self._inode = (st.st_dev, st.st_ino)
        try:  # direct=False: every read buffered, through the page cache
            self._direct_fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECT")) if direct else None
        except (OSError, AttributeError):  # no O_DIRECT here (tmpfs, macOS): buffered reads
            self._direct_fd = None

    @property
    def direct_io(self) -> bool:
        """Whether aligned reads bypass the page cache (``O_DIRECT``)."""
        return self._direct_fd is not None

    @property
    def checksum(self) -> str | None:
        """The checksum reads are verified with (``None``: not verified)."""
        return checksum.ALGORITHM if self.verify else None

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        names = {v: k for k, v in _DTYPES.items()}
        entries, layout, offset = {}, [], 0
        for i, (key, t) in enumerate(tensors.items()):
            if t.dtype not in names:
                raise TypeError(f"tensor {key!r} has dtype {t.dtype}, which the disk tier does not store")
            pad = -offset % PAGE
            if pad:
                entries[f"__pad__.{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [offset, offset + pad]}
                layout.append(pad)
                offset += pad
            n = tensor_bytes(t)
            entries[key] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            layout.append((key, t))
            offset += n
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-(8 + len(header)) % PAGE)
        data_start = 8 + len(header)
        for key, t in tensors.items():
            a, b = entries[key]["data_offsets"]
            rows = t.shape[0] if t.dim() >= 1 and t.shape[0] > 0 else 1
            self._entries[key] = _Entry(t.dtype, tuple(t.shape), data_start + a, data_start + b, rows, (b - a) // rows)
        with open(self.path, "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for item in layout:
                if isinstance(item, int):
                    f.write(bytes(item))
                    continue
                key, t = item
                raw = _raw(t.detach().to("cpu").contiguous())
                f.write(raw)
                if self.verify:
                    self._sums[key] = self._digests(key, raw, None)
            f.flush()
            os.fsync(f.fileno())  # clean pages: evictable from the page cache, visible to O_DIRECT

    # ------------------------------------------------------------------ layout

    def keys(self) -> list[str]:
        return list(self._entries)

    def spec(self, key: str) -> torch.Tensor:
        """A meta tensor with tensor ``key``'s shape and dtype (no data: reading one raises)."""
        e = self._entries[key]
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    def byte_range(self, key: str, index: int | None = None) -> tuple[int, int]:
        """File offsets ``[start, end)`` of tensor ``key`` (of its block ``[index]`` if given)."""
        e = self._entries[key]
        if index is None:
            return e.start, e.end
        if not 0 <= index < e.rows:
            raise IndexError(f"block {index} of {key!r} out of range [0, {e.rows})")
        return e.start + index * e.row_bytes, e.start + (index + 1) * e.row_bytes

    # ------------------------------------------------------------------ checked reads and writes

    def _digests(self, key: str, raw: memoryview, index: int | None) -> list[int]:
        rb = self._entries[key].row_bytes
        rows = 1 if index is not None else self._entries[key].rows
        return [checksum.digest(raw[r * rb : (r + 1) * rb]) for r in range(rows)]

    def _size(self) -> int:
        if self._fd is None:
            raise RuntimeError(f"the disk tier file {self.path} is closed")
        return os.fstat(self._fd).st_size

    def read(self, dst: torch.Tensor, key: str, index: int | None = None) -> int:
        """Read tensor ``key`` (its block ``[index]``) into the contiguous host tensor ``dst``
        and check each block's checksum; returns the bytes that bypassed the page cache.

        Raises ``DiskTierError`` (an ``OSError``) naming the file, the block and the problem if
        the file is shorter than the block or a block's bytes differ from what was written.
        """
        start, end = self.byte_range(key, index)
        size = self._size()
        if size < end:
            raise DiskTierError(self.path, key, index, f"the file is {size} bytes but the block ends at byte {end} "
                                "(truncated under the running store?)")
        try:
            direct = self.read_into(dst, start, end)
        except OSError as err:
            if not isinstance(err, DiskTierError) and self._size() < end:  # shrank between the check and the read
                raise DiskTierError(self.path, key, index, f"short read: the file is now {self._size()} bytes, "
                                    f"the block ends at byte {end}") from err
            raise
        if self.verify:
            t0 = time.perf_counter()
            got = self._digests(key, _raw(dst), index)
            self.verify_s += time.perf_counter() - t0
            self.verified_bytes += end - start
            want = self._sums[key] if index is None else [self._sums[key][index]]
            for r, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    row = r if index is None else index
                    raise DiskTierError(self.path, key, row, f"{checksum.ALGORITHM} checksum mismatch (written "
                                        f"{w:#x}, read {g:#x}): the file was changed under the running store")
        return direct

    def write(self, src: torch.Tensor, key: str, index: int | None = None) -> None:
        """Write the contiguous host tensor ``src`` as tensor ``key`` (its block ``[index]``)
        and record the new blocks' checksums."""
        self.write_from(src, *self.byte_range(key, index))
        if self.verify:
            sums = self._digests(key, _raw(src), index)
            if index is None:
                self._sums[key] = sums
            else:
                self._sums[key][index] = sums[0]

    def tensor(self, key: str) -> torch.Tensor:
        """A new host tensor holding tensor ``key``, read with ``read`` (checked)."""
        e = self._entries[key]
        out = torch.empty(e.shape, dtype=e.dtype)
        self.read(out, key)
        return out

    # ------------------------------------------------------------------ raw byte ranges

    def read_into(self, dst: torch.Tensor, start: int, end: int) -> int:
        """Read file bytes ``[start, end)`` into the contiguous host tensor ``dst`` (unchecked;
        ``read`` checks); returns how many bytes bypassed the page cache.

        System calls (``preadv``) release the GIL and never map the pages into this process
        (so ``evict`` can drop them again). When ``dst`` and ``start`` are 4096-byte aligned the
        whole pages are read with ``O_DIRECT`` in chunks, the tail (under a page) buffered.
        """
        view = self._open_view(dst, "dst", start, end)
        done = 0
        if self._direct_fd is not None and start % PAGE == 0 and dst.data_ptr() % PAGE == 0:
            aligned = len(view) // PAGE * PAGE
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
        unchecked: ``write`` records checksums; ``flush`` makes it durable and evictable)."""
        view = self._open_view(src, "src", start, end)
        done = 0
        while done < len(view):
            n = os.pwritev(self._fd, [view[done:]], start + done)
            if n <= 0:
                raise OSError(f"{self.path}: short write at byte {start + done} (disk full?)")
            done += n

    def _open_view(self, t: torch.Tensor, name: str, start: int, end: int) -> memoryview:
        """The bytes of ``t`` (argument ``name``) for a system call on file bytes ``[start, end)``,
        once ``t`` is checked to be a contiguous host tensor of exactly that many bytes (the
        call reads or writes raw memory) and the file is checked to be open."""
        if t.device.type != "cpu" or not t.is_contiguous() or tensor_bytes(t) != end - start:
            raise ValueError(f"{name} must be a contiguous host tensor of {end - start} bytes, got "
                             f"{tensor_bytes(t)} bytes on {t.device}")
        if self._fd is None:
            raise RuntimeError(f"the disk tier file {self.path} is closed")
        return _raw(t)

    def evict(self, start: int, end: int) -> None:
        """Drop ``[start, end)`` of the file from the page cache (clean pages only: ``flush``
        after writing)."""
        os.posix_fadvise(self._fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def flush(self) -> None:
        """Make writes durable; written pages become clean, hence evictable."""
        os.fsync(self._fd)

    # ------------------------------------------------------------------ lifetime

    def owns_path(self) -> bool:
        """Whether ``path`` still names the file this object wrote (not deleted or replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._inode

    def close(self) -> None:
        """Close the file (idempotent)."""
        for name in ("_fd", "_direct_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)

    def remove(self) -> None:
        """Close, then delete ``path`` if it still names this file (a file put there by someone
        else since is theirs)."""
        owned = self._fd is not None and self.owns_path()
        self.close()
        if owned:
            self.path.unlink(missing_ok=True)

    @staticmethod
    def create(directory: Path, prefix: str, tensors: dict[str, torch.Tensor], *, verify: bool = True,
               direct: bool = True) -> "DiskFile":
        """A ``DiskFile`` of ``tensors`` in a new file of its own in ``directory`` (see
        ``new_file``); the file is removed again if writing it fails."""
        path = new_file(Path(directory), prefix)
        try:
            return DiskFile(path, tensors, verify=verify, direct=direct)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
