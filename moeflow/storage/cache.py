"""``ExpertCache`` (``mode="cache"``): an LRU cache of single experts that fetches only the
experts the router selected, for small-batch decoding (inference only).

Legend: moeflow.types (``E`` experts, ``C`` capacity, ``R`` routed rows, ``D`` model dim). ``S``
is the number of cache slots, ``c`` the experts of one chunk (at most ``S``).

The fast tier is one slab per expert tensor, ``[S, ...]``: row ``s`` of every slab is slot
``s``, holding one expert of one layer. A layer's call loads only the experts not cached,
computes on views of their slots (runs of consecutive slots, no gathered copy: the fast tier
never holds more than the budget) and, while layer ``l`` computes, prefetches for the next
layers the experts they selected on their previous call (decoding repeats its choices often:
plain LRU would evict each expert just before its reuse), backing off while its guesses
mostly miss.
Every layer's experts must be shaped alike, since they share the slabs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from moeflow.experts.ffn import GroupedExperts
from moeflow.storage.base import ExpertStore
from moeflow.storage.config import format_bytes
from moeflow.storage.home import slot_bytes
from moeflow.storage.tiers import aligned_empty, tensor_bytes

__all__ = ["ExpertCache"]


class ExpertCache(ExpertStore, mode="cache"):
    """The cache layout of an ``ExpertStore``: ``cache_slots`` slots of ``expert_slot_bytes``,
    one expert each, least recently used evicted first; ``prefetch_hits`` counts the hits on
    experts the routing-aware prefetch loaded (reset with ``reset_stats``)."""

    def _plan_slots(self, experts: list[GroupedExperts]) -> None:
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

    def _allocate_slots(self) -> None:
        slots = self.cache_slots
        self._slab = {  # name -> [S, ...]: row s of every tensor is slot s
            n: aligned_empty(slots * tensor_bytes(t[0]), device=self.device).view(t.dtype).view(slots, *t.shape[1:])
            for n, t in self.layers[0].home.items()
        }
        self._count_fast(sum(tensor_bytes(t) for t in self._slab.values()))
        self._staging = self._staging_buffers(slots, self.expert_slot_bytes)
        self._cache: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, LRU first
        self._prefetched: set[tuple[int, int]] = set()
        self._free = list(range(slots - 1, -1, -1))  # popped from the end: ascending slots, runs of views
        self._last_selected: dict[int, list[int]] = {}
        self._gather_done: torch.cuda.Event | None = None
        self.prefetch_hits = 0
        self._pf_issued = self._pf_used = self._pf_skipped = 0  # the prefetch's recent accuracy

    def reset_stats(self) -> None:
        super().reset_stats()
        self.prefetch_hits = 0

    # ------------------------------------------------------------------ slots

    def _claim(self, protected: set[tuple[int, int]]) -> int | None:
        """A slot to load into: a free one, else the least recently used one whose expert is
        not protected; ``None`` if there is none."""
        if self._free:
            return self._free.pop()
        for key in self._cache:  # least recently used first
            if key not in protected:
                slot = self._cache.pop(key)
                self._prefetched.discard(key)
                return slot
        return None

    def _load_expert(self, layer: int, expert: int, slot: int, *, prefetch: bool) -> None:
        pairs = [(self._slab[n][slot], t[expert], self._disk_block(layer, n, expert))
                 for n, t in self.layers[layer].home.items()]
        self._start_load(slot, pairs, self._staging[slot], self._gather_done, prefetch=prefetch)
        self._cache[(layer, expert)] = slot
        if prefetch:
            self._prefetched.add((layer, expert))
            self._pf_issued += 1
            if self._pf_issued > 64:
                self._pf_issued //= 2
                self._pf_used //= 2

    def _forget_slot(self, slot: int) -> None:
        for key, s in list(self._cache.items()):
            if s == slot:
                del self._cache[key]
                self._prefetched.discard(key)
        if slot not in self._free:
            self._free.append(slot)

    def _forget_all(self) -> None:
        self._cache.clear()
        self._prefetched.clear()
        self._free = list(range(self.cache_slots - 1, -1, -1))

    def _prefetch_next(self, layer: int, computing: set[tuple[int, int]]) -> None:
        """Start loading, for the next ``prefetch`` layers, the experts each selected on its
        previous call, while layer ``layer`` computes (as far as free or evictable slots go;
        never into the slots of ``computing``, which the compute reads in place)."""
        if self._prefetch_useless():
            return
        for step in range(1, self.config.prefetch + 1):
            nxt = (layer + step) % self.num_layers
            predicted = self._last_selected.get(nxt, [])
            keep = computing | {(nxt, e) for e in predicted}
            for e in predicted:
                if (nxt, e) in self._cache:
                    continue
                slot = self._claim(keep)
                if slot is None:
                    break
                self._load_expert(nxt, e, slot, prefetch=True)

    def _acquire_slots(self, layer: int, experts: list[int], *, prefetch: bool) -> list[int]:
        """The cache slots holding ``experts`` of layer ``layer`` (in the order given), loading
        only the ones not cached and waiting for their loads; then (``prefetch``) remembers
        them as this layer's choice and starts prefetching, for the next layers, the experts
        they chose on their previous call (the loads run while this layer computes)."""
        self._check_layer(layer)
        self._require_open()
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
                    self._pf_used += 1
                    self._prefetched.discard(key)
                self._cache.move_to_end(key)
            else:
                self.stats.misses += 1
                slot = self._claim(wanted)
                if slot is None:
                    raise RuntimeError(f"no evictable cache slot for layer {layer} expert {e}")
                self._load_expert(layer, e, slot, prefetch=False)
            slots.append(self._cache[key])
        for slot in slots:
            self._await_load(slot)
        if prefetch:
            self._last_selected[layer] = list(experts)
            self._prefetch_next(layer, wanted)
        return slots

    def _prefetch_useless(self) -> bool:
        """Whether to skip this prefetch: after a warm-up of 16 prefetched experts, when fewer
        than half of them were used before eviction (the routing changes from token to token,
        so the loads only cost reads and evict experts that would have hit), except every 8th
        call, which keeps probing so the prefetch resumes when the routing settles. The counts
        are halved past 64 loads, so they follow the recent routing."""
        issued, used = self._pf_issued, self._pf_used
        if issued < 16 or 2 * used >= issued:
            return False
        self._pf_skipped += 1
        return self._pf_skipped % 8 != 0

    def acquire_experts(self, layer: int, experts: Sequence[int], *, prefetch: bool = True) -> dict[str, torch.Tensor]:
        """The weights of ``experts`` of layer ``layer`` gathered into one workspace (name ->
        ``[c, ...]``, in the order given), loading only the ones not cached, prefetching as
        ``_acquire_slots`` does. The workspace is a copy outside the slots (counted in the
        fast-tier bytes until ``release_workspace``): ``run`` does not use it, it computes on
        views of the slots and so stays within ``fast_memory``."""
        slots = self._acquire_slots(layer, list(experts), prefetch=prefetch)
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        workspace = {n: slab.index_select(0, index) for n, slab in self._slab.items()}
        self._gather_done = self._release_event()
        self._count_fast(sum(tensor_bytes(t) for t in workspace.values()))
        return workspace

    def release_workspace(self, workspace: dict[str, torch.Tensor]) -> None:
        self._count_fast(-sum(tensor_bytes(t) for t in workspace.values()))

    # ------------------------------------------------------------------ compute

    def run(self, layer: int, expert_in: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Only the routed experts run, on views of the cache slots (no gathered copy, so the
        fast tier never holds more than ``fast_memory``): the selected experts are taken in
        chunks of at most ``cache_slots`` (a prefill may select more experts than the cache
        holds), and each chunk runs as few calls as there are runs of consecutive slots (the
        cache hands out free slots in ascending order, so experts loaded together usually sit
        side by side). Per-expert results do not depend on which other experts share the call,
        so the output equals the all-experts one."""
        self._check_layer(layer)
        if torch.is_grad_enabled() and expert_in.requires_grad:
            raise RuntimeError("mode='cache' is inference-only: run under torch.no_grad() or use mode='ring'")
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
            slots = self._acquire_slots(layer, chunk, prefetch=i == len(chunks) - 1)
            for lo, hi in _runs(slots):
                experts = chunk[lo:hi]
                weights = {n: slab[slots[lo] : slots[lo] + hi - lo] for n, slab in self._slab.items()}  # views
                ids_c = torch.tensor(experts, device=expert_in.device)
                counts_c = counts_E.index_select(0, ids_c)
                if out_ECD is not None:  # [E, C, D]: the run's expert slices
                    out_ECD[ids_c] = self.compute(layer, weights, expert_in.index_select(0, ids_c), counts_c)
                else:  # [R, D]: rows are grouped by expert, and a run's experts are in order
                    rows_RD = expert_in[starts[experts[0]] : starts[experts[-1] + 1]]
                    pieces_RD.append(self.compute(layer, weights, rows_RD, counts_c))
            self._gather_done = self._release_event()  # a later load into these slots waits for the compute
        self._last_selected[layer] = selected
        if out_ECD is not None:
            return out_ECD
        return pieces_RD[0] if len(pieces_RD) == 1 else torch.cat(pieces_RD)


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]``: the index ranges of ``slots`` whose slot numbers go up by one,
    e.g. ``[4, 5, 6, 1, 2] -> [(0, 3), (3, 5)]``; each range is one view of the slabs."""
    runs = []
    lo = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            runs.append((lo, i))
            lo = i
    return runs
