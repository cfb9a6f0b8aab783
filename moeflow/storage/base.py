"""``ExpertStore``: what every fast-tier layout shares — the home tier, the copies into the fast
tier (``moeflow.storage.loads``), the fast tier's byte accounting, the statistics and the store's
lifetime.

Legend: moeflow.types (``E`` experts, ``D`` model dim). ``L`` is the number of MoE layers in the
store; a *slot* is one unit of the fast tier a load fills (a whole layer in the ring, one expert
in the cache).

Two subclasses lay the fast tier out: ``RingStreamer`` (``mode="ring"``, whole-layer slots
round-robin, inference and training) and ``ExpertCache`` (``mode="cache"``, an LRU cache of
single experts). ``ExpertStore(experts, config)`` builds the one ``config.mode`` names: the mode
picks the class once, at construction, and no code path here branches on it. This class owns
what a load is in every layout: a copy job on the ``CopyEngine`` (disk or host -> slot; on CUDA
through a pinned staging buffer and the copy stream), a future per slot in flight
(``_loading``), the stall spent waiting for it, the bytes it moved, and what becomes of a load
nobody waits for any more (``_orphans``).

Every failed load is reported exactly once. The caller that waits for a failed load gets its
error; before it is raised, the store waits for the other loads in flight (a prefetch queued
behind it, the other experts of the same call) and for the retired ones, forgets the slots of
those that failed too and adds their errors to the raised one as notes (``__notes__``), since
they are what that caller abandoned. A failure nobody was told about that way (a prefetch whose
slot was reclaimed, then no failure to ride on) is raised by ``close`` (or, leaving ``with
store:`` on another error, added to that error as a note): never lost, never raised twice.

The fast tier's bytes are counted here (``stats.fast_bytes``, ``stats.peak_fast_bytes``): the
subclasses report their slots, transient gradients and gather workspaces through ``_count_fast``.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import ClassVar

import torch
from torch.func import functional_call

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.config import StorageConfig, StoreMode
from moeflow.storage.home import HomeLayer, disk_key, expert_tensors, home_layers
from moeflow.storage.loads import DiskBlock, Loads, add_note
from moeflow.storage.stats import StorageStats
from moeflow.storage.disk import DiskFile
from moeflow.storage.tiers import CopyEngine

__all__ = ["ExpertStore"]

class ExpertStore(Loads, ABC):
    """Holds the expert weights of ``experts`` (one ``GroupedExperts`` per MoE layer, in
    execution order) in the home tier of ``config`` and serves them from the fast tier, laid
    out as ``config.mode`` says (``ExpertStore(...)`` returns a ``RingStreamer`` or an
    ``ExpertCache``).

    The store copies the weights out; the modules are left untouched (``offload_experts``
    swaps them for ``StoredExperts`` and drops them). Call ``close()`` (or use ``with``) to stop
    the copy thread and remove a temporary disk directory.
    """

    mode: ClassVar[StoreMode]
    _layouts: ClassVar[dict[str, type[ExpertStore]]] = {}  # mode -> the layout class serving it

    def __init_subclass__(cls, *, mode: StoreMode, **kwargs: object) -> None:
        """A layout names its mode in its class statement: ``class RingStreamer(ExpertStore,
        mode="ring")``."""
        super().__init_subclass__(**kwargs)
        cls.mode = mode
        ExpertStore._layouts[mode] = cls

    def __new__(cls, experts: Sequence[GroupedExperts], config: StorageConfig) -> ExpertStore:
        """``ExpertStore(...)`` builds the layout class of ``config.mode``: the mode picks the
        class here, once. A layout class built directly must be the one of ``config.mode``."""
        if not isinstance(config, StorageConfig):
            raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
        if cls is ExpertStore:
            cls = ExpertStore._layouts[config.mode]
        elif config.mode != cls.mode:
            raise ValueError(f"{cls.__name__} is the mode={cls.mode!r} store, got config.mode={config.mode!r}")
        return super().__new__(cls)

    def __init__(self, experts: Sequence[GroupedExperts], config: StorageConfig) -> None:
        experts = list(experts)
        if not experts:
            raise ValueError("experts must hold at least one GroupedExperts module, got none")
        for i, m in enumerate(experts):
            if not isinstance(m, GroupedExperts):
                raise TypeError(f"experts[{i}] must be a GroupedExperts (3-D expert weights), got {type(m).__name__}")
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={config.device!r} but CUDA is not available")
        # the budget first: a store that cannot fit writes nothing (no file, no directory)
        self._plan_slots(experts)
        self.stats = StorageStats()
        self.disk: DiskFile | None = None
        self.engine: CopyEngine | None = None
        self.layers: list[HomeLayer] = []
        self.num_layers = 0
        self._tmpdir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self._loading: dict[int, Future] = {}  # slot -> its load in flight
        self._orphans: list[Future] = []  # loads nobody waits for any more (their slot was reclaimed)
        try:
            named = expert_tensors(experts)
            if config.offload == "disk":
                flat = {disk_key(i, n): t for i, d in enumerate(named) for n, t in d.items()}
                # a file of its own: stores sharing ``directory`` must not overwrite each other's map
                self.disk = DiskFile.create(self._disk_directory(), "experts-", flat, verify=config.verify_checksums,
                                            direct=config.disk_reads == "direct")
            self.layers = home_layers(experts, named, self.disk, self.device)
            self.num_layers = len(self.layers)
            self.engine = CopyEngine(self.device)
            self._allocate_slots()
        except BaseException:
            self.close(check=False)
            raise

    # ------------------------------------------------------------------ the layout's part

    @abstractmethod
    def _plan_slots(self, experts: list[GroupedExperts]) -> None:
        """Size the slots from ``config.fast_memory``; raise ``ValueError`` with the numbers if
        the budget cannot hold the layout. Runs before anything is allocated or written."""

    @abstractmethod
    def _allocate_slots(self) -> None:
        """Allocate the fast tier (counted with ``_count_fast``) and the layout's bookkeeping."""

    @abstractmethod
    def _forget_slot(self, slot: int) -> None:
        """Slot ``slot``'s load failed: drop what it was to hold, so it is loaded again when
        next asked for (nothing computes on a half-loaded slot)."""

    @abstractmethod
    def _forget_all(self) -> None:
        """Every slot empty (the home weights changed)."""

    @abstractmethod
    def run(self, layer: int, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """``expert_out`` of layer ``layer`` (the experts protocol), fetching its weights."""

    # ------------------------------------------------------------------ home tier

    def _disk_directory(self) -> Path:
        """``config.directory`` (created if missing), else a temporary directory of this store,
        removed by ``close()``, or when the store is collected / at exit if never closed."""
        if self.config.directory is not None:
            directory = Path(self.config.directory)
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        self._tmpdir = tempfile.mkdtemp(prefix="moeflow-experts-")
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        return Path(self._tmpdir)

    def _disk_block(self, layer: int, name: str, expert: int | None = None) -> DiskBlock | None:
        """The disk block of layer ``layer``'s tensor ``name`` (its row ``expert`` if given);
        ``None`` when the home tier is host memory."""
        if self.disk is None:
            return None
        return disk_key(layer, name), expert

    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """A host copy of layer ``layer``'s current expert weights (name -> ``[E, ...]``); from
        the disk tier, read and checked (``DiskTierError`` if the file was damaged)."""
        with torch.no_grad():
            self._require_open()
            self._check_layer(layer)
            if self.disk is not None:
                return {n: self.disk.tensor(disk_key(layer, n)) for n in self.layers[layer].names}
            return {n: t.detach().to("cpu", copy=True) for n, t in self.layers[layer].home.items()}

    def set_layer_weights(self, layer: int, weights: dict[str, torch.Tensor]) -> None:
        """Write ``weights`` (name -> ``[E, ...]``, any device, the home tensors' shapes; a
        subset of the names is fine) into layer ``layer``'s home tier and forget every slot.

        Loads in flight are waited for first, so no read of the disk tier overlaps the write;
        a failed one (a damaged tier's block) is dropped with the slots: the weights it read
        are being replaced, and every later read is checked again."""
        with torch.no_grad():
            self._require_open()
            self._check_layer(layer)
            home = self.layers[layer].home
            for n, t in weights.items():
                if n not in home or tuple(t.shape) != tuple(home[n].shape):
                    raise ValueError(f"layer {layer} has no expert tensor {n!r} of shape "
                                     f"{tuple(home[n].shape) if n in home else '?'}, got {tuple(t.shape)}")
            try:
                self.invalidate()
            except OSError:
                pass
            for n, t in weights.items():
                src = t.detach().to("cpu", home[n].dtype).contiguous()
                if self.disk is not None:
                    self.disk.write(src, disk_key(layer, n))
                else:
                    home[n].copy_(src)
            if self.disk is not None and weights:
                self.disk.flush()  # durable, and its pages clean (evictable)

    def compute(self, layer: int, weights: dict[str, torch.Tensor], expert_in: torch.Tensor,
                counts_E: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s expert FFN with ``weights``: exactly ``GroupedExperts.forward``
        (the layer's stand-in module is called with these tensors as its parameters)."""
        return functional_call(self.layers[layer].template, weights, (expert_in, counts_E))

    # ------------------------------------------------------------------ accounting and lifetime

    def _count_fast(self, delta: int) -> None:
        s = self.stats
        s.fast_bytes += delta
        s.peak_fast_bytes = max(s.peak_fast_bytes, s.fast_bytes)

    def reset_stats(self) -> None:
        keep = self.stats.fast_bytes
        self.stats = StorageStats(fast_bytes=keep, peak_fast_bytes=keep)

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the ExpertStore is closed")

    def close(self, *, check: bool = True) -> None:
        """Stop the copy thread, unmap and remove the disk tier's file (and the temporary
        directory the store made). Raises ``RuntimeError`` (``... nobody waited for it``, the
        load's error as its cause) for the first failed load that was never reported (a
        prefetch whose slot was reclaimed, a load in flight), after closing everything: a
        failure nobody saw is not lost. A failure already raised to a caller (with the others
        it carried as notes, see ``_settle``) is not raised again. ``check=False`` drops
        them (a store that failed while being built)."""
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            self._drain(self._in_flight())
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the cleanup
            error = err
        self._orphans.clear()
        self._loading.clear()
        if self.engine is not None:
            self.engine.close()
        for layer in self.layers:
            layer.home = {}
        if self.disk is not None:
            if self._tmpdir is None:  # the store's own file in the user's directory (if still there)
                self.disk.remove()
            else:
                self.disk.close()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            if self._finalizer is not None:
                self._finalizer.detach()
        if error is not None and check:
            raise RuntimeError(f"a load of the ExpertStore failed and nobody waited for it: {error}") from error

    def __enter__(self) -> ExpertStore:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        # leaving on an error (a damaged disk tier, say): that error is the one to see, not a
        # prefetch that failed the same way behind it, which goes with it as a note instead
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except RuntimeError as unseen:
            add_note(exc, f"closing the ExpertStore: {unseen}")
