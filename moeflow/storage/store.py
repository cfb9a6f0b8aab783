"""``ExpertStore``: each MoE layer's expert weights in a home tier, streamed into a fast tier.

Legend: moeflow.types (``E`` experts, ``C`` capacity, ``R`` routed rows, ``D`` model dim).
``L`` is the number of MoE layers registered in the store, ``S`` the number of fast-tier slots,
``c`` the experts of one cache chunk.

Two fast-tier layouts (``StorageConfig.mode``):

- ring: ``S`` slots of one layer's experts each. ``acquire(l)`` returns layer ``l``'s weights
  in a slot (waiting for its load if it is still in flight: the stall), then starts the loads of
  the next ``prefetch`` layers of the execution order into other slots, so they arrive while
  layer ``l`` computes. A slot keeps its layer after ``release`` until it is reclaimed (least
  recently used first), so a model whose layers all fit is loaded once.
- cache: an LRU cache of single experts; ``acquire_experts(l, ids)`` loads only the experts
  the router selected, and prefetches for layer ``l + 1`` the experts it selected on the
  previous call (decoding repeats its choices often), while layer ``l`` computes.

The fast tier's bytes are counted in the store (``stats.fast_bytes``, ``stats.peak_fast_bytes``):
slot buffers, transient gradients and the cache's gather workspace.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.config import StorageConfig, format_bytes
from moeflow.storage.tiers import PAGE, CopyEngine, DiskFile, aligned_empty, pin, tensor_bytes

__all__ = ["ExpertStore", "StorageStats", "StoredExperts", "offload_experts", "slot_bytes"]

_ALIGN = PAGE  # bytes: tensors carved out of a slot start on this boundary (O_DIRECT reads)


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


@dataclass
class _Layer:
    """One MoE layer's experts in the home tier."""

    names: tuple[str, ...]
    home: dict[str, torch.Tensor]  # host tensors (pinned on CUDA) or DiskFile views, [E, ...]
    template: GroupedExperts  # the math, not the data: see _template
    num_experts: int
    nbytes: int  # slot bytes of the whole layer (each tensor padded to _ALIGN)
    expert_nbytes: int  # bytes of one expert (all tensors)


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _template(module: GroupedExperts) -> GroupedExperts:
    """A stand-in ``GroupedExperts`` with ``module``'s config and ``dim`` but one expert of
    hidden width 1: ``compute`` always calls it through ``functional_call`` with the real
    weights in place of its parameters, and its forward reads nothing else from itself but
    ``config`` and ``dim``. Tiny host tensors; built without touching the meta device (whose
    ``normal_`` imports the compiler stack, seconds on first use)."""
    dtype = next(module.parameters()).dtype
    return GroupedExperts(num_experts=1, dim=module.dim, hidden=1, config=module.config, dtype=dtype)


def slot_bytes(experts: GroupedExperts, *, single: bool = False) -> int:
    """Fast-tier bytes one layer's experts take in a ring slot (``single``: one expert in a
    cache slot): each tensor rounded up to a 4096-byte page. Size budgets with it, e.g.
    ``fast_memory = 2 * slot_bytes(layer.experts)`` for a two-slot ring."""
    n = experts.num_experts
    return sum(_padded(p.numel() * p.element_size() // (n if single else 1)) for p in experts.parameters())


class ExpertStore:
    """Holds the expert weights of ``experts`` (one ``GroupedExperts`` per MoE layer, in
    execution order) in the home tier of ``config`` and serves them from the fast tier.

    The store copies the weights out; the modules are left untouched (``offload_experts``
    swaps them for ``StoredExperts`` and drops them). Call ``close()`` (or use ``with``) to stop
    the copy thread and remove a temporary disk directory.
    """

    def __init__(self, experts: Sequence[GroupedExperts], config: StorageConfig) -> None:
        if not isinstance(config, StorageConfig):
            raise TypeError(f"config must be a StorageConfig, got {type(config).__name__}")
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
        if config.mode == "ring":
            self._ring_layout(experts)
        else:
            self._cache_layout(experts)
        self.stats = StorageStats()
        self._tmpdir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self.disk: DiskFile | None = None
        self.engine: CopyEngine | None = None
        self._closed = False
        self._orphans: list[Future] = []  # loads nobody waits for any more (their slot was reclaimed)
        self.layers: list[_Layer] = []
        self.num_layers = 0
        try:
            self._setup(experts)
        except BaseException:
            self.close(check=False)
            raise

    def _setup(self, experts: list[GroupedExperts]) -> None:
        config = self.config
        self.layers = self._place(experts)
        self.num_layers = len(self.layers)
        self.engine = CopyEngine(self.device)
        # an input of _RingFFN that requires grad, so autograd records the expert FFN (and its
        # weights get gradients) even when the experts' input does not require grad
        self._anchor = torch.empty(0, requires_grad=True)
        # gradients (trainable): host accumulators, whether each was written this step
        self.grads: list[dict[str, torch.Tensor]] | None = None
        self.has_grad = [False] * self.num_layers
        self._grad_job: tuple[Future, int] | None = None
        # called with the layer index after its gradients were handed over (the optimizer uses
        # it to start streaming that layer's state in: prefetch across kinds of state)
        self.on_grads: Callable[[int], None] | None = None
        if config.trainable:
            self.grads = [{n: pin(torch.zeros_like(t, device="cpu"), self.device) for n, t in layer.home.items()}
                          for layer in self.layers]
        if config.mode == "ring":
            self._init_ring()
        else:
            self._init_cache()

    # ------------------------------------------------------------------ placement

    def _place(self, experts: list[GroupedExperts]) -> list[_Layer]:
        cfg = self.config
        named = [{n: p.detach() for n, p in m.named_parameters()} for m in experts]
        dtypes = {t.dtype for d in named for t in d.values()}
        if len(dtypes) != 1:
            raise ValueError(f"all expert weights must share one dtype, got {sorted(map(str, dtypes))}")
        if cfg.offload == "disk":
            if cfg.directory is None:
                self._tmpdir = tempfile.mkdtemp(prefix="moeflow-experts-")
                # removed by close(), or when the store is collected / at exit if never closed
                self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
                directory = Path(self._tmpdir)
            else:
                directory = Path(cfg.directory)
                directory.mkdir(parents=True, exist_ok=True)
            flat = {f"layers.{i}.{n}": t for i, d in enumerate(named) for n, t in d.items()}
            # a file of its own: stores sharing ``directory`` must not overwrite each other's map
            self.disk = DiskFile.create(directory, "experts-", flat)
        layers = []
        for i, (module, tensors) in enumerate(zip(experts, named)):
            if self.disk is not None:
                home = {n: self.disk[f"layers.{i}.{n}"] for n in tensors}
            else:
                home = {n: pin(t, self.device) for n, t in tensors.items()}
            template = _template(module)
            nbytes = sum(_padded(tensor_bytes(t)) for t in tensors.values())
            expert_nbytes = sum(tensor_bytes(t) // module.num_experts for t in tensors.values())
            layers.append(_Layer(tuple(tensors), home, template, module.num_experts, nbytes, expert_nbytes))
        return layers

    def _count_fast(self, delta: int) -> None:
        s = self.stats
        s.fast_bytes += delta
        s.peak_fast_bytes = max(s.peak_fast_bytes, s.fast_bytes)

    def _alloc(self, nbytes: int, *, host: bool = False) -> torch.Tensor:
        device = torch.device("cpu") if host else self.device
        return aligned_empty(nbytes, device=device, pin_memory=host and self.device.type == "cuda")

    def _carve(self, buffer: torch.Tensor, layer: int, index: int | None = None) -> dict[str, torch.Tensor]:
        """Views of ``buffer`` shaped like layer ``layer``'s tensors (their ``[index]`` row if
        given), each starting on a page boundary."""
        out, offset = {}, 0
        for name, t in self.layers[layer].home.items():
            shape = t.shape if index is None else t.shape[1:]
            n = math.prod(shape) * t.element_size()
            out[name] = buffer[offset : offset + n].view(t.dtype).view(shape)
            offset += _padded(n)
        return out

    # ------------------------------------------------------------------ copies

    def _copy_job(self, pairs: list[tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]],
                  staging: torch.Tensor | None, after: torch.cuda.Event | None):
        """A job for the copy engine: ``dst.copy_(src)`` for each ``(dst, src, disk range)``.

        On CUDA the device copies wait for ``after`` (the consumer released the destination),
        read disk sources through the pinned ``staging`` buffer, and the job returns the event
        that marks them done. On CPU every copy is done when the job returns.
        """
        disk = self.disk
        evict = disk is not None and self.config.evict_page_cache

        def job(stream: torch.cuda.Stream | None):
            if stream is not None and after is not None:
                stream.wait_event(after)
            offset = 0
            for dst, src, disk_range in pairs:
                if disk_range is None:  # host -> fast
                    dst.copy_(src, non_blocking=stream is not None)
                    continue
                if stream is None:  # disk -> host memory (the CPU fast tier) directly
                    disk.read_into(dst, *disk_range)
                else:  # disk -> pinned staging (this thread) -> device (copy stream)
                    n = tensor_bytes(dst)
                    stage = staging[offset : offset + n].view(dst.dtype).view(dst.shape)
                    offset += _padded(n)
                    disk.read_into(stage, *disk_range)
                    dst.copy_(stage, non_blocking=True)
                if evict:
                    disk.evict(*disk_range)
            if stream is None:
                return None
            done = torch.cuda.Event()
            done.record(stream)
            if staging is not None:
                done.synchronize()  # the next job into this slot reuses the staging buffer
            return done

        return job

    def _wait(self, future: Future) -> None:
        self.stats.stall_s += self.engine.wait(future)

    def _release_event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    # ------------------------------------------------------------------ ring

    def _ring_layout(self, experts: list[GroupedExperts]) -> None:
        """Slot size and count from the budget (raises before anything is allocated or written)."""
        cfg = self.config
        num_layers = len(experts)
        size = max(slot_bytes(m) for m in experts)
        reserve = size if cfg.trainable else 0
        fits = max(0, (cfg.fast_memory - reserve) // size)
        slots = cfg.ring_slots if cfg.ring_slots is not None else min(fits, num_layers)
        what = " plus one layer's gradients (trainable)" if cfg.trainable else ""
        if slots < 1 or slots > fits:
            raise ValueError(
                f"fast_memory={format_bytes(cfg.fast_memory)} holds {fits} ring slot(s) of one layer's experts "
                f"({format_bytes(size)} each){what}, but {max(slots, 1)} are needed; raise fast_memory or use "
                "mode='cache' (single experts)"
            )
        if cfg.prefetch > slots - 1 and slots < num_layers:  # (every layer resident: nothing to prefetch)
            raise ValueError(
                f"prefetch={cfg.prefetch} needs {cfg.prefetch + 1} ring slots but fast_memory="
                f"{format_bytes(cfg.fast_memory)} holds {slots} of {format_bytes(size)}; lower prefetch "
                "or raise fast_memory"
            )
        self.slot_bytes = size
        self.num_slots = slots

    def _init_ring(self) -> None:
        slot_bytes, slots = self.slot_bytes, self.num_slots
        self._slots = [self._alloc(slot_bytes) for _ in range(slots)]
        self._count_fast(slots * slot_bytes)
        cuda_disk = self.device.type == "cuda" and self.disk is not None
        self._staging = [self._alloc(slot_bytes, host=True) if cuda_disk else None for _ in range(slots)]
        self._slot_layer: list[int | None] = [None] * slots
        self._slot_future: list[Future | None] = [None] * slots
        self._slot_busy = [False] * slots
        self._slot_used = [0] * slots  # LRU clock
        self._slot_release: list[torch.cuda.Event | None] = [None] * slots
        self._layer_slot: dict[int, int] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._clock = 0

    def _check_layer(self, layer: int) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _claim_slot(self, protected: set[int]) -> int | None:
        """A slot to load into: an empty one, else the least recently used one that is not in
        use and does not hold a protected layer; ``None`` if there is none."""
        best = None
        for s in range(self.num_slots):
            if self._slot_busy[s]:
                continue
            if self._slot_layer[s] is None:
                return s
            if self._slot_layer[s] in protected:
                continue
            if best is None or self._slot_used[s] < self._slot_used[best]:
                best = s
        return best

    def _retire(self, future: Future | None) -> None:
        """A load nobody will wait for (its slot was reclaimed or forgotten): kept so that its
        failure is not lost (``close`` raises it)."""
        if future is not None:
            self._orphans.append(future)
            self._orphans = [f for f in self._orphans if not (f.done() and f.exception() is None)]

    def _load_layer(self, layer: int, slot: int, *, prefetch: bool) -> None:
        old = self._slot_layer[slot]
        if old is not None:
            del self._layer_slot[old]
            del self._views[old]
        self._retire(self._slot_future[slot])
        self._slot_future[slot] = None
        views = self._carve(self._slots[slot], layer)
        home = self.layers[layer].home
        ranges = {n: self.disk.byte_range(f"layers.{layer}.{n}") for n in home} if self.disk is not None else {}
        pairs = [(views[n], home[n], ranges.get(n)) for n in home]
        job = self._copy_job(pairs, self._staging[slot], self._slot_release[slot])
        self._slot_future[slot] = self.engine.submit(job)
        self._slot_layer[slot], self._layer_slot[layer], self._views[layer] = layer, slot, views
        nbytes = sum(tensor_bytes(t) for t in home.values())
        s = self.stats
        s.loads += 1
        s.prefetch_loads += prefetch
        s.bytes_loaded += nbytes
        s.bytes_from_disk += nbytes if self.disk is not None else 0

    def _upcoming(self, layer: int, direction: int) -> list[int]:
        """The next ``prefetch`` layers of the execution order after ``layer``: forward wraps
        around to layer 0 (the next call) at inference; in training the forward's last layer
        is followed by the backward (which starts on the resident last layer), and the
        backward by the optimizer step (which changes the weights), so neither wraps."""
        out = []
        for i in range(1, self.config.prefetch + 1):
            j = layer + direction * i
            if self.config.trainable or direction < 0:
                if not 0 <= j < self.num_layers:
                    break
            else:
                j %= self.num_layers
            if j == layer:
                break
            out.append(j)
        return out

    def acquire(self, layer: int, *, direction: int = 1) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s expert weights in the fast tier (name -> ``[E, ...]`` view of a
        slot), valid until ``release(layer)``; starts the prefetch of the layers that follow
        in ``direction`` (+1 forward, -1 backward). Ring mode only."""
        if self.config.mode != "ring":
            raise RuntimeError(f"acquire() is the ring mode's; this store has mode={self.config.mode!r}")
        self._check_layer(layer)
        self._require_open()
        upcoming = self._upcoming(layer, direction)
        slot = self._layer_slot.get(layer)
        if slot is not None:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            slot = self._claim_slot(protected={layer})
            if slot is None:
                raise RuntimeError(f"no free ring slot for layer {layer}: all {self.num_slots} slots are in use")
            self._load_layer(layer, slot, prefetch=False)
        self._slot_busy[slot] = True
        # start the look-ahead loads before waiting, so they queue behind this one
        protected = {layer, *upcoming}
        for j in upcoming:
            if j in self._layer_slot:
                self._clock += 1
                self._slot_used[self._layer_slot[j]] = self._clock  # keep it from being reclaimed
                continue
            free = self._claim_slot(protected)
            if free is None:
                break
            self._load_layer(j, free, prefetch=True)
        future = self._slot_future[slot]
        if future is not None:
            try:
                self._wait(future)
            except BaseException:
                # the slot holds garbage: forget its layer so the next acquire loads it again
                self._slot_future[slot] = None
                self._slot_busy[slot] = False
                self._slot_layer[slot] = None
                self._layer_slot.pop(layer, None)
                self._views.pop(layer, None)
                raise
            self._slot_future[slot] = None
        return self._views[layer]

    def release(self, layer: int) -> None:
        """Done computing with layer ``layer``'s slot (its data stays until reclaimed)."""
        slot = self._layer_slot.get(layer)
        if slot is None or not self._slot_busy[slot]:
            raise RuntimeError(f"release({layer}) without a matching acquire({layer})")
        self._slot_busy[slot] = False
        self._clock += 1
        self._slot_used[slot] = self._clock
        self._slot_release[slot] = self._release_event()

    def invalidate(self) -> None:
        """Forget every slot's contents (the home weights changed, e.g. after an optimizer
        step); waits for loads in flight (on CUDA, on the host too: their copies are done when
        it returns) and raises the first of their errors, after forgetting every slot."""
        if self.config.mode == "ring":
            if any(self._slot_busy):
                raise RuntimeError("invalidate() while a layer's slot is in use")
            pending = [f for f in self._slot_future if f is not None]
            self._slot_future = [None] * self.num_slots
            self._slot_layer = [None] * self.num_slots
            self._layer_slot.clear()
            self._views.clear()
        else:
            pending = list(self._cache_future.values())
            self._cache_future.clear()
            self._cache.clear()
            self._prefetched.clear()
            self._free = list(range(self.cache_slots))
        self._drain(pending)

    def _drain(self, futures: list[Future]) -> None:
        """Wait for ``futures`` (host and, on CUDA, device side) and raise the first error."""
        error: BaseException | None = None
        for future in futures:
            try:
                result = future.result()
                if isinstance(result, torch.cuda.Event):
                    result.synchronize()
            except BaseException as err:  # noqa: BLE001 - re-raised below
                error = error or err
        if error is not None:
            raise error

    # ------------------------------------------------------------------ gradients (trainable)

    def accumulate_grads(self, layer: int, grads: dict[str, torch.Tensor]) -> None:
        """Add ``grads`` (fast-tier tensors shaped like the layer's weights) into the layer's
        host accumulators, asynchronously. At most one layer's gradients are in flight: the
        previous transfer is waited for first, so the fast tier holds one layer's gradients."""
        if self.grads is None:
            raise RuntimeError("accumulate_grads() needs StorageConfig(trainable=True)")
        self.wait_grads()
        acc = self.grads[layer]
        fresh = not self.has_grad[layer]
        self.has_grad[layer] = True
        nbytes = sum(tensor_bytes(g) for g in grads.values())
        self._count_fast(nbytes)
        ready = self._release_event()  # grads computed on the compute stream

        def job(stream: torch.cuda.Stream | None):
            if stream is not None and ready is not None:
                stream.wait_event(ready)
            for name, g in grads.items():
                host = g.to("cpu", non_blocking=False) if g.device.type != "cpu" else g
                if fresh:  # as autograd does for a leaf's first gradient: take it, don't add to 0
                    acc[name].copy_(host)
                else:
                    acc[name].add_(host)
            return None

        self._grad_job = (self.engine.submit(job), nbytes)
        self.stats.bytes_written_back += nbytes
        if self.on_grads is not None:
            self.on_grads(layer)

    def wait_grads(self) -> None:
        """Wait for the gradient transfer in flight (if any) and free its fast-tier bytes."""
        if self._grad_job is not None:
            future, nbytes = self._grad_job
            self._grad_job = None  # a failed transfer is raised once, not on every later call
            self._count_fast(-nbytes)
            self._wait(future)

    def zero_grads(self) -> None:
        """Start a new accumulation (the next gradient overwrites the accumulator)."""
        self.wait_grads()
        self.has_grad = [False] * self.num_layers

    # ------------------------------------------------------------------ cache

    def _cache_layout(self, experts: list[GroupedExperts]) -> None:
        """Cache slot size and count from the budget (raises before anything is written)."""
        def shapes(m: GroupedExperts) -> dict:
            return {n: (p.shape, p.dtype) for n, p in m.named_parameters()}

        for i, m in enumerate(experts):
            if shapes(m) != shapes(experts[0]):
                raise ValueError(f"mode='cache' needs every layer's experts shaped alike; layer {i} differs from layer 0")
        per_expert = slot_bytes(experts[0], single=True)
        slots = self.config.fast_memory // per_expert
        if slots < 1:
            raise ValueError(
                f"fast_memory={format_bytes(self.config.fast_memory)} holds no expert ({format_bytes(per_expert)} each)"
            )
        self.cache_slots = slots
        self.expert_slot_bytes = per_expert

    def _init_cache(self) -> None:
        first = self.layers[0]
        slots, per_expert = self.cache_slots, self.expert_slot_bytes
        self._slab = {  # name -> [slots, ...]: row s of every tensor is slot s
            n: aligned_empty(slots * tensor_bytes(t[0]), device=self.device).view(t.dtype).view(slots, *t.shape[1:])
            for n, t in first.home.items()
        }
        self._count_fast(sum(tensor_bytes(t) for t in self._slab.values()))
        cuda_disk = self.device.type == "cuda" and self.disk is not None  # disk -> pinned staging -> GPU
        self._cache_staging = [self._alloc(per_expert, host=True) if cuda_disk else None for _ in range(slots)]
        self._cache: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, LRU first
        self._cache_future: dict[int, Future] = {}
        self._prefetched: set[tuple[int, int]] = set()
        self._free = list(range(slots))
        self._last_selected: dict[int, list[int]] = {}
        self._gather_done: torch.cuda.Event | None = None
        self.prefetch_hits = 0

    def _cache_claim(self, protected: set[tuple[int, int]]) -> int | None:
        if self._free:
            return self._free.pop()
        for key in self._cache:  # least recently used first
            if key not in protected:
                slot = self._cache.pop(key)
                self._prefetched.discard(key)
                self._retire(self._cache_future.pop(slot, None))
                return slot
        return None

    def _cache_forget(self, slot: int) -> None:
        """Slot ``slot``'s load failed: drop the expert it was to hold and free the slot."""
        self._cache_future.pop(slot, None)
        for key, s in list(self._cache.items()):
            if s == slot:
                del self._cache[key]
                self._prefetched.discard(key)
        if slot not in self._free:
            self._free.append(slot)

    def _cache_load(self, layer: int, expert: int, slot: int, *, prefetch: bool) -> None:
        home = self.layers[layer].home
        pairs = []
        for n, t in home.items():
            rng = self.disk.byte_range(f"layers.{layer}.{n}", expert) if self.disk is not None else None
            pairs.append((self._slab[n][slot], t[expert], rng))
        job = self._copy_job(pairs, self._cache_staging[slot], self._gather_done)
        self._cache_future[slot] = self.engine.submit(job)
        self._cache[(layer, expert)] = slot
        nbytes = self.layers[layer].expert_nbytes
        s = self.stats
        s.loads += 1
        s.prefetch_loads += prefetch
        s.bytes_loaded += nbytes
        s.bytes_from_disk += nbytes if self.disk is not None else 0
        if prefetch:
            self._prefetched.add((layer, expert))

    def acquire_experts(self, layer: int, experts: Sequence[int], *, prefetch: bool = True) -> dict[str, torch.Tensor]:
        """The weights of ``experts`` of layer ``layer`` gathered into one workspace (name ->
        ``[len(experts), ...]``, in the order given), loading only the ones not cached; then
        (``prefetch``) remembers them as this layer's choice and starts prefetching, for the
        next layers, the experts they chose on their previous call. Release the workspace with
        ``release_workspace``. Cache mode only."""
        if self.config.mode != "cache":
            raise RuntimeError(f"acquire_experts() is the cache mode's; this store has mode={self.config.mode!r}")
        self._check_layer(layer)
        self._require_open()
        experts = list(experts)
        if len(experts) > self.cache_slots:
            raise RuntimeError(
                f"layer {layer} selected {len(experts)} experts but the cache holds {self.cache_slots} "
                f"(fast_memory={format_bytes(self.config.fast_memory)}); raise fast_memory or use mode='ring'"
            )
        wanted = {(layer, e) for e in experts}
        slots = []
        for e in experts:
            key = (layer, e)
            if key in self._cache:
                self.stats.hits += 1
                if key in self._prefetched:
                    self.prefetch_hits += 1
                    self._prefetched.discard(key)
                self._cache.move_to_end(key)
            else:
                self.stats.misses += 1
                slot = self._cache_claim(wanted)
                if slot is None:
                    raise RuntimeError(f"no evictable cache slot for layer {layer} expert {e}")
                self._cache_load(layer, e, slot, prefetch=False)
            slots.append(self._cache[key])
        for slot in slots:
            future = self._cache_future.get(slot)
            if future is not None:
                try:
                    self._wait(future)
                except BaseException:
                    self._cache_forget(slot)  # no garbage expert left in the cache
                    raise
                self._cache_future.pop(slot, None)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        workspace = {n: slab.index_select(0, index) for n, slab in self._slab.items()}
        self._gather_done = self._release_event()
        self._count_fast(sum(tensor_bytes(t) for t in workspace.values()))
        # routing-aware prefetch: the next layer's previous choice, loaded while this one computes
        if prefetch:
            self._last_selected[layer] = experts
            for step in range(1, self.config.prefetch + 1):
                nxt = (layer + step) % self.num_layers
                predicted = self._last_selected.get(nxt, [])
                keep = {(nxt, e) for e in predicted}
                for e in predicted:
                    if (nxt, e) in self._cache:
                        continue
                    slot = self._cache_claim(keep)
                    if slot is None:
                        break
                    self._cache_load(nxt, e, slot, prefetch=True)
        return workspace

    def release_workspace(self, workspace: dict[str, torch.Tensor]) -> None:
        self._count_fast(-sum(tensor_bytes(t) for t in workspace.values()))

    # ------------------------------------------------------------------ compute

    def compute(self, layer: int, weights: dict[str, torch.Tensor], expert_in: torch.Tensor,
                counts_E: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s expert FFN with ``weights``: exactly ``GroupedExperts.forward``
        (the layer's stand-in module is called with these tensors as its parameters)."""
        return functional_call(self.layers[layer].template, weights, (expert_in, counts_E))

    def run(self, layer: int, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """``expert_out`` of layer ``layer`` (the experts protocol), fetching its weights."""
        self._check_layer(layer)
        if torch.is_grad_enabled() and (expert_in.requires_grad or self.config.trainable):
            if self.config.mode != "ring":
                raise RuntimeError("mode='cache' is inference-only: run under torch.no_grad() or use mode='ring'")
            # the anchor requires grad: autograd records the FFN even when expert_in does not
            # (frozen embeddings and attention), so the expert weights still get gradients
            return _RingFFN.apply(expert_in, counts_E, self, layer, self._anchor)
        if self.config.mode == "ring":
            weights = self.acquire(layer)
            try:
                return self.compute(layer, weights, expert_in, counts_E)
            finally:
                self.release(layer)
        return self._run_cached(layer, expert_in, counts_E)

    def _run_cached(self, layer: int, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Only the routed experts run, in chunks of at most ``cache_slots`` experts (a prefill
        may select more experts than the cache holds); per-expert results do not depend on
        which other experts share the call, so the output equals the all-experts one."""
        counts = counts_E.tolist()
        selected = [e for e, n in enumerate(counts) if n > 0]
        dim = self.layers[layer].template.dim
        if not selected:
            return expert_in.new_zeros(*expert_in.shape[:-1], dim)
        chunks = [selected[i : i + self.cache_slots] for i in range(0, len(selected), self.cache_slots)]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        out_ECD = expert_in.new_zeros(*expert_in.shape[:-1], dim) if expert_in.dim() == 3 else None
        pieces_RD = []
        for i, chunk in enumerate(chunks):
            weights = self.acquire_experts(layer, chunk, prefetch=i == len(chunks) - 1)
            try:
                chunk_c = torch.tensor(chunk, device=expert_in.device)
                counts_c = counts_E.index_select(0, chunk_c)
                if out_ECD is not None:  # [E, C, D]: the chunk's expert slices
                    out_ECD[chunk_c] = self.compute(layer, weights, expert_in.index_select(0, chunk_c), counts_c)
                else:  # [R, D]: the chunk's rows are contiguous (rows are grouped by expert)
                    rows_RD = expert_in[starts[chunk[0]] : starts[chunk[-1] + 1]]
                    pieces_RD.append(self.compute(layer, weights, rows_RD, counts_c))
            finally:
                self.release_workspace(weights)
        self._last_selected[layer] = selected
        if out_ECD is not None:
            return out_ECD
        return pieces_RD[0] if len(pieces_RD) == 1 else torch.cat(pieces_RD)

    # ------------------------------------------------------------------ access and lifetime

    @torch.no_grad()
    def layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """A host copy of layer ``layer``'s current expert weights (name -> ``[E, ...]``)."""
        self._require_open()
        self._check_layer(layer)
        return {n: t.detach().to("cpu", copy=True) for n, t in self.layers[layer].home.items()}

    def reset_stats(self) -> None:
        keep = self.stats.fast_bytes
        self.stats = StorageStats(fast_bytes=keep, peak_fast_bytes=keep)
        if self.config.mode == "cache":
            self.prefetch_hits = 0

    def _require_open(self) -> None:
        if self._closed:
            raise RuntimeError("the ExpertStore is closed")

    def close(self, *, check: bool = True) -> None:
        """Stop the copy thread, unmap and remove the disk tier's file (and the temporary
        directory the store made). Raises the first error of a load that nobody waited for
        (a prefetch whose slot was reclaimed, a load in flight), after closing everything."""
        if self._closed:
            return
        self._closed = True
        pending = list(self._orphans)
        pending += [f for f in getattr(self, "_slot_future", []) if f is not None]
        pending += list(getattr(self, "_cache_future", {}).values())
        if getattr(self, "_grad_job", None) is not None:
            pending.append(self._grad_job[0])
        error: BaseException | None = None
        try:
            self._drain(pending)
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the cleanup
            error = err
        self._orphans.clear()
        if self.engine is not None:
            self.engine.close()
        for layer in self.layers:  # views of the mapping: unusable once it is closed
            layer.home = {}
        for name in ("_views", "_slot_future"):
            if isinstance(getattr(self, name, None), (dict, list)):
                getattr(self, name).clear()
        if self.disk is not None:
            self.disk.close()
            if self._tmpdir is None:  # the store's own file in the user's directory
                Path(self.disk.path).unlink(missing_ok=True)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            if self._finalizer is not None:
                self._finalizer.detach()
        if error is not None and check:
            raise RuntimeError(f"a load of the ExpertStore failed and nobody waited for it: {error}") from error

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RingFFN(torch.autograd.Function):
    """Layer ``l``'s expert FFN for training with offloaded weights.

    Forward fetches the weights, computes without recording a graph and releases the slot, so
    the slot can take the next layer. Backward fetches them again (the store prefetches in
    reverse layer order), recomputes the FFN with a graph and differentiates it: the same
    operations on the same values as the in-memory layer, hence the same gradients. Weight
    gradients go to the store's host accumulators; the input gradient flows on.
    """

    @staticmethod
    def forward(ctx, expert_in, counts_E, store: ExpertStore, layer: int, anchor=None):  # type: ignore[override]
        weights = store.acquire(layer, direction=1)
        try:
            with torch.no_grad():
                out = store.compute(layer, weights, expert_in, counts_E)
        finally:
            store.release(layer)
        ctx.save_for_backward(expert_in, counts_E)
        ctx.store, ctx.layer = store, layer
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        expert_in, counts_E = ctx.saved_tensors
        store, layer = ctx.store, ctx.layer
        store.wait_grads()  # at most one layer's gradients in the fast tier
        weights = store.acquire(layer, direction=-1)
        try:
            leaves = {n: w.detach().requires_grad_(store.grads is not None) for n, w in weights.items()}
            with torch.enable_grad():
                x = expert_in.detach().requires_grad_(True)
                out = store.compute(layer, leaves, x, counts_E)
                inputs = [x, *leaves.values()] if store.grads is not None else [x]
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True, materialize_grads=True)
        finally:
            store.release(layer)
        if store.grads is not None:
            store.accumulate_grads(layer, dict(zip(leaves, grads[1:])))
        return (grads[0] if ctx.needs_input_grad[0] else None), None, None, None, None


_NO_COPY = ("a model with offloaded experts cannot be copied or pickled: its expert weights live in an "
            "ExpertStore; copy the model before offload_experts, or read store.layer_weights(i)")


class StoredExperts(nn.Module):
    """The experts protocol (``forward(expert_in, counts_E) -> expert_out``) over one layer of
    an ``ExpertStore``: it owns no parameters; each call fetches the layer's weights from the
    store (ring slot or cached experts) and runs exactly ``GroupedExperts``' math on them."""

    def __init__(self, store: ExpertStore, layer: int) -> None:
        super().__init__()
        if not isinstance(store, ExpertStore):
            raise TypeError(f"store must be an ExpertStore, got {type(store).__name__}")
        store._check_layer(layer)
        # a plain attribute (not a submodule): the store is shared by every layer
        object.__setattr__(self, "store", store)
        self.layer = layer
        self.num_experts = store.layers[layer].num_experts
        self.dim = store.layers[layer].template.dim

    def extra_repr(self) -> str:
        c = self.store.config
        return f"layer={self.layer}, num_experts={self.num_experts}, offload={c.offload}, mode={c.mode}"

    def forward(self, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.store.run(self.layer, expert_in, counts_E)

    # state_dict: the layer's expert weights under the in-memory names (``...experts.w_in``),
    # host copies read from the store, so a checkpoint of the offloaded model is complete and
    # equals the in-memory model's; loading one writes them into the store's home tier
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, t in self.store.layer_weights(self.layer).items():
            destination[prefix + name] = t

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,  # type: ignore[no-untyped-def]
                              unexpected_keys, error_msgs) -> None:
        store = self.store
        store._require_open()
        home = store.layers[self.layer].home
        loaded = False
        for name, dst in home.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            src = state_dict[key]
            if tuple(src.shape) != tuple(dst.shape):
                error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(src.shape)}, "
                                  f"the stored experts have shape {tuple(dst.shape)}")
                continue
            with torch.no_grad():
                dst.copy_(src.detach().to("cpu"))
            loaded = True
        if loaded:
            if store.disk is not None:
                store.disk.flush()  # written through the mapping: make it visible to O_DIRECT reads
            store.invalidate()

    # the store owns a copy thread and files: a copy would share (or fight over) them
    def __deepcopy__(self, memo: dict) -> "StoredExperts":
        raise TypeError(_NO_COPY)

    def __getstate__(self) -> dict:
        raise TypeError(_NO_COPY)


def offload_experts(model: nn.Module, config: StorageConfig) -> ExpertStore:
    """Move the routed experts of every MoE layer of ``model`` into a new ``ExpertStore``.

    Each module with a ``GroupedExperts`` child named ``experts`` (every ``moeflow.MoE`` with
    built-in experts), in ``model.modules()`` order (the execution order of ``MoEGPT``), gets a
    ``StoredExperts`` in its place; the original parameters are dropped from the model, so
    ``model.parameters()`` afterwards is the dense part only. Returns the store.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    owners = [m for m in model.modules() if isinstance(getattr(m, "experts", None), GroupedExperts)]
    if not owners:
        raise ValueError(f"model has no MoE layer with GroupedExperts experts: {type(model).__name__}")
    store = ExpertStore([m.experts for m in owners], config)
    for i, owner in enumerate(owners):
        owner.experts = StoredExperts(store, i)
    return store
