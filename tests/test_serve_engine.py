"""The serving engine (``moeflow.serve.engine``): continuous batching over fixed decode slots.

Concurrent greedy requests of different prompt lengths and ``max_tokens`` (more than the slots:
some wait, some join a running batch) give exactly the tokens of sequential ``generate`` calls
(eager here; compiled in ``test_serve_engine_compiled.py``, apart so that a mutation run of
``serve`` does not compile for every mutant); a seeded request gives ``generate``'s sampled
tokens with the same seed, alone and in a mixed batch; a cancelled request frees its slot;
``QueueFull`` past ``slots + max_queue``; a timeout, a shutdown with requests in flight, a step
that raises (its requests end with ``"error"``, the next request is served); bad values named;
an offloaded model (experts in an expert store, eager) gives ``generate``'s tokens.

An fp32 model with weights drawn wide (std 0.3) so greedy picks are far from ties (the engine's
chunked prefill and whole-cache static step round differently from ``generate``'s loop).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import moeflow
from moeflow.models.generation import generate
from moeflow.serve.engine import (FINISH_REASONS, Engine, EngineClosed, EngineConfig, Event, QueueFull, Request,
                                  RequestSpec)
from moeflow.serve.slots import Slots, step_sizes
from moeflow.storage import StorageConfig, offload_experts, slot_bytes

from helpers import small_gpt

MAX_SEQ = 48
WAIT_S = 60  # a generous bound on any wait: a failure, not a slow machine, should end a test


@pytest.fixture(scope="module")
def model() -> moeflow.models.MoEGPT:
    torch.manual_seed(0)
    m = small_gpt(max_seq_len=MAX_SEQ).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return m


class Events:
    """A request's callback: keeps its events; ``first`` is set on its first token event; an
    optional ``each`` runs on every event (on the engine thread)."""

    def __init__(self, each=None) -> None:  # type: ignore[no-untyped-def]
        self.events: list[Event] = []
        self.first = threading.Event()
        self.each = each

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.token is not None:
            self.first.set()
        if self.each is not None:
            self.each(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def reason(self) -> str | None:
        final = [e for e in self.events if e.finish_reason is not None]
        assert len(final) == 1 and self.events[-1] is final[0], self.events  # exactly one, last
        return final[0].finish_reason


def _plant_failures(model, monkeypatch, *, step: int = 0, prefill: int = 0) -> dict[str, int]:
    """Make ``model``'s next ``step`` decode steps and ``prefill`` prefills raise; the returned
    counts may be raised later to plant more."""
    fail = {"step": step, "prefill": prefill}
    real_step, real_prefill = model.decode_step, model.forward_cached

    def planted_step(*args):  # type: ignore[no-untyped-def]
        if fail["step"]:
            fail["step"] -= 1
            raise RuntimeError("planted step failure")
        return real_step(*args)

    def planted_prefill(idx, cache):  # type: ignore[no-untyped-def]
        if fail["prefill"]:
            fail["prefill"] -= 1
            raise RuntimeError("planted prefill failure")
        return real_prefill(idx, cache)

    monkeypatch.setattr(model, "decode_step", planted_step)
    monkeypatch.setattr(model, "forward_cached", planted_prefill)
    return fail


def _prompts(gen: torch.Generator, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(0, 61, (n,), generator=gen).tolist() for n in lengths]


def _wait(requests: list[Request]) -> None:
    for r in requests:
        assert r.wait(WAIT_S), f"request {r.id} did not end"


def _greedy_against_generate(engine: Engine, model, gen: torch.Generator) -> None:  # type: ignore[no-untyped-def]
    """Seven greedy requests (prompts of 1 to 21 tokens, 1 to 14 new tokens, one with a stop id
    met on its way): three submitted before the start, four once the first has a token (they
    join a running batch, some wait for a slot); each gives ``generate``'s tokens alone."""
    lengths, maxes = [9, 2, 21, 5, 1, 13, 7], [6, 14, 3, 9, 11, 1, 8]
    prompts = _prompts(gen, lengths)
    want = [generate(model, [p], n, temperature=0).tokens[0] for p, n in zip(prompts, maxes)]
    stop = want[3][4]  # request 3 stops at its fifth token (or earlier, where the id came before)
    want[3] = want[3][:want[3].index(stop) + 1]
    specs = [RequestSpec(prompt=p, max_tokens=n, temperature=0, stop_ids={stop} if i == 3 else frozenset())
             for i, (p, n) in enumerate(zip(prompts, maxes))]
    events = [Events() for _ in specs]
    requests = [engine.submit(s, e) for s, e in zip(specs[:3], events)]
    engine.start()
    assert events[0].first.wait(WAIT_S)
    requests += [engine.submit(s, e) for s, e in zip(specs[3:], events[3:])]
    _wait(requests)
    for i, (e, w) in enumerate(zip(events, want)):
        if i == 3:
            assert e.reason == "stop" and e.tokens == w[:-1] and requests[i].completion_tokens == len(w)
        else:
            assert e.reason == "length" and e.tokens == w, i
    stats = engine.stats()
    assert stats.running == stats.queued == 0 and stats.requests_total == 7
    assert stats.finished == {"length": 6, "stop": 1}
    assert stats.generated_tokens_total == sum(len(w) for w in want) and stats.prompt_tokens_total == sum(lengths)
    assert stats.ttft_count == 7 and stats.itl_count == stats.generated_tokens_total - 7
    assert stats.steps_total > 0 and stats.steps_total < stats.busy_rows_total  # (steps decoded several rows)


@pytest.mark.reference
def test_concurrent_greedy_requests_give_sequential_generates_tokens(model, gen):
    engine = Engine(model, EngineConfig(slots=4, max_queue=8, prefill_chunk=5))
    try:
        _greedy_against_generate(engine, model, gen)
    finally:
        engine.shutdown(drain_s=0)


@pytest.mark.unit
def test_the_engine_runs_its_steps_with_its_own_threads(model):
    """The engine's thread sets its torch threads (``EngineConfig.threads``, default the
    process's when the engine is made), whatever the calling thread has: its events arrive on
    that thread with them; the calling thread's own threads are left as they were. The thread is
    a daemon (a process that never calls ``shutdown`` still exits) named ``moeflow-engine`` (what
    a thread dump or a log's ``%(threadName)s`` shows)."""
    before = torch.get_num_threads()
    seen: list[int] = []
    threads: set[tuple[str, bool]] = set()

    def on_event(event: Event) -> None:
        seen.append(torch.get_num_threads())
        threads.add((threading.current_thread().name, threading.current_thread().daemon))

    try:
        torch.set_num_threads(1)
        for config, want in ((EngineConfig(slots=1, threads=2), 2), (EngineConfig(slots=1), 1)):
            engine = Engine(model, config)
            engine.start()
            try:
                request = engine.submit(RequestSpec(prompt=(1, 2), max_tokens=2, temperature=0.0), on_event)
                request._done.wait(60)
            finally:
                engine.shutdown(drain_s=0)
            assert seen and set(seen) == {want}, (config, seen)
            assert torch.get_num_threads() == 1 and threads == {("moeflow-engine", True)}
            seen.clear()
    finally:
        torch.set_num_threads(before)


@pytest.mark.reference
def test_seeded_sampling_gives_generates_tokens_alone_and_in_a_mixed_batch(model, gen):
    """A sampled request (temperature, top-k, top-p, a seed) gives ``generate``'s tokens with a
    generator of that seed, alone and among greedy and other sampled requests; the greedy one
    among them (its row after a sampled one in the step) gives its greedy tokens, and one with a
    tight top-p only (hot, so the cut changes the draws) ``generate``'s with that top-p."""
    sampling = dict(temperature=0.9, top_k=12, top_p=0.95)
    prompts = _prompts(gen, [6, 11, 3, 8, 5])
    want = generate(model, [prompts[0]], 12, generator=torch.Generator().manual_seed(1234), **sampling).tokens[0]
    engine = Engine(model, EngineConfig(slots=4, prefill_chunk=4))
    engine.start()
    try:
        alone = Events()
        _wait([engine.submit(RequestSpec(prompt=prompts[0], max_tokens=12, seed=1234, **sampling), alone)])
        mixed = [Events() for _ in prompts]
        specs = [RequestSpec(prompt=prompts[2], max_tokens=15, seed=99, temperature=1.3),
                 RequestSpec(prompt=prompts[1], max_tokens=9, temperature=0),  # (a greedy row after a sampled one)
                 RequestSpec(prompt=prompts[0], max_tokens=12, seed=1234, **sampling),
                 RequestSpec(prompt=prompts[3], max_tokens=5, temperature=0.7),  # (drawn from the OS)
                 RequestSpec(prompt=prompts[4], max_tokens=10, seed=7, temperature=2.0, top_p=0.3)]
        _wait([engine.submit(s, e) for s, e in zip(specs, mixed)])
    finally:
        engine.shutdown(drain_s=0)
    assert alone.tokens == want and mixed[2].tokens == want
    assert mixed[0].tokens == generate(model, [prompts[2]], 15, temperature=1.3,
                                       generator=torch.Generator().manual_seed(99)).tokens[0]
    assert mixed[1].tokens == generate(model, [prompts[1]], 9, temperature=0).tokens[0]
    assert mixed[4].tokens == generate(model, [prompts[4]], 10, temperature=2.0, top_p=0.3,
                                       generator=torch.Generator().manual_seed(7)).tokens[0]


@pytest.mark.reference
def test_a_cancelled_request_frees_its_slot(model, gen):
    """One slot: a long request cancelled after its third token (from its own callback, on the
    engine thread) ends ``"cancelled"`` with no token after; the request waiting behind it gets
    the slot and ``generate``'s tokens; cancelling an ended request changes nothing."""
    prompts = _prompts(gen, [7, 4])
    engine = Engine(model, EngineConfig(slots=1, max_queue=2))
    holder: list[Request] = []
    first = Events(each=lambda e: len(first.tokens) == 3 and holder[0].cancel())
    second = Events()
    holder.append(engine.submit(RequestSpec(prompt=prompts[0], max_tokens=40, temperature=0), first))
    later = engine.submit(RequestSpec(prompt=prompts[1], max_tokens=6, temperature=0), second)
    engine.start()
    try:
        _wait([holder[0], later])
    finally:
        engine.shutdown(drain_s=0)
    assert first.reason == "cancelled" and len(first.tokens) == 3 and holder[0].finish_reason == "cancelled"
    assert second.reason == "length" and second.tokens == generate(model, [prompts[1]], 6, temperature=0).tokens[0]
    holder[0].cancel()
    assert first.reason == "cancelled"
    with pytest.raises(ValueError, match="reason must be one of"):
        later.cancel("bored")


@pytest.mark.unit
def test_submit_all_queues_every_request_or_none(model):
    """An answer's choices go in together or not at all: past the places left, ``submit_all``
    queues none (refused one by one, those already in held their places until the engine ended
    them, and a client's next request right after the 429 was refused too)."""
    engine = Engine(model, EngineConfig(slots=1, max_queue=1))
    spec = RequestSpec(prompt=(1, 2, 3), max_tokens=2, temperature=0)
    with pytest.raises(QueueFull, match=r"0 requests are running or waiting \(slots=1, max_queue=1\); 3 asked for"):
        engine.submit_all([(spec, Events()) for _ in range(3)])
    assert engine.stats().queued == 0 and engine.stats().rejected_total == 3
    events = [Events(), Events()]
    requests = engine.submit_all([(spec, e) for e in events])
    assert engine.stats().queued == 2 and [r.id for r in requests] == [1, 2]
    engine.start()
    _wait(requests)
    assert [e.reason for e in events] == ["length", "length"]
    engine.shutdown(drain_s=0)

@pytest.mark.reference
def test_queue_full_past_slots_and_max_queue_then_closed_after_shutdown(model):
    engine = Engine(model, EngineConfig(slots=2, max_queue=1))
    spec = RequestSpec(prompt=(1, 2, 3), max_tokens=2, temperature=0)
    events = [Events() for _ in range(3)]
    requests = [engine.submit(spec, e) for e in events]
    for _ in range(2):
        with pytest.raises(QueueFull, match=r"3 requests are running or waiting \(slots=2, max_queue=1\)"):
            engine.submit(spec, Events())
    assert engine.stats().queued == 3 and engine.stats().rejected_total == 2
    ids = [r.id for r in requests]  # (what the log names a request by; the oldest first is the lowest)
    assert ids == sorted(set(ids))
    engine.start()
    _wait(requests)
    assert [e.reason for e in events] == ["length"] * 3
    engine.submit(spec, Events()).wait(WAIT_S)  # room again
    engine.shutdown(drain_s=0)
    with pytest.raises(EngineClosed, match="^the engine is shutting down: no new request is admitted$"):
        engine.submit(spec, Events())


@pytest.mark.reference
def test_timeouts_end_running_and_queued_requests(model):
    """A running request whose callback takes 50 ms a token, with a 0.3 s timeout, ends
    ``"timeout"`` after a few tokens; the request queued behind it (one slot) with 0.1 s ends
    ``"timeout"`` without a token."""
    engine = Engine(model, EngineConfig(slots=1))
    slow, queued = Events(each=lambda e: time.sleep(0.05)), Events()
    requests = [engine.submit(RequestSpec(prompt=(5, 6, 7), max_tokens=40, temperature=0, timeout_s=0.3), slow),
                engine.submit(RequestSpec(prompt=(8,), max_tokens=4, temperature=0, timeout_s=0.1), queued)]
    engine.start()
    try:
        _wait(requests)
    finally:
        engine.shutdown(drain_s=0)
    assert slow.reason == "timeout" and 0 < len(slow.tokens) < 40
    assert queued.reason == "timeout" and queued.tokens == []
    assert engine.stats().finished == {"timeout": 2}


@pytest.mark.reference
def test_shutdown_ends_the_requests_in_flight_and_joins(model):
    """Two slots busy with slow requests and one waiting: ``shutdown(drain_s=0.2)`` ends the
    waiting one ``"shutdown"`` at once and the running ones ``"shutdown"`` after the drain (a
    short one finishes within it: ``"length"``); the thread is gone and nothing is admitted."""
    engine = Engine(model, EngineConfig(slots=2, max_queue=2))
    slow = [Events(each=lambda e: time.sleep(0.05)) for _ in range(2)]
    waiting = Events()
    short = RequestSpec(prompt=(3, 4), max_tokens=2, temperature=0)
    long = RequestSpec(prompt=(5, 6, 7), max_tokens=40, temperature=0)
    requests = [engine.submit(short, slow[0]), engine.submit(long, slow[1]), engine.submit(long, waiting)]
    engine.start()
    assert slow[1].first.wait(WAIT_S)
    engine.shutdown(drain_s=0.2)
    assert all(r.done for r in requests) and not engine._thread.is_alive()
    assert [slow[0].reason, slow[1].reason, waiting.reason] == ["length", "shutdown", "shutdown"]
    assert 0 < len(slow[1].tokens) < 40 and waiting.tokens == []
    with pytest.raises(EngineClosed):
        engine.submit(short, Events())
    engine.shutdown(drain_s=0)  # (again: nothing left to do)
    never = Engine(model, EngineConfig(slots=1))
    queued = Events()
    request = never.submit(short, queued)
    never.shutdown(drain_s=1)  # never started: the queued request still ends
    assert request.done and queued.reason == "shutdown"


@pytest.mark.reference
def test_a_step_that_raises_ends_its_requests_with_error_and_the_engine_goes_on(model, gen, monkeypatch):
    """A decode step that raises ends the two requests in it (``"error"``, the exception's
    text); a prefill that raises ends its request only; a callback that raises ends its own
    request. The requests after them get ``generate``'s tokens."""
    engine = Engine(model, EngineConfig(slots=2))
    fail = _plant_failures(model, monkeypatch, step=1)
    prompts = _prompts(gen, [4, 6, 5])
    spec = [RequestSpec(prompt=p, max_tokens=5, temperature=0) for p in prompts]
    broken = [Events(), Events()]
    both = [engine.submit(spec[0], broken[0]), engine.submit(spec[1], broken[1])]  # (one iteration prefills both)
    engine.start()
    try:
        _wait(both)
        assert [e.reason for e in broken] == ["error", "error"]
        assert all(len(e.tokens) == 1 and "planted step failure" in e.events[-1].detail for e in broken)
        fail["prefill"] = 1
        alone, after, raising = Events(), Events(), Events(each=lambda e: 1 / 0)
        _wait([engine.submit(spec[0], alone), engine.submit(spec[2], after), engine.submit(spec[1], raising)])
    finally:
        engine.shutdown(drain_s=0)
    assert alone.reason == "error" and "planted prefill failure" in alone.events[-1].detail
    assert after.reason == "length" and after.tokens == generate(model, [prompts[2]], 5, temperature=0).tokens[0]
    assert raising.reason == "error" and raising.events[-1].detail == "the request's event callback raised"
    assert engine.stats().running == 0


@pytest.mark.reference
def test_an_offloaded_model_gives_generates_tokens(model, gen):
    """Experts in an expert store (host home tier, a cache of half the experts), eager: three
    concurrent greedy requests give the in-memory model's ``generate`` tokens; compile is
    refused up front."""
    offloaded = copy.deepcopy(model)
    per_expert = slot_bytes(moeflow.moe_layers(offloaded)[0].experts, single=True)
    prompts = _prompts(gen, [5, 9, 2])
    want = [generate(model, [p], 8, temperature=0).tokens[0] for p in prompts]
    with offload_experts(offloaded, StorageConfig(offload="host", mode="cache", fast_memory=2 * per_expert)):
        with pytest.raises(ValueError, match="compile=True needs every MoE layer to hold GroupedExperts"):
            Engine(offloaded, EngineConfig(compile=True))
        engine = Engine(offloaded, EngineConfig(slots=4, prefill_chunk=4))
        engine.start()
        events = [Events() for _ in prompts]
        try:
            _wait([engine.submit(RequestSpec(prompt=p, max_tokens=8, temperature=0), e)
                   for p, e in zip(prompts, events)])
        finally:
            engine.shutdown(drain_s=0)
    assert [e.tokens for e in events] == want


@pytest.mark.unit
def test_bad_values_are_named(model):
    """``EngineConfig`` and ``RequestSpec`` fields on construction; what depends on the model
    at ``submit``; the step sizes (powers of two, and the slots)."""
    for bad, error, match in (
            (dict(slots=0), ValueError, "slots must be >= 1"),
            (dict(max_queue=-1), ValueError, "max_queue must be >= 0"),
            (dict(capacity=1), ValueError, "capacity must be >= 2"),
            (dict(prefill_chunk=0), ValueError, "prefill_chunk"),
            (dict(compile="yes"), TypeError, "compile must be a bool"),
            (dict(threads=0), ValueError, "threads must be >= 1"),
            (dict(slots=2.0), TypeError, "slots must be an int")):
        with pytest.raises(error, match=match):
            EngineConfig(**bad)
    ok = dict(prompt=(1, 2), max_tokens=3)
    for bad, error, match in (
            (dict(prompt=()), ValueError, "prompt must hold at least one token id"),
            (dict(prompt=(1, -2)), ValueError, "prompt: token ids must be >= 0, got -2"),
            (dict(prompt=(1, "a")), TypeError, "prompt holds str"),
            (dict(prompt="ab"), TypeError, "prompt must be"),
            (dict(max_tokens=0), ValueError, "max_tokens must be >= 1"),
            (dict(temperature=-0.5), ValueError, "temperature must be >= 0"),
            (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
            (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
            (dict(top_k=-1), ValueError, "top_k must be >= 0"),
            (dict(seed=-3), ValueError, "seed must be >= 0"), (dict(seed=2**63), ValueError, "seed must be < 2"),
            (dict(stop_ids=(True,)), TypeError, "stop_ids holds bool"),
            (dict(timeout_s=0), ValueError, "timeout_s must be > 0")):
        with pytest.raises(error, match=match):
            RequestSpec(**{**ok, **bad})
    assert RequestSpec(prompt=[4, 5], max_tokens=1, stop_ids=[3, 3]).stop_ids == frozenset({3})
    engine = Engine(model, EngineConfig(slots=1, capacity=10))
    assert engine.capacity == 10 and Engine(model, EngineConfig()).capacity == MAX_SEQ
    for bad, match in ((dict(prompt=(1, 61)), "prompt: token ids must be below the vocabulary size 61, got 61"),
                       (dict(stop_ids={70}), "stop_ids: token ids must be below"),
                       (dict(prompt=tuple(range(8)), max_tokens=3),
                        "max_tokens: the prompt's 8 tokens and max_tokens=3")):
        with pytest.raises(ValueError, match=match):
            engine.submit(RequestSpec(**{**ok, **bad}), Events())
    with pytest.raises(ValueError, match="capacity=49 exceeds the model's max_seq_len=48"):
        Engine(model, EngineConfig(capacity=MAX_SEQ + 1))
    assert Engine(model, EngineConfig(capacity=MAX_SEQ)).capacity == MAX_SEQ  # (the limit itself is taken)
    for bad in (-1, True, "1", float("nan")):
        with pytest.raises(ValueError, match="drain_s must be a number >= 0"):
            engine.shutdown(drain_s=bad)
    assert [step_sizes(n) for n in (1, 2, 5, 8)] == [(1,), (1, 2), (1, 2, 4, 5), (1, 2, 4, 8)]
    assert set(FINISH_REASONS) == {"stop", "length", "timeout", "cancelled", "shutdown", "error"}


@pytest.mark.reference
def test_slots_step_on_the_rows_they_need_and_read_nothing_on_the_host(model, gen, monkeypatch):
    """``Slots``: a step runs on the smallest size covering the highest decoding slot (a lone
    request in slot 0 on one row); prefill chunks and steps (greedy and sampled rows) read no
    tensor on the host (the engine reads an iteration's tokens once)."""
    from moeflow.models.decoding import SamplingConfig
    from moeflow.serve.slots import SlotRow, Slots

    from test_models_generation_compiled import SyncCounter

    slots = Slots(model, slots=5, capacity=32, compile=False)
    greedy, sampled = SamplingConfig(temperature=0), SamplingConfig(temperature=0.8, top_k=9, top_p=0.9)
    rows = [SlotRow(slot=0, prompt=tuple(_prompts(gen, [6])[0]), sampling=greedy, generator=None),
            SlotRow(slot=2, prompt=tuple(_prompts(gen, [3])[0]), sampling=sampled,
                    generator=torch.Generator().manual_seed(5))]
    sizes = []
    real = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda n, p, c: sizes.append((n.shape[0], c.batch)) or real(n, p, c))
    with torch.no_grad(), slots.open():
        assert [slots.size([SlotRow(slot=s, prompt=(1,), sampling=greedy, generator=None)]) for s in range(5)] == \
            [1, 2, 4, 4, 5]
        assert slots.prefill(rows[0], 4) == (4, None) and rows[0].filled == 4 and rows[0].prefilling
        seen = []
        with SyncCounter() as counter:
            taken, first = slots.prefill(rows[0], 4)
        seen += counter.seen
        rows[0].last = int(first)  # (the engine's one read of an iteration)
        with SyncCounter() as counter:
            tokens_R = slots.step(rows[:1], [rows[1]])
            _, first = slots.prefill(rows[1], 4)
        seen += counter.seen
        rows[0].last, rows[1].last = int(tokens_R[0]), int(first)
        with SyncCounter() as counter:
            tokens_R = slots.step(rows, [])
        assert seen + counter.seen == [] and taken == 2 and tokens_R.shape == (2,)
    assert sizes == [(1, 1), (4, 4)] and [r.filled for r in rows] == [8, 4]


def _iterations(engine: Engine):  # type: ignore[no-untyped-def]
    """The engine's loop run on this thread (as its own thread would: under ``no_grad``, in the
    slots' ``open``), an iteration at a time: yields after each, until no request is left (an
    iteration that starts with none, or ends them all before it admits, waits for a submission)."""
    with torch.no_grad(), engine._slots.open():
        while engine._rows or engine._pending:
            engine._iterate()
            yield


@pytest.mark.reference
def test_an_iteration_prefills_up_to_prefill_chunk_prompt_tokens_oldest_first(model, gen, monkeypatch):
    """Four requests in four slots, prompts of random lengths, a random ``prefill_chunk``: each
    iteration prefills the next ``prefill_chunk`` tokens of the prompts taken oldest first (the
    prompts' concatenation cut into chunks, each piece on its request's row behind the columns
    its earlier pieces filled); a prompt's last piece gives its first token in that iteration,
    and from then on each iteration's decode step gives it one more, up to ``max_tokens``: the
    tokens ``generate`` gives it alone."""
    chunk = int(torch.randint(2, 8, (1,), generator=gen))
    lengths = torch.randint(1, 12, (4,), generator=gen).tolist()
    maxes = torch.randint(1, 6, (4,), generator=gen).tolist()
    ids = torch.randperm(61, generator=gen).tolist()  # disjoint prompts: a chunk names its request
    starts = [sum(lengths[:i]) for i in range(4)]
    prompts = [ids[s:s + n] for s, n in zip(starts, lengths)]
    owner = {t: i for i, p in enumerate(prompts) for t in p}
    pieces: list[tuple[int, int, int]] = []  # (request, first column, tokens) of each prefill call
    real = model.forward_cached

    def prefill(idx, cache):  # type: ignore[no-untyped-def]
        chunk_ids = idx[0].tolist()
        who = owner[chunk_ids[0]]
        assert chunk_ids == prompts[who][cache.length:cache.length + len(chunk_ids)]
        pieces.append((who, cache.length, len(chunk_ids)))
        return real(idx, cache)

    monkeypatch.setattr(model, "forward_cached", prefill)
    engine = Engine(model, EngineConfig(slots=4, prefill_chunk=chunk))
    events = [Events() for _ in prompts]
    for p, n, e in zip(prompts, maxes, events):
        engine.submit(RequestSpec(prompt=p, max_tokens=n, temperature=0), e)
    per_iteration, counts = [], []
    for _ in _iterations(engine):
        per_iteration.append(pieces[:])
        pieces.clear()
        counts.append([len(e.tokens) for e in events])
    monkeypatch.undo()
    # the concatenation of the prompts (oldest first) cut every `chunk` tokens, and at each prompt's end
    flat = [(i, j) for i, n in enumerate(lengths) for j in range(n)]
    want: list[list[tuple[int, int, int]]] = []
    for at in range(0, len(flat), chunk):
        cut: list[tuple[int, int, int]] = []
        for i, j in flat[at:at + chunk]:
            if cut and cut[-1][0] == i:
                cut[-1] = (i, cut[-1][1], cut[-1][2] + 1)
            else:
                cut.append((i, j, 1))
        want.append(cut)
    assert per_iteration[:len(want)] == want and not any(per_iteration[len(want):])
    last = [max(k for k, cut in enumerate(want) if any(i == r for i, _, _ in cut)) for r in range(4)]
    for k, row in enumerate(counts):
        assert row == [min(max(0, k - last[r] + 1), maxes[r]) for r in range(4)], (k, counts, last)
    assert len(counts) == max(last[r] + maxes[r] for r in range(4))
    for p, n, e in zip(prompts, maxes, events):
        assert e.reason == "length" and e.tokens == generate(model, [p], n, temperature=0).tokens[0]


@pytest.mark.reference
def test_a_request_takes_the_lowest_free_slot_and_steps_cover_only_the_busy_ones(model, gen, monkeypatch):
    """Four slots (steps of 1, 2 or 4 rows): four requests take slots 0-3; once all but the one
    in slot 1 have ended, its steps run on two rows; a request submitted then takes slot 0 (the
    lowest free: still two rows), the next slot 2 (four rows), and with slot 1's request
    cancelled a lone request in slot 0 steps on one row. Every request gets ``generate``'s
    tokens."""
    sizes: list[int] = []
    real = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda n, p, c: sizes.append(n.shape[0]) or real(n, p, c))
    prompts = _prompts(gen, [3, 2, 4, 3, 2, 3, 2])
    engine = Engine(model, EngineConfig(slots=4, prefill_chunk=64))
    events = [Events() for _ in range(7)]

    def submit(i: int, max_tokens: int) -> Request:
        return engine.submit(RequestSpec(prompt=prompts[i], max_tokens=max_tokens, temperature=0), events[i])

    def ended() -> list[bool]:
        return [any(e.finish_reason for e in ev.events) for ev in events]

    requests = [submit(0, 2), submit(1, 30), submit(2, 2), submit(3, 2)]
    loop = _iterations(engine)
    next(loop)  # admitted and prefilled: a token each
    next(loop)  # a step of the four rows: requests 0, 2 and 3 end
    assert sizes == [4] and ended()[:4] == [True, False, True, True]
    next(loop)
    assert sizes[1:] == [2]  # slot 1 alone: two rows
    submit(4, 3)  # slot 0
    next(loop)  # its prefill while slot 1 steps
    next(loop)
    assert sizes[2:] == [2, 2]
    submit(5, 2)  # slot 2
    next(loop)  # its prefill while slots 0 and 1 step
    next(loop)
    assert sizes[4:] == [2, 4] and ended()[4:6] == [True, True]
    requests[1].cancel()
    submit(6, 3)  # (an iteration with nothing left would wait for a submission)
    before = len(sizes)
    for _ in loop:
        pass
    assert sizes[before:] == [1, 1]  # a lone request in slot 0: one row
    assert events[1].reason == "cancelled"
    for i, (p, e) in enumerate(zip(prompts, events)):
        assert e.reason == ("cancelled" if i == 1 else "length")
        assert e.tokens == generate(model, [p], len(e.tokens), temperature=0).tokens[0]


@pytest.mark.reference
def test_stats_count_what_ran(model, gen, monkeypatch):
    """Five requests in three slots, each token's callback sleeping ``nap`` seconds: while the
    first token goes out three run and two wait; afterwards the counts add up (every decoded row
    gave a token, a request's first comes from its prefill; a step is a call of the model's
    decode step), and the times are the requests' own: each time to first token within the
    test's clock readings around it, each time between two tokens at least the nap and the sums
    at most the requests' lifetimes."""
    nap = 0.01
    lengths = torch.randint(1, 10, (5,), generator=gen).tolist()
    maxes = torch.randint(2, 6, (5,), generator=gen).tolist()
    prompts = _prompts(gen, lengths)
    chunk = int(torch.randint(1, 30, (1,), generator=gen))
    engine = Engine(model, EngineConfig(slots=3, max_queue=4, prefill_chunk=chunk))
    snapshots, clocks = [], [[] for _ in prompts]
    steps = []
    real = model.decode_step
    monkeypatch.setattr(model, "decode_step", lambda n, p, c: steps.append(n.shape[0]) or real(n, p, c))

    def each(i: int):  # type: ignore[no-untyped-def]
        def on(event: Event) -> None:
            clocks[i].append(time.monotonic())
            if not snapshots:
                snapshots.append(engine.stats())
            time.sleep(nap)
        return on

    events = [Events(each=each(i)) for i in range(5)]
    submitted = []
    requests = []
    for i, (p, n) in enumerate(zip(prompts, maxes)):
        submitted.append(time.monotonic())
        requests.append(engine.submit(RequestSpec(prompt=p, max_tokens=n, temperature=0), events[i]))
    engine.start()
    try:
        _wait(requests)
    finally:
        engine.shutdown(drain_s=0)
    first = snapshots[0]
    assert (first.slots, first.running, first.queued, first.requests_total) == (3, 3, 2, 5)
    stats = engine.stats()
    assert (stats.slots, stats.running, stats.queued, stats.rejected_total) == (3, 0, 0, 0)
    assert stats.finished == {"length": 5} and stats.generated_tokens_total == sum(maxes)
    assert stats.ttft_count == 5 and stats.itl_count == sum(maxes) - 5
    assert stats.busy_rows_total == sum(maxes) - 5  # every other token from a decode step
    assert stats.steps_total == len(steps) >= max(maxes) - 1
    ttft_low = sum(r.first_token_at - r.submitted_at for r in requests)
    assert stats.ttft_sum_s == pytest.approx(ttft_low)
    assert sum(c[0] - s for c, s in zip(clocks, submitted)) >= stats.ttft_sum_s > 0
    itl = sum(r.last_token_at - r.first_token_at for r in requests)
    assert stats.itl_sum_s == pytest.approx(itl) and stats.itl_sum_s >= nap * stats.itl_count
    assert stats.itl_sum_s <= sum(c[-1] - c[0] for c in clocks)


@pytest.mark.reference
def test_an_engine_that_fails_to_start_says_why_and_ends_its_queued_requests(model, monkeypatch, caplog):
    """The cache cannot be made: ``start`` raises with the cause, the requests queued before
    end ``"error"`` with it, the engine admits nothing more, and the log says the engine
    stopped, with the traceback."""
    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("planted cache failure")

    monkeypatch.setattr(model, "new_cache", broken)
    engine = Engine(model, EngineConfig(slots=1, max_queue=2))
    events = [Events(), Events()]
    requests = [engine.submit(RequestSpec(prompt=(1, 2), max_tokens=3, temperature=0), e) for e in events]
    with caplog.at_level("ERROR", logger="moeflow.serve.engine"):
        with pytest.raises(RuntimeError, match="the engine failed to start: planted cache failure") as caught:
            engine.start()
    assert isinstance(caught.value.__cause__, RuntimeError) and str(caught.value.__cause__) == "planted cache failure"
    assert all(r.done for r in requests) and not engine._thread.is_alive()
    assert [(e.reason, e.events[-1].detail) for e in events] == \
        [("error", "the engine stopped: planted cache failure")] * 2
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == \
        [("moeflow serve: the engine stopped", True)]
    with pytest.raises(EngineClosed):
        engine.submit(RequestSpec(prompt=(1, 2), max_tokens=3, temperature=0), Events())
    engine.shutdown(drain_s=0)  # (only joins)


@pytest.mark.reference
def test_what_fails_is_logged_with_its_traceback_and_the_engine_goes_on(model, gen, monkeypatch, caplog):
    """Each failure the engine survives is logged at ERROR with its traceback, saying what
    failed: a prefill, a decode step, a request's callback (with the request's id), an iteration
    outside them (a step's tokens that cannot be read: every running request ends ``"error"``
    with the exception's type and text). The request after each gets ``generate``'s tokens."""
    prompts = _prompts(gen, [3, 4, 5])
    fail = _plant_failures(model, monkeypatch)
    engine = Engine(model, EngineConfig(slots=1))
    spec = RequestSpec(prompt=prompts[0], max_tokens=4, temperature=0)
    want = generate(model, [prompts[0]], 4, temperature=0).tokens[0]
    caplog.set_level("ERROR", logger="moeflow.serve.engine")
    engine.start()
    seen = []
    try:
        for planted, reason in ((("prefill", 1), "RuntimeError: planted prefill failure"),
                                (("step", 1), "RuntimeError: planted step failure"),
                                (None, "the request's event callback raised"),
                                ("tokens", "IndexError")):
            first = Events(each=(lambda e: 1 / 0) if planted is None else None)
            if planted == "tokens":
                monkeypatch.setattr(engine._slots, "sample", lambda logits, rows: torch.zeros(0, dtype=torch.long))
            elif planted is not None:
                fail[planted[0]] = planted[1]
            request = engine.submit(spec, first)
            assert request.wait(WAIT_S) and first.reason == "error" and first.events[-1].detail.startswith(reason)
            monkeypatch.setattr(engine._slots, "sample", Slots.sample)
            after = Events()
            assert engine.submit(spec, after).wait(WAIT_S) and after.reason == "length" and after.tokens == want
            seen.append([(r.getMessage().replace(f" {request.id}'s", " N's"), r.exc_info is not None)
                         for r in caplog.records])
            caplog.clear()
    finally:
        engine.shutdown(drain_s=0)
    assert seen == [[("moeflow serve: a prefill failed", True)], [("moeflow serve: a decode step failed", True)],
                    [("moeflow serve: request N's event callback raised", True)] * 2,  # (its final event's too)
                    [("moeflow serve: an iteration failed", True)]]


@pytest.mark.reference
def test_an_engine_that_breaks_mid_run_ends_every_request_it_holds(model, gen, caplog):
    """Something outside a request's own work raises past the engine's handlers while it runs
    (here a callback raising a ``BaseException``, which the engine does not take for the
    request's own error): the engine stops, the requests running (both slots) and waiting end
    ``"error"`` saying so, nothing more is admitted, and the log says the engine stopped."""

    class Broken(BaseException):
        pass

    def breaks(event: Event) -> None:
        if event.token is not None:
            raise Broken("planted break")

    prompts = _prompts(gen, [3, 4, 2])
    engine = Engine(model, EngineConfig(slots=2, max_queue=2))

    class Late(threading.Event):  # start() looks only after the engine broke: a break once serving is
        def wait(self, timeout=None):  # no failure to start (this raced: start raised it now and then)
            super().wait(timeout)
            engine._thread.join(WAIT_S)
            return True

    engine._started = Late()
    events = [Events(each=breaks), Events(), Events()]
    requests = [engine.submit(RequestSpec(prompt=p, max_tokens=5, temperature=0), e) for p, e in zip(prompts, events)]
    with caplog.at_level("ERROR", logger="moeflow.serve.engine"):
        engine.start()
        _wait(requests)
        engine._thread.join(WAIT_S)
    assert not engine._thread.is_alive()
    assert [(e.reason, e.events[-1].detail) for e in events] == [("error", "the engine stopped: planted break")] * 3
    assert [len(e.tokens) for e in events] == [1, 0, 0]  # (the break came with the first token delivered)
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == \
        [("moeflow serve: the engine stopped", True)]
    assert engine.stats().running == engine.stats().queued == 0
    with pytest.raises(EngineClosed):
        engine.submit(RequestSpec(prompt=(1,), max_tokens=1, temperature=0), Events())
    engine.shutdown(drain_s=0)


@pytest.mark.reference
def test_a_failed_prefill_costs_the_prompts_behind_it_nothing(model, gen, monkeypatch):
    """The oldest of three prompts fails its prefill: it ends ``"error"`` and the two behind it
    are prefilled in the same iteration (each has its first token after it), then get
    ``generate``'s tokens."""
    prompts = _prompts(gen, [4, 3, 5])
    real = model.forward_cached
    bad = tuple(prompts[0])

    def prefill(idx, cache):  # type: ignore[no-untyped-def]
        if tuple(idx[0].tolist()) == bad:
            raise RuntimeError("planted prefill failure")
        return real(idx, cache)

    monkeypatch.setattr(model, "forward_cached", prefill)
    engine = Engine(model, EngineConfig(slots=3, prefill_chunk=64))
    events = [Events() for _ in prompts]
    for p, e in zip(prompts, events):
        engine.submit(RequestSpec(prompt=p, max_tokens=3, temperature=0), e)
    loop = _iterations(engine)
    next(loop)
    assert events[0].reason == "error" and [len(e.tokens) for e in events] == [0, 1, 1]
    for _ in loop:
        pass
    monkeypatch.undo()
    for p, e in zip(prompts[1:], events[1:]):
        assert e.reason == "length" and e.tokens == generate(model, [p], 3, temperature=0).tokens[0]
