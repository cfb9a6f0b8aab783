"""Configuration of the tiered expert store, validated on construction.

Byte sizes accept an int (bytes) or a string with a unit: ``"512MB"``, ``"1.5GiB"``, ``"64k"``.
Decimal units (kB, MB, GB, TB) are powers of 1000, binary units (KiB, MiB, GiB, TiB) powers of
1024; a bare ``K``/``M``/``G``/``T`` (any case) means the decimal unit, as in ``dd``/``du -si``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from moeflow.config import _choice, _int

__all__ = ["StorageConfig", "parse_bytes", "format_bytes", "HomeTier", "StoreMode", "DiskReads"]

HomeTier = Literal["host", "disk"]
StoreMode = Literal["ring", "cache"]
DiskReads = Literal["direct", "cached"]

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: object, name: str = "size") -> int:
    """``512MB`` -> 512_000_000, ``"2GiB"`` -> 2**31, ``4096`` -> 4096 (whole bytes, rounded down).

    Raises ``TypeError`` for anything but an int or str, and ``ValueError`` naming ``name`` and
    the value for a malformed string, an unknown unit, or a size below one byte.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be an int number of bytes or a string like '512MB', got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        if match is None:
            raise ValueError(f"{name} must look like '512MB', '1.5GiB' or '4096', got {value!r}")
        number, unit = match.groups()
        if unit.lower() not in _UNITS:
            raise ValueError(
                f"{name} has unknown unit {unit!r} in {value!r}; use B, kB/MB/GB/TB (powers of 1000) "
                "or KiB/MiB/GiB/TiB (powers of 1024)"
            )
        size = math.floor(float(number) * _UNITS[unit.lower()])
    if size < 1:
        raise ValueError(f"{name} must be at least 1 byte, got {value!r}")
    return size


def format_bytes(n: float) -> str:
    """``123456789`` -> ``"117.7 MiB"`` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    """Where expert weights live and how they move to the fast tier.

    Attributes:
        offload: the home tier of the expert weights (and, when trainable, their AdamW
            state): ``"host"`` (host memory, pinned when the fast device is CUDA) or ``"disk"``
            (safetensors files, read into owned buffers, a checksum per expert block).
            Gradient accumulators (``trainable``) are always host buffers (pinned on CUDA),
            whichever the home tier.
        fast_memory: byte budget of the fast tier (an int or ``"512MB"``; normalised to int).
            On CUDA this is GPU memory; on CPU it is the resident memory the store may hold
            for expert weights (the ring slots or cache slots, and transient gradients).
        mode: ``"ring"``: the fast tier holds ``ring_slots`` slots of one whole layer's experts
            each; layers stream through them round-robin (inference and training).
            ``"cache"``: the fast tier is an LRU cache of single experts; a layer fetches only
            the experts its router selected (small-batch decoding; inference only).
        ring_slots: slots in the ring; ``None`` takes as many as the budget holds (minus one
            slot's worth reserved for gradients when ``trainable``). Must be >= 1.
        prefetch: how many layers ahead (in execution order: forward, then backward in
            reverse) loads are started while the current layer computes; 0 loads each layer
            synchronously when it is needed. In ring mode at most ``ring_slots - 1``.
        trainable: train the experts: gradient accumulators in host memory, AdamW state in
            the home tier (see ``OffloadedAdamW``); reserves one layer's bytes of the budget
            for gradients. With grad enabled the experts record a graph whether or not their
            input requires grad (e.g. frozen embeddings and attention).
        directory: where the disk tier writes its safetensors files (disk tier only). Each
            store (and each ``OffloadedAdamW``) writes a file of its own, with a unique name
            (``experts-XXXXXXXX.safetensors``), so stores can share a directory; ``close()``
            removes it. ``None`` uses a temporary directory removed by ``ExpertStore.close()``
            (or when the store is garbage-collected, or at exit).
        evict_page_cache: after each read from the disk tier, advise the kernel to drop the
            bytes just read from the page cache (``POSIX_FADV_DONTNEED``), so every load is a
            real disk read, as it is when the weights are far larger than RAM. Disk tier only.
            Page-aligned reads use ``O_DIRECT`` where the file system supports it and bypass
            the page cache anyway; this matters for the buffered rest (unaligned tails, file
            systems without ``O_DIRECT``) and for the optimizer state's reads.
        disk_reads: how the disk tier reads (disk tier only). ``"direct"``: page-aligned reads
            with ``O_DIRECT`` where the file system has it, straight from the device into the
            slot, every load a real read: what a model far larger than RAM gets, and the least
            CPU per byte. ``"cached"``: buffered reads through the operating system's page
            cache: a file that fits in free RAM stays there after the first pass, so a load is
            a memory copy; that is what a memory-mapped offload (accelerate's ``offload_folder``)
            gets. The page cache is the kernel's memory, given back under pressure; the
            process's own memory stays within the budget either way.
        verify_checksums: check every block read from the disk tier (one expert's slice of a
            tensor) against the checksum computed when it was written (``moeflow.storage.
            checksum``): a file changed under the running store raises ``DiskTierError`` (an
            ``OSError``) instead of feeding the model other weights. Disk tier only; ``False``
            skips the check (the storage benchmark measures its cost). A truncated file is a
            clear error either way.
        device: the fast device (``"cpu"`` or ``"cuda[:N]"``).
    """

    offload: HomeTier = "host"
    fast_memory: int | str = "512MB"
    mode: StoreMode = "ring"
    ring_slots: int | None = None
    prefetch: int = 1
    trainable: bool = False
    directory: str | Path | None = None
    evict_page_cache: bool = False
    disk_reads: DiskReads = "direct"
    verify_checksums: bool = True
    device: str = "cpu"

    def __post_init__(self) -> None:
        _choice("offload", self.offload, HomeTier)
        _choice("mode", self.mode, StoreMode)
        _choice("disk_reads", self.disk_reads, DiskReads)
        object.__setattr__(self, "fast_memory", parse_bytes(self.fast_memory, "fast_memory"))
        if self.ring_slots is not None:
            _int("ring_slots", self.ring_slots, minimum=1)
        _int("prefetch", self.prefetch, minimum=0)
        if self.ring_slots is not None and self.mode == "ring" and self.prefetch > self.ring_slots - 1:
            raise ValueError(
                f"prefetch={self.prefetch} needs at least prefetch + 1 ring slots (one computing, the "
                f"others loading), got ring_slots={self.ring_slots}"
            )
        for flag in ("trainable", "evict_page_cache", "verify_checksums"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.trainable and self.mode != "ring":
            raise ValueError(f"trainable=True needs mode='ring' (the expert cache is for inference), got mode={self.mode!r}")
        if self.evict_page_cache and self.offload != "disk":
            raise ValueError(f"evict_page_cache=True only applies to offload='disk', got offload={self.offload!r}")
        if self.disk_reads != "direct" and self.offload != "disk":
            raise ValueError(f"disk_reads={self.disk_reads!r} only applies to offload='disk', got offload={self.offload!r}")
        if self.disk_reads == "cached" and self.evict_page_cache:
            raise ValueError("disk_reads='cached' reads through the page cache and evict_page_cache=True empties it "
                             "after every read: choose one")
        if not self.verify_checksums and self.offload != "disk":
            raise ValueError(f"verify_checksums=False only applies to offload='disk' (host memory has no checksums), "
                             f"got offload={self.offload!r}")
        if self.directory is not None and not isinstance(self.directory, (str, Path)):
            raise TypeError(f"directory must be a str or Path, got {type(self.directory).__name__}")
        # options that would be silently ignored are refused
        if self.directory is not None and self.offload != "disk":
            raise ValueError(f"directory={str(self.directory)!r} only applies to offload='disk', "
                             f"got offload={self.offload!r}")
        if self.ring_slots is not None and self.mode != "ring":
            raise ValueError(f"ring_slots={self.ring_slots} only applies to mode='ring', got mode={self.mode!r}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

