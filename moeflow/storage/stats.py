"""``StorageStats``: what an expert store moved and how long the compute waited for it.

One counter set for every fast-tier layout (ring or cache), so the CLI, the benchmark and the
tests read the same fields whichever layout served the model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moeflow.storage.config import format_bytes

__all__ = ["StorageStats"]


@dataclass
class StorageStats:
    """Counters of one store (reset with ``ExpertStore.reset_stats``).

    ``bytes_loaded``: home -> fast tier; ``bytes_from_disk``: the part of it (and of optimizer
    state) read from the disk tier; ``bytes_written_back``: gradients and optimizer state
    written to the home tier. ``hits``/``misses``: requests whose data was resident or already
    loading vs. loaded on demand; ``prefetch_loads``: loads started ahead of need;
    ``stall_s``: seconds the compute thread waited for data; ``fast_bytes``/``peak_fast_bytes``:
    bytes the fast tier holds now / at most.
    """

    bytes_loaded: int = 0
    bytes_from_disk: int = 0
    bytes_written_back: int = 0
    loads: int = 0
    prefetch_loads: int = 0
    hits: int = 0
    misses: int = 0
    stall_s: float = 0.0
    fast_bytes: int = 0
    peak_fast_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else float("nan")

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}

    def format(self) -> str:
        return (
            f"bytes loaded into fast tier: {format_bytes(self.bytes_loaded)} in {self.loads} loads "
            f"({self.prefetch_loads} prefetched); read from disk: {format_bytes(self.bytes_from_disk)}; "
            f"written back: {format_bytes(self.bytes_written_back)}\n"
            f"stall (waiting for data): {self.stall_s * 1e3:.1f} ms; hit rate {self.hit_rate:.1%} "
            f"({self.hits} hits, {self.misses} misses); peak fast-tier bytes {format_bytes(self.peak_fast_bytes)}"
        )
