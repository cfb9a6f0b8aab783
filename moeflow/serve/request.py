"""What the serving engine (``moeflow.serve.engine``) takes and gives: its configuration
(``EngineConfig``), a request (``RequestSpec``; ``Request``, the submitted one), the events a
request's callback receives (``Event``), the engine's counters (``EngineStats``) and the two
refusals of ``Engine.submit`` (``QueueFull``, ``EngineClosed``). ``moeflow.serve.engine``
re-exports every name: import them from there.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from moeflow.checks import _int

__all__ = ["EngineConfig", "RequestSpec", "Event", "Request", "EngineStats", "QueueFull", "EngineClosed",
           "FINISH_REASONS"]

# the final event's reasons: a stop id drawn, max_tokens reached, the request's timeout, cancelled
# (Request.cancel), the engine shut down before the request ended, an exception in its step
FINISH_REASONS = ("stop", "length", "timeout", "cancelled", "shutdown", "error")


class QueueFull(RuntimeError):
    """``Engine.submit``: ``slots + max_queue`` requests are already running or waiting."""


class EngineClosed(RuntimeError):
    """``Engine.submit`` after ``shutdown`` began: no new request is admitted."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an ``Engine`` batches; validated on construction (errors name the field and value).

    ``slots``: decode slots, the most requests running at once (``--max-concurrency``); each
    slot is one row of the engine's KV cache. ``max_queue``: requests waiting for a slot beyond
    them (``--max-queue``); past ``slots + max_queue`` ``submit`` raises ``QueueFull``.
    ``capacity``: cache columns per slot (None: the model's ``max_seq_len``; at most that): a
    request's ``len(prompt) + max_tokens`` must fit. ``prefill_chunk``: prompt tokens prefilled
    between two decode steps (a long prompt does not stall the running requests). ``compile``:
    the decode step compiled (``moeflow.models.compiled_decode``); a model whose step cannot be
    one graph (offloaded or expert-parallel experts) is refused with a ``ValueError``.
    ``threads``: torch threads of the engine's thread, which runs every step (None: the
    process's ``torch.get_num_threads()`` when the engine is made). Why the engine sets them on
    its own thread: OpenMP (libgomp, torch's) stops its idle workers from spin-waiting once the
    process holds more OpenMP threads than cores, and then every parallel region of a step
    (hundreds) waits for its workers to wake. A second thread pool beside the engine's, such as
    the one the main thread gets by running torch with several threads, is enough for that:
    ``moeflow serve`` keeps its main thread at one torch thread from the start and gives the
    engine the threads."""

    slots: int = 8
    max_queue: int = 64
    capacity: int | None = None
    prefill_chunk: int = 64
    compile: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        _int("slots", self.slots, minimum=1)
        _int("max_queue", self.max_queue, minimum=0)
        if self.capacity is not None:
            _int("capacity", self.capacity, minimum=2)
        _int("prefill_chunk", self.prefill_chunk, minimum=1)
        if self.threads is not None:
            _int("threads", self.threads, minimum=1)
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__} {self.compile!r}")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def _token_ids(name: str, ids: object) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple, set, frozenset)):
        raise TypeError(f"{name} must be a collection of token ids, got {type(ids).__name__} {ids!r:.80}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"{name} holds {type(t).__name__} {t!r}; token ids are ints")
        if t < 0:
            raise ValueError(f"{name}: token ids must be >= 0, got {t}")
    return list(ids)


@dataclass(frozen=True, kw_only=True)
class RequestSpec:
    """One request; validated on construction (errors name the field and value). What depends
    on the model (ids below its vocabulary, ``len(prompt) + max_tokens`` within the engine's
    ``capacity``) ``Engine.submit`` checks.

    ``prompt``: the token ids (a non-empty sequence, kept as a tuple). ``max_tokens``: the most
    tokens generated (>= 1). Sampling as ``moeflow.models.generation.generate``'s:
    ``temperature`` (0: greedy), ``top_p`` in (0, 1], ``top_k`` (None or 0: no cut). ``seed``:
    the request's own generator (None: seeded from the OS), so its tokens do not depend on the
    other requests of the batch. ``stop_ids``: end-of-sequence ids; a drawn stop id is not sent
    as a token event, the final event says ``"stop"``, and it counts in
    ``Request.completion_tokens``. ``timeout_s``: from ``submit`` (queueing included) to the
    final event; past it the request ends with ``"timeout"``."""

    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        prompt = _token_ids("prompt", self.prompt)
        if isinstance(self.prompt, (set, frozenset)):
            raise TypeError("prompt must be a sequence of token ids (ordered), got a set")
        if not prompt:
            raise ValueError("prompt must hold at least one token id, got an empty prompt")
        object.__setattr__(self, "prompt", tuple(prompt))
        _int("max_tokens", self.max_tokens, minimum=1)
        if _number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None:
            _int("top_k", self.top_k, minimum=0)
        if self.seed is not None:
            _int("seed", self.seed, minimum=0)
            if self.seed >= 2**63:
                raise ValueError(f"seed must be < 2**63, got {self.seed}")
        object.__setattr__(self, "stop_ids", frozenset(_token_ids("stop_ids", self.stop_ids)))
        if self.timeout_s is not None and _number("timeout_s", self.timeout_s) <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {self.timeout_s}")


@dataclass(frozen=True)
class Event:
    """What a request's callback receives, in order: a token event per generated token
    (``token`` set, ``finish_reason`` None), then exactly one final event (``token`` None,
    ``finish_reason`` one of ``FINISH_REASONS``, ``detail`` the error's text for ``"error"``).
    Callbacks run on the engine thread the moment the token is known (a clock read inside one
    times the token) and must be cheap: the HTTP layer hands the event over to its own loop."""

    token: int | None
    finish_reason: str | None
    detail: str | None = None


@dataclass(eq=False)
class Request:
    """A submitted request (``Engine.submit`` makes it). ``cancel`` is thread-safe; the engine
    frees the request's slot before its next step and sends exactly one final event.
    ``finish_reason`` is None until the final event went out (``wait`` waits for it);
    ``prompt_tokens`` / ``completion_tokens`` count the prompt and the generated tokens (a drawn
    stop id included); ``submitted_at`` / ``first_token_at`` / ``last_token_at`` are
    ``time.monotonic()`` readings (the engine's; read them after ``wait``)."""

    id: int
    spec: RequestSpec
    on_event: Callable[[Event], None] = field(repr=False)
    submitted_at: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    _cancel: str | None = field(default=None, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _wake: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.prompt)

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self, reason: str = "cancelled") -> None:
        """End the request with ``reason`` (a ``FINISH_REASONS`` entry) before the engine's next
        step; nothing if it already ended."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"reason must be one of {list(FINISH_REASONS)}, got {reason!r}")
        if self._cancel is None:
            self._cancel = reason
        if self._wake is not None:
            self._wake()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether the request ended within ``timeout`` seconds (None: wait for it)."""
        return self._done.wait(timeout)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine (``Engine.stats``): ``running`` requests hold a slot, ``queued``
    wait for one; totals since the engine was made: requests accepted by ``submit``
    (``requests_total``) and refused with ``QueueFull`` (``rejected_total``), finished requests
    by reason (``finished``), prompt and generated tokens, decode steps and the rows they
    decoded (``busy_rows_total``: the mean batch occupancy is ``busy_rows_total / (steps_total
    * slots)``), and the sums and counts of time to first token and of the time between two
    tokens of a request (seconds)."""

    slots: int
    running: int
    queued: int
    requests_total: int
    rejected_total: int
    finished: Mapping[str, int]
    prompt_tokens_total: int
    generated_tokens_total: int
    steps_total: int
    busy_rows_total: int
    ttft_sum_s: float
    ttft_count: int
    itl_sum_s: float
    itl_count: int


