"""Run-time choice of the parallel mode and pipelining degree (``"auto"``).

The best setting depends on the batch, the routing and the machine (Tutel's observation), so it
is measured, not guessed: for each global batch size the dispatcher times every candidate
``(parallel mode, overlap degree)`` on real calls (``trials`` calls each, forward only, the
slowest rank's time counts), then keeps the fastest. All ranks take the same decision because
they time the same calls and reduce the times with a MAX all-reduce. A routing whose load
imbalance (busiest expert over the mean) moves by more than ``retune_ratio`` from the one the
choice was made under is tuned again. Choices are logged on the ``moeflow.parallel`` logger and
readable from ``tuner.choices``. The settings' results are identical, so tuning never changes
what a call computes, only how fast.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moeflow.experts.ffn import GroupedExperts
from moeflow.types import RoutingResult

__all__ = ["ParallelTuner"]

log = logging.getLogger("moeflow.parallel")


class ParallelTuner:
    """Per-dispatcher tuner of ``parallel`` and ``overlap_degree`` (see module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, *, degrees: tuple[int, ...] = (1, 2, 4), trials: int = 2,
                 retune_ratio: float = 1.5) -> None:
        if not degrees or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in degrees):
            raise ValueError(f"degrees must be ints >= 1, got {degrees!r}")
        self.group, self.degrees, self.trials, self.retune_ratio = group, tuple(degrees), trials, retune_ratio
        self.choices: dict[tuple, tuple[str, int]] = {}  # key -> locked (parallel, overlap_degree)
        self._imbalance: dict[tuple, float] = {}
        self._times: dict[tuple, dict[tuple[str, int], list[float]]] = {}

    def candidates(self, experts: object, parallel: str, overlap_degree: int | str) -> list[tuple[str, int]]:
        degrees = self.degrees if overlap_degree == "auto" else (int(overlap_degree),)
        out = [("expert", d) for d in degrees] if parallel in ("expert", "auto") else []
        if parallel in ("data", "auto") and isinstance(experts, GroupedExperts):
            out.append(("data", 1))
        if not out:
            raise ValueError(f"parallel={parallel!r} needs GroupedExperts, got {type(experts).__name__}")
        return out

    def run(self, dispatcher, x_TD: torch.Tensor, routing: RoutingResult,  # type: ignore[no-untyped-def]
            experts: Callable[..., torch.Tensor], capacity_factor: float, parallel: str,
            overlap_degree: int | str) -> torch.Tensor:
        stats = torch.cat([routing.counts_E.to(torch.float64),
                           torch.tensor([routing.ids_TK.shape[0]], dtype=torch.float64, device=routing.ids_TK.device)])
        dist.all_reduce(stats, group=self.group)  # one small collective: the global counts and T
        counts_E, T_total = stats[:-1], int(stats[-1])
        key = (T_total, routing.top_k, float(capacity_factor), parallel, overlap_degree)
        imbalance = float(counts_E.max() / counts_E.mean().clamp(min=1e-9))
        if key in self.choices:
            tuned = self._imbalance[key]
            if max(imbalance, tuned) / max(min(imbalance, tuned), 1e-9) <= self.retune_ratio:
                mode, degree = self.choices[key]
                return dispatcher.run(x_TD, routing, experts, capacity_factor=capacity_factor,
                                      overlap_degree=degree, parallel=mode)
            log.info("moeflow tuner: routing imbalance moved %.2f -> %.2f for %s; tuning again", tuned, imbalance, key)
            del self.choices[key]
            self._times.pop(key, None)
        times = self._times.setdefault(key, {c: [] for c in self.candidates(experts, parallel, overlap_degree)})
        mode, degree = next(c for c, v in times.items() if len(v) < self.trials)
        t0 = time.perf_counter()
        y = dispatcher.run(x_TD, routing, experts, capacity_factor=capacity_factor, overlap_degree=degree,
                           parallel=mode)
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=stats.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=self.group)
        times[(mode, degree)].append(float(elapsed))
        if all(len(v) >= self.trials for v in times.values()):
            medians = {c: statistics.median(v) for c, v in times.items()}
            best = min(medians, key=lambda c: (medians[c], c[0] != "expert", c[1]))
            self.choices[key], self._imbalance[key] = best, imbalance
            log.info("moeflow tuner: chose parallel=%r overlap_degree=%d for %s (median forward ms: %s)", *best, key,
                     {f"{m}/{d}": round(t * 1e3, 3) for (m, d), t in medians.items()})
        return y
