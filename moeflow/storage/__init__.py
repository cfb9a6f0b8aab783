"""Tiered expert storage: expert weights (and their AdamW state) in host memory or on disk,
streamed into a fast tier with a byte budget, prefetched so loads overlap compute.

Tiers: fast (GPU memory on CUDA; on CPU, a resident-memory budget the store accounts for),
host (pinned when the fast device is CUDA), disk (a safetensors file read into owned buffers,
each expert block checked against a checksum taken when it was written: a file damaged under a
running model raises ``DiskTierError``, an ``OSError`` naming the file and the block). Copies
run on a background thread (and on CUDA a dedicated copy stream, with pinned buffers and events),
so layer ``l + 1``'s experts load while layer ``l`` computes.

Usage::

    store = offload_experts(model, StorageConfig(offload="disk", fast_memory="512MB", prefetch=1))
    with torch.no_grad():
        logits = model(idx)            # experts stream through a ring of fast-tier slots
    print(store.stats.format())        # bytes moved, stall, hit rate, peak fast-tier bytes

Modes, one class each over the shared ``ExpertStore`` (home tier, copy engine, fast-tier byte
accounting, stats): ``"ring"`` is a ``RingStreamer`` (``S`` whole-layer slots, round-robin;
inference and training, see ``OffloadedAdamW``), ``"cache"`` an ``ExpertCache`` (LRU cache of
single experts with routing-aware prefetch, for small-batch decoding). ``config.mode`` picks
the class once, when the store is built.

Modules, bottom up: ``config`` (``StorageConfig``), ``tiers`` (aligned and pinned host buffers,
copy thread), ``checksum`` (block checksums), ``disk`` (``DiskFile``, ``DiskTierError``),
``home`` (where each layer's weights live, slot sizes), ``stats``, ``base`` (``ExpertStore``),
``ring`` and ``cache`` (the two layouts), ``store`` (``StoredExperts``, ``offload_experts``),
``optimizer`` (``OffloadedAdamW``).

Design: why an experts-protocol module and not a hook. ``offload_experts`` replaces each MoE
layer's ``GroupedExperts`` with a parameter-free ``StoredExperts`` whose ``forward(expert_in,
counts_E)`` asks the store for the weights. The layer keeps calling ``self.experts(...)``
with no branch and no knowledge of storage (``layer/`` never imports ``storage/``), exactly
like expert parallelism swaps the dispatcher. A pre-forward hook that installs tensors into
the layer's ``GroupedExperts`` would need that module to keep ``nn.Parameter`` objects whose
data changes under it (``model.parameters()``, ``.to()``, optimizers and checkpoints would all
see the swapped-in slot memory), could not fetch only the routed experts (a hook runs before
routing), and would need a second hook to give the slot back. The module sees ``counts_E``, so
the cache mode fetches only selected experts, and it can wrap the computation in an autograd
function that re-fetches the weights for backward (offloaded training). The math is not
duplicated: ``StoredExperts`` calls a small stand-in ``GroupedExperts`` of the layer's config
through ``torch.func.functional_call`` with the fetched tensors as its parameters, so outputs
and gradients are the in-memory layer's, bit for bit.
"""

from moeflow.storage.base import ExpertStore
from moeflow.storage.cache import ExpertCache
from moeflow.storage.config import StorageConfig, format_bytes, parse_bytes
from moeflow.storage.disk import DiskTierError
from moeflow.storage.home import slot_bytes
from moeflow.storage.optimizer import OffloadedAdamW
from moeflow.storage.ring import RingStreamer
from moeflow.storage.stats import StorageStats
from moeflow.storage.store import StoredExperts, offload_experts

__all__ = [
    "StorageConfig",
    "parse_bytes",
    "format_bytes",
    "ExpertStore",
    "RingStreamer",
    "ExpertCache",
    "StorageStats",
    "DiskTierError",
    "StoredExperts",
    "offload_experts",
    "slot_bytes",
    "OffloadedAdamW",
]
