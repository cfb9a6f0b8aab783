"""AdamW for expert weights kept in the store's home tier (training with offloaded experts).

The step runs where the state lives: the master weights, their gradient accumulators and the
AdamW moments stay in host memory (``offload="host"``: a host AdamW, no copy at all) or on disk
(``offload="disk"``: weights and moments are safetensors files; each layer's state is streamed
into host buffers, stepped, and written back).

2-D prefetch: across layers, the store loads layer ``l + 1``'s weights while layer ``l``
computes (and ``l - 1``'s in backward); across kinds of state, as soon as the backward hands
over a layer's gradients, that layer's weights and AdamW moments start streaming in from disk
for the update (up to ``max(1, prefetch)`` layers ahead), so the step finds the first layers'
state loaded and keeps loading the next ones while it updates.

The update is ``torch.optim.adamw.adamw`` (the function behind ``torch.optim.AdamW``, single-
tensor path) with the same hyper-parameters, so a model trained with offloaded experts has the
same parameters, bit for bit, as one trained with ``torch.optim.AdamW`` in memory.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.optim.adamw import adamw

from moeflow.storage.base import ExpertStore
from moeflow.storage.home import disk_key
from moeflow.storage.ring import RingStreamer
from moeflow.storage.disk import DiskFile
from moeflow.storage.tiers import tensor_bytes

__all__ = ["OffloadedAdamW"]


class OffloadedAdamW:
    """AdamW over the expert weights of ``store`` (built with ``trainable=True``).

    Use beside a regular optimizer for the dense parameters::

        store = offload_experts(model, StorageConfig(trainable=True, ...))
        dense_opt = torch.optim.AdamW(model.parameters(), lr=...)   # experts are not in there
        expert_opt = OffloadedAdamW(store, lr=...)
        loss.backward(); dense_opt.step(); expert_opt.step()
        dense_opt.zero_grad(); expert_opt.zero_grad()

    A layer whose experts received no gradient since ``zero_grad`` is skipped (as
    ``torch.optim.AdamW`` skips parameters whose ``grad`` is ``None``).
    """

    def __init__(self, store: RingStreamer, *, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        if not isinstance(store, ExpertStore):
            raise TypeError(f"store must be an ExpertStore, got {type(store).__name__}")
        if not isinstance(store, RingStreamer) or store.grads is None:
            raise ValueError(f"OffloadedAdamW needs a store built with StorageConfig(trainable=True), got one with "
                             f"mode={store.config.mode!r}, trainable={store.config.trainable}")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(betas, tuple):
            raise TypeError(f"betas must be a tuple of two numbers, got {type(betas).__name__} {betas!r}")
        if (len(betas) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)):
            raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}")
        self.store = store
        self.lr, self.betas, self.eps, self.weight_decay = float(lr), betas, float(eps), float(weight_decay)
        moments = {f"{kind}.{i}.{n}": torch.zeros_like(t, device="cpu")
                   for i, layer in enumerate(store.layers) for n, t in layer.home.items()
                   for kind in ("exp_avg", "exp_avg_sq")}
        self.state_file: DiskFile | None = None
        if store.disk is not None:
            # a file of its own beside the weights: optimizers of stores sharing a directory
            # never overwrite each other's state
            self.state_file = DiskFile.create(Path(store.disk.path).parent, "adamw-state-", moments,
                                              verify=store.disk.verify, direct=store.disk.direct_requested)
            self._moments = {k: self.state_file.spec(k) for k in moments}  # shapes only: data is read
        else:
            self._moments = moments
        self._steps = {(i, n): torch.tensor(0.0) for i, layer in enumerate(store.layers) for n in layer.names}
        # disk tier: layer -> (future, host buffers) of state streaming in ahead of the step
        self._loads: dict[int, tuple] = {}
        self._depth = max(1, store.config.prefetch)
        if store.disk is not None:
            store.on_grads = self._on_grads

    def zero_grad(self) -> None:
        self.store.zero_grads()

    def _state(self, layer: int) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(name, weight, exp_avg, exp_avg_sq)`` of each tensor of ``layer`` in its home tier
        (host tensors; for the disk tier, meta tensors giving shapes and dtypes)."""
        home = self.store.layers[layer].home
        return [(n, home[n], self._moments[f"exp_avg.{layer}.{n}"], self._moments[f"exp_avg_sq.{layer}.{n}"])
                for n in home]

    def _update(self, layer: int, tensors: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        grads = self.store.grads[layer]  # type: ignore[index]
        names = [n for n, *_ in tensors]
        adamw(
            [w for _, w, _, _ in tensors], [grads[n] for n in names], [m for _, _, m, _ in tensors],
            [v for _, _, _, v in tensors], [], [self._steps[(layer, n)] for n in names],
            foreach=False, fused=False, amsgrad=False, beta1=self.betas[0], beta2=self.betas[1], lr=self.lr,
            weight_decay=self.weight_decay, eps=self.eps, maximize=False,
        )

    # ------------------------------------------------------------------ disk: streamed state

    def _blocks(self, layer: int, name: str) -> list[tuple[DiskFile, str]]:
        """Where ``(weight, exp_avg, exp_avg_sq)`` of ``layer``'s tensor ``name`` live on disk:
        (file, key)."""
        disk, state = self.store.disk, self.state_file
        assert disk is not None and state is not None
        return [(disk, disk_key(layer, name)), (state, f"exp_avg.{layer}.{name}"),
                (state, f"exp_avg_sq.{layer}.{name}")]

    def _start_load(self, layer: int) -> None:
        """Queue the read of ``layer``'s weights and moments into fresh host buffers (checked:
        a damaged file raises ``DiskTierError`` from the step)."""
        store = self.store
        host = [(n, *(torch.empty_like(t, device="cpu") for t in (w, m, v))) for n, w, m, v in self._state(layer)]

        def job(stream: object) -> None:
            for n, *buffers in host:
                for buf, (file, key) in zip(buffers, self._blocks(layer, n)):
                    file.read(buf, key)
            return None

        store.stats.bytes_from_disk += sum(3 * tensor_bytes(w) for _, w, _, _ in host)
        self._loads[layer] = (store.engine.submit(job), host)

    def _on_grads(self, layer: int) -> None:
        """The store handed over ``layer``'s gradients during backward: the update is the next
        kind of state this layer needs, so start streaming its weights and moments in now
        (at most ``max(1, prefetch)`` layers ahead of the step)."""
        if layer not in self._loads and len(self._loads) < self._depth:
            self._start_load(layer)

    def step(self) -> None:
        """One AdamW step of every expert layer that has a gradient; invalidates the fast
        tier's copies (the weights changed)."""
        with torch.no_grad():
            store = self.store
            store._require_open()
            if store.disk is not None and self.state_file is None:
                raise RuntimeError("the OffloadedAdamW is closed")
            store.wait_grads()
            store.invalidate()
            todo = [i for i in range(store.num_layers) if store.has_grad[i]]
            if store.disk is None:
                for i in todo:  # host AdamW on the resident state
                    self._update(i, self._state(i))
                return
            self._step_streamed(todo)

    def _step_streamed(self, todo: list[int]) -> None:
        """Disk tier: step the layers whose state is already streaming in first (the last ones
        of the backward), keep ``depth`` loads in flight, write each stepped layer back
        asynchronously (all on the store's copy engine, in order)."""
        store = self.store
        todo = [i for i in todo if i in self._loads] + [i for i in todo if i not in self._loads]
        for i in todo[: self._depth]:
            if i not in self._loads:
                self._start_load(i)
        writes = []
        for k, i in enumerate(todo):
            if k + self._depth < len(todo) and todo[k + self._depth] not in self._loads:
                self._start_load(todo[k + self._depth])
            future, host = self._loads.pop(i)
            store._wait(future)
            self._update(i, host)

            def write(stream: object, i: int = i, host: list = host) -> None:
                for n, *buffers in host:
                    for buf, (file, key) in zip(buffers, self._blocks(i, n)):
                        file.write(buf, key)
                return None

            writes.append(store.engine.submit(write))
            store.stats.bytes_written_back += sum(3 * tensor_bytes(w) for _, w, _, _ in host)
        for future in writes:
            store._wait(future)
        for future, _ in self._loads.values():  # loads of layers without gradients (none expected)
            store._wait(future)
        self._loads.clear()
        assert store.disk is not None and self.state_file is not None
        store.disk.flush()
        self.state_file.flush()
        if store.config.evict_page_cache:
            for i in todo:
                for n in store.layers[i].names:
                    for file, key in self._blocks(i, n):
                        file.evict(*file.byte_range(key))

    def close(self) -> None:
        if self.store.on_grads == self._on_grads:
            self.store.on_grads = None
        for future, _ in self._loads.values():
            future.result()
        self._loads.clear()
        if self.state_file is not None:
            self.state_file.remove()  # this optimizer's own file
            self.state_file = None
