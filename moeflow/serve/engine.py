"""The engine of ``moeflow serve``: continuous batching over fixed decode slots (issue 48).

Requests join and leave the running batch at step granularity. One thread owns the model and
runs the loop; other threads ``submit`` requests, ``cancel`` them and ``shutdown`` the engine
(all thread-safe), and receive each request's ``Event``s through its callback, called on the
engine thread. An iteration of the loop:

1. ends the requests cancelled or past their timeout (queued or running; with ``shutdown``
   begun, the queued ones and, past the drain, the running ones), freeing their slots;
2. admits queued requests into free slots (the lowest index first: the steps stay short);
3. prefills up to ``prefill_chunk`` prompt tokens of the admitted prompts, oldest first (a
   prompt's last chunk gives its first token), so a long prompt does not stall the others;
4. runs one decode step over the slots whose request has a token to feed (``moeflow.serve.
   slots``: the static step on the row view ``[0, n)``, compiled or eager);
5. reads the iteration's sampled tokens on the host once (the one synchronisation an iteration
   needs) and hands them out: a stop id ends its request with ``"stop"`` (not sent as a
   token), ``max_tokens`` with ``"length"``.

An exception in a request's prefill ends that request with ``"error"``; one in a decode step
ends the requests of the step; the engine goes on serving (no slot leaks: every end frees its
slot). The loop waits on a condition when it holds no request, running or queued (until a
submission or a shutdown; no timeout or drain can be pending then).

The engine's tokens are ``moeflow.models.generation.generate``'s for the same prompt and
settings (a seeded request's too: its generator draws once per token as a one-row ``generate``
does), with dropless experts whatever else runs beside it (``moeflow.serve.slots``).
"""

from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import torch

from moeflow.models.decoding import SamplingConfig
from moeflow.serve.request import (FINISH_REASONS, EngineClosed, EngineConfig, EngineStats, Event, QueueFull, Request,
                                   RequestSpec)
from moeflow.serve.slots import SlotRow, Slots

__all__ = ["EngineConfig", "RequestSpec", "Event", "Request", "Engine", "EngineStats", "QueueFull", "EngineClosed",
           "FINISH_REASONS"]

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching of ``RequestSpec``s over ``config.slots`` decode slots of one model.

    ``Engine(model, config)`` takes a ``MoEGPT`` (any ``moeflow.models.decoding.Decoder``) on
    its device and puts it in eval mode; from ``start`` on the engine's thread owns it (no other
    thread may call it until ``shutdown`` returns). ``submit`` / ``Request.cancel`` /
    ``shutdown`` / ``stats`` are thread-safe. ``capacity``: the cache columns per slot
    (``config.capacity`` or the model's ``max_seq_len``). ``config.compile`` with a model whose
    step cannot be one graph (offloaded or expert-parallel experts) is a ``ValueError`` here."""

    def __init__(self, model, config: EngineConfig) -> None:  # type: ignore[no-untyped-def]
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        max_seq = model.config.max_seq_len
        if config.capacity is not None and config.capacity > max_seq:
            raise ValueError(f"capacity={config.capacity} exceeds the model's max_seq_len={max_seq}")
        self.config, self.model = config, model.eval()
        self.vocab_size: int = model.config.vocab_size
        self._capacity: int = config.capacity or max_seq
        self._threads: int = config.threads or torch.get_num_threads()
        self._slots = Slots(model, slots=config.slots, capacity=self._capacity, compile=config.compile)
        self._cond = threading.Condition()
        self._pending: deque[Request] = deque()  # submitted, waiting for a slot
        self._rows: dict[int, tuple[Request, SlotRow]] = {}  # slot -> its request (engine thread)
        self._active = 0  # requests submitted and not ended
        self._ids = 0
        self._closing = False
        self._drain_until = math.inf
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None
        self._counts: Counter[str] = Counter()
        self._finished: Counter[str] = Counter()
        self._sums = {"ttft": 0.0, "itl": 0.0}

    @property
    def capacity(self) -> int:
        return self._capacity

    def start(self) -> None:
        """Start the engine thread and return once it serves (compiled: after the step's
        compilation and warm-up); a failure there is raised here. Requests submitted before
        wait in the queue."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("Engine.start: the engine was started already")
            self._thread = threading.Thread(target=self._run, name="moeflow-engine", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._failure is not None:
            raise RuntimeError(f"the engine failed to start: {self._failure}") from self._failure

    def submit(self, spec: RequestSpec, on_event: Callable[[Event], None]) -> Request:
        """Queue ``spec``; ``on_event`` receives its events (``Event``) on the engine thread.
        Raises ``QueueFull`` (``slots + max_queue`` requests running or waiting),
        ``EngineClosed`` (after ``shutdown`` began) and ``ValueError`` naming the field (an id
        past the vocabulary, ``len(prompt) + max_tokens > capacity``)."""
        return self.submit_all([(spec, on_event)])[0]

    def submit_all(self, jobs: list[tuple[RequestSpec, Callable[[Event], None]]]) -> list[Request]:
        """``submit`` for several requests at once, all or none: ``QueueFull`` when the queue
        cannot take them all, with none of them queued (an answer's ``n`` choices; refused
        one by one, those already in would hold their places until the engine ends them)."""
        for spec, on_event in jobs:
            self._check(spec, on_event)
        with self._cond:
            if self._closing:
                raise EngineClosed("the engine is shutting down: no new request is admitted")
            if self._active + len(jobs) > self.config.slots + self.config.max_queue:
                self._counts["rejected"] += len(jobs)
                raise QueueFull(f"{self._active} requests are running or waiting (slots={self.config.slots}, "
                                f"max_queue={self.config.max_queue})"
                                + (f"; {len(jobs)} asked for at once" if len(jobs) > 1 else ""))
            requests = []
            for spec, on_event in jobs:
                self._ids += 1
                request = Request(id=self._ids, spec=spec, on_event=on_event, submitted_at=time.monotonic(),
                                  _wake=self._wake)
                self._active += 1
                self._counts["requests"] += 1
                self._counts["prompt_tokens"] += len(spec.prompt)
                self._pending.append(request)
                requests.append(request)
            self._cond.notify()
        return requests

    def _check(self, spec: RequestSpec, on_event: Callable[[Event], None]) -> None:
        if not isinstance(spec, RequestSpec):
            raise TypeError(f"spec must be a RequestSpec, got {type(spec).__name__}")
        if not callable(on_event):
            raise TypeError(f"on_event must be callable, got {type(on_event).__name__}")
        V = self.vocab_size
        for name, ids in (("prompt", spec.prompt), ("stop_ids", sorted(spec.stop_ids))):
            bad = [t for t in ids if t >= V]
            if bad:
                raise ValueError(f"{name}: token ids must be below the vocabulary size {V}, got {bad[0]}")
        if len(spec.prompt) + spec.max_tokens > self._capacity:
            raise ValueError(f"max_tokens: the prompt's {len(spec.prompt)} tokens and max_tokens={spec.max_tokens} "
                             f"exceed the engine's capacity of {self._capacity} tokens a request")

    def shutdown(self, *, drain_s: float) -> None:
        """Stop admission (``submit`` raises ``EngineClosed``), end the queued requests with
        ``"shutdown"``, let the running ones finish for up to ``drain_s`` seconds, end those
        left with ``"shutdown"``, and join the engine thread. Calling it again only joins."""
        if isinstance(drain_s, bool) or not isinstance(drain_s, (int, float)) or not drain_s >= 0:
            raise ValueError(f"drain_s must be a number >= 0, got {drain_s!r}")
        with self._cond:
            if not self._closing:
                self._closing = True
                self._drain_until = time.monotonic() + drain_s
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        else:  # never started: no thread will end the queued requests
            while self._pending:
                self._finish(self._pending.popleft(), "shutdown")

    def stats(self) -> EngineStats:
        with self._cond:
            c = self._counts
            running = len(self._rows)
            return EngineStats(slots=self.config.slots, running=running, queued=self._active - running,
                               requests_total=c["requests"], rejected_total=c["rejected"],
                               finished=dict(self._finished), prompt_tokens_total=c["prompt_tokens"],
                               generated_tokens_total=c["generated"], steps_total=c["steps"],
                               busy_rows_total=c["busy_rows"], ttft_sum_s=self._sums["ttft"], ttft_count=c["ttft"],
                               itl_sum_s=self._sums["itl"], itl_count=c["itl"])

    # ---------------------------------------------------------------- the engine thread

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _run(self) -> None:
        serving = False
        try:
            torch.set_num_threads(self._threads)  # this thread's own OpenMP threads (EngineConfig.threads)
            with torch.no_grad(), self._slots.open():
                serving = True
                self._started.set()
                while self._iterate():
                    pass
        except BaseException as err:  # the start failed (a compilation, say), or the cache broke
            log.exception("moeflow serve: the engine stopped")
            if not serving:  # start() raises this one; a break once serving ends the requests, below
                self._failure = err
            with self._cond:
                self._closing = True
            for request, _ in list(self._rows.values()):
                self._finish(request, "error", f"the engine stopped: {err}")
            while self._pending:
                self._finish(self._pending.popleft(), "error", f"the engine stopped: {err}")
        finally:
            self._started.set()

    def _iterate(self) -> bool:
        """One iteration of the loop (the module docstring); False once the engine is done."""
        self._end_cancelled()
        self._admit()
        if not self._rows:
            with self._cond:
                if self._closing and not self._pending:
                    return False
                if not self._pending:  # (no request at all: no timeout or drain to wait for)
                    self._cond.wait()
            return True
        try:
            tokens = self._prefill() + self._decode()
            ids = torch.stack([t for _, t in tokens]).tolist() if tokens else []  # the iteration's one host read
        except Exception as err:  # (outside a request's own work: a broken device, say) every running one ends
            log.exception("moeflow serve: an iteration failed")
            for request, _ in list(self._rows.values()):
                self._finish(request, "error", f"{type(err).__name__}: {err}")
            return True
        for (row, _), token in zip(tokens, ids):
            self._deliver(row, token)
        return True

    def _end_cancelled(self) -> None:
        now = time.monotonic()
        with self._cond:
            closing, drained = self._closing, now >= self._drain_until
            pending = list(self._pending)
        for request in pending + [r for r, _ in self._rows.values()]:
            timeout = request.spec.timeout_s
            if request._cancel is not None:
                self._finish(request, request._cancel)
            elif timeout is not None and now - request.submitted_at >= timeout:
                self._finish(request, "timeout")
            elif closing and (drained or request in pending):
                self._finish(request, "shutdown")

    def _admit(self) -> None:
        with self._cond:
            while self._pending and len(self._rows) < self.config.slots:
                request = self._pending.popleft()
                slot = min(set(range(self.config.slots)) - set(self._rows))
                s = request.spec
                sampling = SamplingConfig(temperature=s.temperature, top_k=s.top_k or 0, top_p=s.top_p)
                generator = None
                if not sampling.greedy:
                    seed = secrets.randbits(63) if s.seed is None else s.seed
                    generator = torch.Generator(device=self._slots.device).manual_seed(seed)
                self._rows[slot] = (request, SlotRow(slot=slot, prompt=s.prompt, sampling=sampling,
                                                     generator=generator))

    def _prefill(self) -> list[tuple[SlotRow, torch.Tensor]]:
        """Up to ``prefill_chunk`` prompt tokens, oldest request first; the first tokens given."""
        budget, out = self.config.prefill_chunk, []
        waiting = sorted((r for r in self._rows.values() if r[1].prefilling), key=lambda r: r[0].id)
        for request, row in waiting:
            if budget == 0:
                break
            try:
                taken, first = self._slots.prefill(row, budget)
            except Exception as err:
                log.exception("moeflow serve: a prefill failed")
                self._finish(request, "error", f"{type(err).__name__}: {err}")
                continue
            budget -= taken
            if first is not None:
                out.append((row, first))
        return out

    def _decode(self) -> list[tuple[SlotRow, torch.Tensor]]:
        """One decode step over the rows with a token to feed; their next tokens."""
        rows = [row for _, row in self._rows.values() if row.last is not None]
        if not rows:
            return []
        others = [row for _, row in self._rows.values() if row.last is None]
        try:
            tokens_R = self._slots.step(rows, others)
        except Exception as err:
            log.exception("moeflow serve: a decode step failed")
            for row in rows:
                self._finish(self._rows[row.slot][0], "error", f"{type(err).__name__}: {err}")
            return []
        with self._cond:
            self._counts["steps"] += 1
            self._counts["busy_rows"] += len(rows)
        return [(row, tokens_R[i]) for i, row in enumerate(rows)]

    def _deliver(self, row: SlotRow, token: int) -> None:
        """Hand ``token`` to its request: a stop id or the last of ``max_tokens`` ends it."""
        held = self._rows.get(row.slot)
        if held is None or held[1] is not row:  # (ended since its token was drawn)
            return
        request, now = held[0], time.monotonic()
        request.completion_tokens += 1
        with self._cond:
            self._counts["generated"] += 1
            if request.first_token_at is None:
                request.first_token_at = now
                self._counts["ttft"] += 1
                self._sums["ttft"] += now - request.submitted_at
            else:
                self._counts["itl"] += 1
                self._sums["itl"] += now - request.last_token_at  # type: ignore[operator]
        request.last_token_at = now
        row.last = token
        if token in request.spec.stop_ids:
            self._finish(request, "stop")
            return
        if not self._emit(request, Event(token, None)):
            self._finish(request, "error", "the request's event callback raised")
        elif request.completion_tokens >= request.spec.max_tokens:
            self._finish(request, "length")

    def _emit(self, request: Request, event: Event) -> bool:
        try:
            request.on_event(event)
            return True
        except Exception:
            log.exception("moeflow serve: request %d's event callback raised", request.id)
            return False

    def _finish(self, request: Request, reason: str, detail: str | None = None) -> None:
        """The request's one final event; its slot (if it holds one) is free afterwards."""
        if request.finish_reason is not None:
            return
        with self._cond:
            for slot, (held, _) in list(self._rows.items()):
                if held is request:
                    del self._rows[slot]
            if request in self._pending:
                self._pending.remove(request)
            request.finish_reason = reason
            self._active -= 1
            self._finished[reason] += 1
        self._emit(request, Event(None, reason, detail))
        request._done.set()
