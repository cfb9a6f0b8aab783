"""``RingStreamer`` (``mode="ring"``): whole layers stream through a ring of fast-tier slots,
for inference and training.

Legend: moeflow.types (``E`` experts). ``L`` is the number of MoE layers in the store, ``S`` the
number of slots; a slot holds one layer's expert tensors ``[E, ...]``, each starting on a page.

``acquire(l)`` returns layer ``l``'s weights in a slot (waiting for its load if it is still in
flight: the stall), then starts the loads of the next ``prefetch`` layers of the execution order
into other slots, so they arrive while layer ``l`` computes. A slot keeps its layer after
``release`` until it is reclaimed (least recently used first), so a model whose layers all fit
is loaded once.

Training (``trainable=True``): the forward computes without a graph and gives the slot back;
the backward acquires the layer again (prefetching in reverse layer order), recomputes the FFN
and differentiates it (``_RingFFN``), and the weight gradients go to host accumulators
(``grads``) on the copy thread, one layer at a time in the fast tier — which is why the budget
reserves one slot's bytes for them. ``OffloadedAdamW`` steps the weights from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.base import ExpertStore
from moeflow.storage.config import StorageConfig, format_bytes
from moeflow.storage.home import padded, slot_bytes
from moeflow.storage.tiers import aligned_empty, pin, tensor_bytes

__all__ = ["RingStreamer"]


class RingStreamer(ExpertStore, mode="ring"):
    """The ring layout of an ``ExpertStore``: ``num_slots`` slots of ``slot_bytes`` each, one
    layer per slot; ``acquire``/``release`` a layer's weights, gradients into ``grads``.

    With ``trainable=True``, ``grads[l]`` (name -> ``[E, ...]`` host tensor) accumulates layer
    ``l``'s weight gradients like ``p.grad`` does, and ``has_grad[l]`` says whether it received
    one since ``zero_grads``; ``on_grads`` (if set) is called with ``l`` once its gradients
    were handed over (``OffloadedAdamW`` starts streaming that layer's state in then).
    """

    def __init__(self, experts: Sequence[GroupedExperts], config: StorageConfig) -> None:
        self._grad_job: tuple[Future, int] | None = None  # read by close(), even if construction fails
        super().__init__(experts, config)

    def _plan_slots(self, experts: list[GroupedExperts]) -> None:
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

    def _allocate_slots(self) -> None:
        size, slots = self.slot_bytes, self.num_slots
        self._slots = [aligned_empty(size, device=self.device) for _ in range(slots)]
        self._count_fast(slots * size)
        self._staging = self._staging_buffers(slots, size)
        self._slot_layer: list[int | None] = [None] * slots
        self._slot_busy = [False] * slots
        self._slot_used = [0] * slots  # LRU clock
        self._slot_release: list[torch.cuda.Event | None] = [None] * slots
        self._layer_slot: dict[int, int] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._clock = 0
        # training: an input of _RingFFN that requires grad, so autograd records the expert FFN
        # (and its weights get gradients) even when the experts' input does not require grad;
        # the gradient accumulators are host memory (the budget reserves one layer in flight)
        self._anchor = torch.empty(0, requires_grad=True)
        self.grads: list[dict[str, torch.Tensor]] | None = None
        if self.config.trainable:
            self.grads = [{n: pin(torch.zeros_like(t, device="cpu"), self.device) for n, t in layer.home.items()}
                          for layer in self.layers]
        self.has_grad = [False] * self.num_layers
        self.on_grads: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ slots

    def _carve(self, slot: int, layer: int) -> dict[str, torch.Tensor]:
        """Views of slot ``slot`` shaped like layer ``layer``'s tensors, each on a page boundary."""
        out, offset = {}, 0
        for name, t in self.layers[layer].home.items():
            n = tensor_bytes(t)
            out[name] = self._slots[slot][offset : offset + n].view(t.dtype).view(t.shape)
            offset += padded(n)
        return out

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

    def _load_layer(self, layer: int, slot: int, *, prefetch: bool) -> None:
        old = self._slot_layer[slot]
        if old is not None:
            del self._layer_slot[old]
            del self._views[old]
        views = self._carve(slot, layer)
        pairs = [(views[n], t, self._disk_block(layer, n)) for n, t in self.layers[layer].home.items()]
        self._start_load(slot, pairs, self._staging[slot], self._slot_release[slot], prefetch=prefetch)
        self._slot_layer[slot], self._layer_slot[layer], self._views[layer] = layer, slot, views

    def _forget_slot(self, slot: int) -> None:
        layer = self._slot_layer[slot]
        self._slot_busy[slot] = False
        self._slot_layer[slot] = None
        self._layer_slot.pop(layer, None)
        self._views.pop(layer, None)

    def _forget_all(self) -> None:
        self._slot_layer = [None] * self.num_slots
        self._layer_slot.clear()
        self._views.clear()

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
        in ``direction`` (+1 forward, -1 backward)."""
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
        self._await_load(slot)
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
        if any(self._slot_busy):
            raise RuntimeError("invalidate() while a layer's slot is in use")
        super().invalidate()

    def run(self, layer: int, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        self._check_layer(layer)
        if torch.is_grad_enabled() and (expert_in.requires_grad or self.config.trainable):
            # the anchor requires grad: autograd records the FFN even when expert_in does not
            # (frozen embeddings and attention), so the expert weights still get gradients
            return _RingFFN.apply(expert_in, counts_E, self, layer, self._anchor)
        weights = self.acquire(layer)
        try:
            return self.compute(layer, weights, expert_in, counts_E)
        finally:
            self.release(layer)

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

        def job(stream: torch.cuda.Stream | None) -> None:
            if stream is not None and ready is not None:
                stream.wait_event(ready)
            for name, g in grads.items():
                host = g.to("cpu", non_blocking=False) if g.device.type != "cpu" else g
                if fresh:  # as autograd does for a leaf's first gradient: take it, don't add to 0
                    acc[name].copy_(host)
                else:
                    acc[name].add_(host)

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

    def _in_flight(self) -> list[Future]:
        pending = super()._in_flight()
        if self._grad_job is not None:
            pending.append(self._grad_job[0])
        return pending


class _RingFFN(torch.autograd.Function):
    """Layer ``l``'s expert FFN for training with offloaded weights.

    Forward fetches the weights, computes without recording a graph and releases the slot, so
    the slot can take the next layer. Backward fetches them again (the store prefetches in
    reverse layer order), recomputes the FFN with a graph and differentiates it: the same
    operations on the same values as the in-memory layer, hence the same gradients. Weight
    gradients go to the store's host accumulators; the input gradient flows on.
    """

    @staticmethod
    def forward(ctx, expert_in, counts_E, store: RingStreamer, layer: int, anchor=None):  # type: ignore[override]
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
