"""Run-time choice of the pipelining degree (``overlap_degree="auto"``).

The best degree depends on the batch, the routing and the machine (Tutel's observation), so it
is measured, not guessed: for each global batch size the dispatcher times every candidate on
real calls (``trials`` calls each, forward only, the slowest rank's time counts), then keeps the
fastest. All ranks take the same decision because they all time the same calls and reduce the
times with a MAX all-reduce. A routing whose load imbalance (busiest expert over the mean)
moves by more than ``retune_ratio`` from the one the choice was made under is tuned again.
Choices are logged on the ``moeflow.parallel`` logger and readable from ``tuner.choices``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moeflow.types import RoutingResult

__all__ = ["OverlapTuner"]

log = logging.getLogger("moeflow.parallel")


class OverlapTuner:
    """Per-dispatcher tuner of ``overlap_degree`` (see module docstring)."""

    def __init__(
        self, group: dist.ProcessGroup | None, *, candidates: tuple[int, ...] = (1, 2, 4), trials: int = 2,
        retune_ratio: float = 1.5,
    ) -> None:
        if not candidates or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in candidates):
            raise ValueError(f"candidates must be ints >= 1, got {candidates!r}")
        self.group, self.candidates, self.trials, self.retune_ratio = group, tuple(candidates), trials, retune_ratio
        self.choices: dict[tuple, int] = {}  # key -> locked degree
        self._imbalance: dict[tuple, float] = {}
        self._times: dict[tuple, dict[int, list[float]]] = {}

    def _key(self, dispatcher, routing: RoutingResult, capacity_factor: float) -> tuple:  # type: ignore[no-untyped-def]
        n = torch.tensor([routing.ids_TK.shape[0]], dtype=torch.long, device=routing.ids_TK.device)
        dist.all_reduce(n, group=self.group)
        return (int(n), routing.top_k, float(capacity_factor))

    def run(self, dispatcher, x_TD: torch.Tensor, routing: RoutingResult,  # type: ignore[no-untyped-def]
            experts: Callable[..., torch.Tensor], capacity_factor: float) -> torch.Tensor:
        key = self._key(dispatcher, routing, capacity_factor)
        counts_E = routing.counts_E.to(torch.float64)
        dist.all_reduce(counts_E, group=self.group)
        imbalance = float(counts_E.max() / counts_E.mean().clamp(min=1e-9))
        if key in self.choices:
            tuned = self._imbalance[key]
            if max(imbalance, tuned) / max(min(imbalance, tuned), 1e-9) <= self.retune_ratio:
                return dispatcher.run(x_TD, routing, experts, capacity_factor=capacity_factor,
                                      overlap_degree=self.choices[key])
            log.info("overlap_degree: routing imbalance moved %.2f -> %.2f for %s; tuning again", tuned, imbalance, key)
            del self.choices[key]
            self._times.pop(key, None)
        times = self._times.setdefault(key, {c: [] for c in self.candidates})
        degree = next(c for c in self.candidates if len(times[c]) < self.trials)
        t0 = time.perf_counter()
        y = dispatcher.run(x_TD, routing, experts, capacity_factor=capacity_factor, overlap_degree=degree)
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=counts_E.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=self.group)
        times[degree].append(float(elapsed))
        if all(len(v) >= self.trials for v in times.values()):
            medians = {c: statistics.median(v) for c, v in times.items()}
            best = min(medians, key=lambda c: (medians[c], c))
            self.choices[key], self._imbalance[key] = best, imbalance
            log.info("overlap_degree: chose %d for %s (median forward ms: %s)", best, key,
                     {c: round(m * 1e3, 3) for c, m in medians.items()})
        return y
