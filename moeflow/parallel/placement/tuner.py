"""Run-time choice of the parallel mode and pipelining degree (``"auto"``).

The best setting depends on the batch, the routing and the machine (Tutel's observation), so it
is measured, not guessed: for each global batch size the tuner times every candidate
``(parallel mode, overlap degree)`` the dispatcher offers on real calls, round-robin (one warm-up call each, whose
time is dropped, then ``trials`` timed calls each, more for calls so short that their trials
add up to less than ``min_time_s``, up to ``max_trials``; the median decides), then keeps the
fastest (an overlap degree above 1 only when it beats degree 1 by ``overlap_margin``:
``TunerConfig``). Candidates whose median lies within ``close`` of the fastest one's are a near tie that
a few noisy trials cannot settle: they alone are timed on (round-robin) until each has
``max_trials`` trials, and the medians of those decide. A trial's time is its forward plus,
when the call is back-propagated, this layer's backward (stamped by two identity autograd
nodes around it; modes differ most in backward: data parallelism all-reduces the expert
gradients); it is reduced over the ranks (MAX: the slowest rank sets the pace) at the start of
the next tuning call, a point every rank reaches in the same order. All ranks therefore take the
same decision. A routing whose load
imbalance (busiest expert over the mean) moves by more than ``retune_ratio`` from the one the
choice was made under is tuned again. Choices are logged on the ``moeflow.parallel`` logger and
readable from ``tuner.choices``; ``settings()`` exports them as JSON-able records and ``fix``
locks recorded choices in a later run (no timing, never tuned again), so a run can repeat an
earlier run's settings exactly. The settings' results are identical up to rounding, so tuning
never changes what a call computes, only how fast.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from moeflow.config import TunerConfig, hybrid_shards
from moeflow.parallel.comm import all_reduce_max
from moeflow.parallel.strategies.base import Call

__all__ = ["ParallelTuner", "Setting"]

Setting = tuple[str, int]  # (parallel mode, overlap degree)

log = logging.getLogger("moeflow.parallel")


class ParallelTuner:
    """Per-dispatcher tuner of ``parallel`` and ``overlap_degree`` (see module docstring). It
    never calls back into the dispatcher: the dispatcher hands it the candidates and a function
    that runs one."""

    def __init__(self, group: dist.ProcessGroup | None, config: TunerConfig | None = None) -> None:
        # candidates' degrees and the timing budget (validated by TunerConfig): short calls are
        # noisy, so a candidate is timed until its trials add up to min_time_s (at most
        # max_trials), near ties (within ``close``) get max_trials each; decisions use the times
        # reduced over the ranks, so every rank agrees
        self.group, self.config = group, TunerConfig() if config is None else config
        self.choices: dict[tuple, Setting] = {}  # key -> locked (parallel, overlap_degree)
        self._imbalance: dict[tuple, float] = {}
        self._times: dict[tuple, dict[Setting, list[float]]] = {}
        self._open: dict[tuple, list[Setting]] = {}  # key -> candidates still being timed
        self._fixed: dict[tuple, Setting] = {}  # choices locked by ``fix``
        self._pending: list[tuple] = []  # trials whose backward may still be running: (key, setting, fwd s, stamps)

    def reset(self) -> None:
        """Forget every choice and trial (the dispatcher calls it when its expert placement
        changes: on every rank at the same step boundary, so the ranks stay in agreement)."""
        self.choices.clear()
        self._imbalance.clear()
        self._times.clear()
        self._open.clear()
        self._pending.clear()
        self.choices.update(self._fixed)  # fixed by the user: kept

    def settings(self) -> list[dict]:
        """The locked choices as JSON-able records (``fix`` takes them back): the call's global
        token count, ``top_k``, capacity factor and ``parallel``/``overlap_degree`` arguments,
        and the chosen ``{"parallel": mode, "overlap_degree": degree}``."""
        return [{"tokens": k[0], "top_k": k[1], "capacity_factor": k[2], "parallel": k[3], "overlap_degree": k[4],
                 "choice": {"parallel": mode, "overlap_degree": degree}} for k, (mode, degree) in self.choices.items()]

    def fix(self, settings: Iterable[Mapping]) -> None:
        """Lock recorded choices (``settings()`` of an earlier run): calls with those keys run
        the recorded setting without timing and are never tuned again. Raises ``ValueError``
        naming the record for a malformed one."""
        fixed = {}
        for i, rec in enumerate(settings):
            try:
                key = _record_key(rec)  # (validates the arguments the choice is checked against)
                fixed[key] = _record_choice(rec)
            except (ValueError, TypeError) as err:
                raise ValueError(f"tuned setting #{i} {rec!r}: {err}") from None
        self._fixed.update(fixed)
        self.choices.update(fixed)

    def run(self, call: Call, *, parallel: str, overlap_degree: int | str,
            candidates: Callable[[], list[Setting]], run: Callable[[Setting, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Run ``call`` (whose ``parallel``/``overlap_degree`` arguments contain ``"auto"``) with
        the locked choice for its key, or time the next candidate: ``candidates()`` lists the
        settings that can run it, ``run(setting, x_TD)`` runs one."""
        self._finish_trials(call.x_TD.device)
        # the group's routing, gathered for the call anyway, gives the global T and load: the
        # tuner adds no collective to a call once it has chosen
        routing = call.group_routing
        counts_E = routing.counts_E.to(torch.float64)
        key = (routing.num_tokens, routing.top_k, float(call.capacity_factor), parallel, overlap_degree)
        imbalance = float(counts_E.max() / counts_E.mean().clamp(min=1e-9))
        choice = self._fixed.get(key)
        if choice is None and key in self.choices:
            tuned = self._imbalance[key]
            if max(imbalance, tuned) / max(min(imbalance, tuned), 1e-9) <= self.config.retune_ratio:
                choice = self.choices[key]
            else:
                log.info("moeflow tuner: routing imbalance moved %.2f -> %.2f for %s; tuning again", tuned, imbalance, key)
                del self.choices[key]
                self._times.pop(key, None)
                self._open.pop(key, None)
        if choice is not None:
            return run(choice, call.x_TD)
        times = self._times.setdefault(key, {c: [] for c in candidates()})
        # the previous call's trial was reduced above (_finish_trials): the counts are complete
        runs = {c: len(times[c]) for c in self._open.get(key, times)}
        setting = min(runs, key=lambda c: runs[c])  # round-robin in candidate order
        stamps: dict[str, float] = {}
        t0 = time.perf_counter()
        x_in = _Stamp.apply(call.x_TD, stamps, "backward_end") if call.x_TD.requires_grad else call.x_TD
        y = run(setting, x_in)
        if y.device.type == "cuda":
            torch.cuda.synchronize(y.device)
        self._pending.append((key, setting, time.perf_counter() - t0, stamps, imbalance))
        return _Stamp.apply(y, stamps, "backward_start") if y.requires_grad else y

    def _finish_trials(self, device: torch.device) -> None:
        """Reduce the pending trials' times over the ranks (one collective) and lock the keys
        whose candidates all have ``trials`` times."""
        if not self._pending:
            return
        local = [fwd + max(0.0, st.get("backward_end", 0.0) - st.get("backward_start", 0.0))
                 for _, _, fwd, st, _ in self._pending]
        t = torch.tensor(local, dtype=torch.float64, device=device)
        all_reduce_max(t, self.group)
        for (key, setting, _, _, imbalance), seconds in zip(self._pending, t.tolist()):
            times = self._times.get(key)
            if times is None or key in self.choices:
                continue
            times[setting].append(seconds)
            if not all(self._enough(v) for v in times.values()):
                continue
            medians = {c: statistics.median(v[1:]) for c, v in times.items()}  # [0]: warm-up
            best = self._fastest(medians)
            ties = [c for c in times if medians[c] <= medians[best] * (1.0 + self.config.close)]
            if len(ties) > 1 and any(len(times[c]) - 1 < self.config.max_trials for c in ties):
                self._open[key] = ties  # a near tie: time only those on
                continue
            self.choices[key], self._imbalance[key] = best, imbalance
            self._open.pop(key, None)
            log.info("moeflow tuner: chose parallel=%r overlap_degree=%d for %s (median ms: %s)", *best, key,
                     {f"{m}/{d}": round(v * 1e3, 3) for (m, d), v in medians.items()})
        self._pending.clear()

    def _fastest(self, medians: dict[Setting, float]) -> Setting:
        """The setting with the lowest median (ties: the expert mode, then the lower degree),
        among those where pipelining pays: an overlap degree above 1 counts only when its
        median is below its mode's degree 1 by more than ``overlap_margin`` (``TunerConfig``:
        where the exchange is small next to the compute, degree 1)."""
        margin = self.config.overlap_margin
        pays = {c: m for c, m in medians.items()
                if c[1] == 1 or (c[0], 1) not in medians or m < medians[(c[0], 1)] * (1.0 - margin)}
        return min(pays, key=lambda c: (pays[c], c[0] != "expert", c[1]))

    def _enough(self, seconds: list[float]) -> bool:
        """A candidate's timing is done: ``trials`` timed calls after the warm-up that add up to
        ``min_time_s``, or ``max_trials`` of them."""
        timed = seconds[1:]
        cfg = self.config
        return len(timed) >= cfg.max_trials or (len(timed) >= cfg.trials and sum(timed) >= cfg.min_time_s)


def _is_mode(value: object) -> bool:
    return value in ("expert", "data", "sharded") or hybrid_shards(value) is not None


def _is_degree(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _record_key(rec: object) -> tuple:
    """The tuner key of a ``settings()`` record (validated)."""
    if not isinstance(rec, Mapping) or set(rec) != {"tokens", "top_k", "capacity_factor", "parallel",
                                                    "overlap_degree", "choice"}:
        raise ValueError("needs exactly tokens, top_k, capacity_factor, parallel, overlap_degree, choice")
    tokens, top_k, cf = rec["tokens"], rec["top_k"], rec["capacity_factor"]
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 and _is_degree(top_k)):
        raise ValueError(f"tokens and top_k must be ints (>= 0, >= 1), got {tokens!r}, {top_k!r}")
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not math.isfinite(cf):
        raise ValueError(f"capacity_factor must be a finite number, got {cf!r}")
    parallel, degree = rec["parallel"], rec["overlap_degree"]
    if not (parallel == "auto" or _is_mode(parallel)) or not (degree == "auto" or _is_degree(degree)):
        raise ValueError(f"parallel and overlap_degree are the call's arguments ('auto', a mode; 'auto', an int >= 1), "
                         f"got {parallel!r}, {degree!r}")
    if "auto" not in (parallel, degree):
        raise ValueError(f"a call with parallel={parallel!r} and overlap_degree={degree!r} is not tuned")
    return (tokens, top_k, float(cf), parallel, degree)


def _record_choice(rec: Mapping) -> Setting:
    """The chosen ``(mode, degree)`` of a ``settings()`` record, checked against its arguments."""
    choice = rec["choice"]
    if not isinstance(choice, Mapping) or set(choice) != {"parallel", "overlap_degree"}:
        raise ValueError("choice needs exactly parallel and overlap_degree")
    mode, degree = choice["parallel"], choice["overlap_degree"]
    if not _is_mode(mode) or not _is_degree(degree) or (mode != "expert" and degree != 1):
        raise ValueError(f"choice must be a parallel mode with an overlap degree >= 1 (1 unless 'expert'), "
                         f"got {mode!r}/{degree!r}")
    if rec["parallel"] != "auto" and mode != rec["parallel"] or rec["overlap_degree"] != "auto" and degree != rec["overlap_degree"]:
        raise ValueError(f"choice {mode!r}/{degree} is not a candidate of a call with parallel={rec['parallel']!r}, "
                         f"overlap_degree={rec['overlap_degree']!r}")
    return mode, degree


class _Stamp(torch.autograd.Function):
    """Identity whose backward records the time under ``name`` in ``stamps`` (the tuner puts one
    after the layer's output, fired first in backward, and one before its input, fired last)."""

    @staticmethod
    def forward(ctx, x, stamps, name):  # type: ignore[override]
        ctx.stamps, ctx.name = stamps, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.stamps[ctx.name] = time.perf_counter()
        return grad, None, None
