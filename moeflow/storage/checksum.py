"""Block checksums of the disk tier: a 64-bit (or 32-bit) digest of a byte buffer.

The disk tier computes one per expert block when it writes it and checks it on every read, so a
file changed under a running model (bytes rewritten, truncated and regrown) raises a clear error
instead of feeding the model other weights.

Algorithm, chosen once at import by what is installed (a capability probe, as for kernels):
``xxh3_64`` from the ``xxhash`` package when it imports (several times the rate of ``crc32``:
``docs/benchmarks.md``), else ``crc32`` from the standard library's ``zlib``. Either releases the GIL for large buffers, so
verification on the copy thread overlaps compute. Which one serves this process is ``ALGORITHM``;
both catch any change of a block with overwhelming probability (the checksum guards against
accidents and other processes, not an attacker who can also rewrite it: it lives in this
process's memory only).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

__all__ = ["ALGORITHM", "digest", "algorithms"]


def _xxh3() -> Callable[[memoryview], int] | None:
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash.xxh3_64_intdigest


def algorithms() -> dict[str, Callable[[memoryview], int]]:
    """Every checksum this process can compute: name -> ``f(bytes-like) -> int`` (``crc32``
    always; ``xxh3_64`` when ``xxhash`` is installed). The benchmark times each."""
    out: dict[str, Callable[[memoryview], int]] = {"crc32": zlib.crc32}
    xxh3 = _xxh3()
    if xxh3 is not None:
        out["xxh3_64"] = xxh3
    return out


ALGORITHM: str = "xxh3_64" if _xxh3() is not None else "crc32"
digest: Callable[[memoryview], int] = algorithms()[ALGORITHM]
