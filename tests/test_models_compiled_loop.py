"""The compiled decoder's host side (``moeflow.models.compiled_decode``) with the step left
uncompiled: ``torch.compile`` is replaced by one that records what it was asked for and returns
the function, so ``generate(..., compile=True)`` runs its own loop (the power-of-two cache, rows
kept after their stop token, stop tokens checked on the device every ``STOP_CHECK_EVERY``
steps, the sliding window), its caches per shape and traced state, the packed stand-ins and the
head's product around the eager static step, in a second and without dynamo.

``tests/test_models_generation_compiled.py`` holds the same loop to the eager one with inductor
(tens of seconds a shape here); this file is what ``make mutation`` runs the module's mutants
against (mutmut's coverage pass records its calls through a ``ContextVar`` that dynamo cannot
trace, so the compiling tests skip there and covered nothing)."""

from __future__ import annotations

import pytest
import torch

import moeflow.models.compiled_decode as compiled_decode
import moeflow.models.packed_dense as packed_dense
from moeflow import ModuleExperts, RouterConfig
from moeflow.experts import GroupedExperts
from moeflow.experts.packed import PackedCPUExperts
from moeflow.kernels import packed_cpu
from moeflow.layer.moe import moe_layers
from moeflow.models.compiled_decode import STOP_CHECK_EVERY, HeadProduct, _bucket, compiled_decoder
from moeflow.models.generation import generate
from moeflow.models.packed_dense import PackedCPULinear

from helpers import small_gpt

MAX_SEQ = 16


@pytest.fixture
def compiles(monkeypatch) -> list[tuple[object, dict]]:
    """``torch.compile`` as the decoders see it: records ``(function, options)`` and returns the
    function itself (the step runs eagerly); and no packed kernel (its OpenMP few-row products
    cost more than the whole eager step on a loaded machine; one test puts it back)."""
    calls: list[tuple[object, dict]] = []

    def record(fn, **kw):  # type: ignore[no-untyped-def]
        calls.append((fn, kw))
        return fn

    monkeypatch.setattr(compiled_decode.torch, "compile", record)
    monkeypatch.setattr(compiled_decode, "packed_cpu_available", lambda: False)
    monkeypatch.setattr(packed_dense, "packed_cpu_available", lambda: False)
    return calls


def _model(gen: torch.Generator, **kw: object):  # type: ignore[no-untyped-def]
    """A small fp32 MoE GPT with weights drawn wide (std 0.3: greedy picks far from ties)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    m = small_gpt(**{"max_seq_len": MAX_SEQ, **kw}).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return m


def _prompts(gen: torch.Generator, lengths: list[int]) -> list[list[int]]:
    return [torch.randint(0, 61, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.reference
def test_the_compiled_loop_gives_the_eager_loops_tokens(gen, compiles):
    """Greedy for one row and a left-padded batch of random lengths, seeded sampling (the same
    draws: no row leaves either loop), stop tokens that end rows at different steps (one
    before the host's first look, one after), one new token, none, a window that slides past
    ``max_seq_len`` and a prompt longer than it (cut to its last window, beside a padded
    one): the eager loop's tokens and token counts every time."""
    m = _model(gen)
    one, batch, long = _prompts(gen, [5]), _prompts(gen, [6, 2, 4]), _prompts(gen, [MAX_SEQ + 3, 5])
    for prompts, n in ((one, 11), (batch, 11), (batch, 1), (batch, 0), (batch, MAX_SEQ + 4), (long, 4)):
        eager, compiled = (generate(m, prompts, n, temperature=0, compile=c) for c in (False, True))
        assert compiled.tokens == eager.tokens and len(compiled.tokens) == len(prompts)
        assert (compiled.prefill_tokens, compiled.decode_tokens) == (eager.prefill_tokens, eager.decode_tokens)
        if n == 0:  # nothing run, nothing timed
            assert compiled == eager and (compiled.prefill_s, compiled.decode_s) == (0.0, 0.0)
    sampling = dict(temperature=0.9, top_k=12, top_p=0.95)
    eager, compiled = (generate(m, batch, 11, generator=torch.Generator().manual_seed(7), compile=c, **sampling)
                       for c in (False, True))
    assert compiled.tokens == eager.tokens
    greedy = generate(m, batch, 11, temperature=0).tokens
    stop = [greedy[0][2], greedy[2][STOP_CHECK_EVERY + 1]]  # row 0 stops early, row 2 after a host look
    eager, compiled = (generate(m, batch, 11, temperature=0, eos=stop, compile=c) for c in (False, True))
    assert compiled.tokens == eager.tokens and len(compiled.tokens[0]) <= 3
    assert compiled.decode_tokens == eager.decode_tokens == sum(map(len, eager.tokens)) - 3


@pytest.mark.reference
def test_every_row_stopping_ends_the_loop_at_the_hosts_next_look(gen, compiles, monkeypatch):
    """When every row has produced a stop token the loop stops at the next multiple of
    ``STOP_CHECK_EVERY`` steps (the host's look), not before (no read inside a step) and not at
    ``max_new_tokens``; until every row stopped it goes on."""
    m = _model(gen)
    batch = _prompts(gen, [3, 5])
    n = 2 * STOP_CHECK_EVERY + 3
    greedy = generate(m, batch, n, temperature=0).tokens
    steps: list[int] = []
    real = compiled_decode.sample_next
    monkeypatch.setattr(compiled_decode, "sample_next", lambda *a: steps.append(1) or real(*a))
    # every row's first token stops it: the host looks after STOP_CHECK_EVERY steps
    out = generate(m, batch, n, temperature=0, eos=[r[0] for r in greedy], compile=True)
    assert out.tokens == [r[:1] for r in greedy] and len(steps) == STOP_CHECK_EVERY
    steps.clear()
    out = generate(m, batch, n, temperature=0, eos=[greedy[0][0]], compile=True)  # row 1 goes on
    assert len(steps) == n or greedy[0][0] in greedy[1]
    # without stop tokens nothing is checked (no isin, no host look), with them every step but the last
    looks: list[int] = []
    real_isin = torch.isin
    monkeypatch.setattr(torch, "isin", lambda *a, **kw: looks.append(1) or real_isin(*a, **kw))
    assert generate(m, batch, n, temperature=0, compile=True).tokens == greedy and looks == []
    generate(m, batch, 5, temperature=0, eos=[60], compile=True)
    assert len(looks) == 4


@pytest.mark.unit
def test_the_decoder_asks_for_one_static_graph_of_the_step_and_keeps_one_per_model(gen, compiles):
    """On the CPU with a plain bias-free head the decoder compiles ``decode_hidden`` (the head
    is multiplied after it by a ``HeadProduct``) as one graph of static shapes with inductor's
    C++ wrapper and no CUDA-graph mode; a head with a bias keeps the whole ``decode_step`` in
    the graph. One decoder per model until its head changes kind or it moves."""
    m = _model(gen)
    decoder = compiled_decoder(m)
    assert compiled_decoder(m) is decoder and len(compiles) == 1 and isinstance(decoder.head, HeadProduct)
    fn, kw = compiles[0]
    assert fn == m.decode_hidden
    assert kw == dict(fullgraph=True, dynamic=False, mode=None, options={"cpp_wrapper": True})
    assert decoder.device == torch.device("cpu") and not decoder.cuda and decoder.compilations == 0
    assert decoder.caches == {} and decoder.state is None and decoder.max_caches == 4
    m.lm_head = torch.nn.Linear(m.config.dim, m.config.vocab_size, bias=True)
    second = compiled_decoder(m)
    assert second is not decoder and second.head is None and compiles[1][0] == m.decode_step
    m.lm_head = torch.nn.Linear(m.config.dim, m.config.vocab_size, bias=False)
    assert isinstance(compiled_decoder(m).head, HeadProduct) and len(compiles) == 3
    m.to("meta")  # another device: a new decoder, with the head in the graph and no C++ wrapper
    assert compiled_decoder(m).device == torch.device("meta") and compiled_decoder(m).head is None
    assert compiles[-1] == (m.decode_step, dict(fullgraph=True, dynamic=False, mode=None, options=None))


@pytest.mark.unit
def test_cache_capacities_are_the_smallest_power_of_two_of_at_least_16_within_the_window(gen):
    for _ in range(200):
        columns, window = (int(v) for v in torch.randint(1, 700, (2,), generator=gen))
        want = min(window, next(c for c in (2 ** i for i in range(4, 12)) if c >= columns))
        assert _bucket(columns, window) == want, (columns, window)
    assert [_bucket(n, 64) for n in (1, 15, 16, 17, 32, 33, 64, 65)] == [16, 16, 16, 32, 32, 64, 64, 64]


@pytest.mark.reference
def test_caches_are_kept_per_shape_and_state_and_the_least_recently_used_go(gen, compiles):
    """A cache (and a warm-up: ``compilations``) per batch size, bucketed capacity and traced
    state, reused by later calls of those (zeroed: the same tokens again); a model put in
    training mode or another dtype is a new state; at most ``max_caches`` are kept, the least
    recently used going first."""
    m = _model(gen, max_seq_len=32)
    decoder = compiled_decoder(m)
    first = generate(m, _prompts(gen, [4, 2]), 10, temperature=0, compile=True)  # 15 columns: 16
    assert decoder.compilations == 1 and [k[:2] for k in decoder.caches] == [(2, 16)]
    cache = next(iter(decoder.caches.values()))
    prompts = _prompts(gen, [4, 3])
    # 4 + 13 - 1 = 16 columns ever fed (the last token is never fed): the same cache
    assert generate(m, prompts, 13, temperature=0, compile=True).tokens == generate(m, prompts, 13, temperature=0).tokens
    assert decoder.compilations == 1 and next(iter(decoder.caches.values())) is cache
    for B, n, count in ((1, 10, 2), (3, 10, 3), (2, 20, 4), (1, 20, 5)):  # capacities 16, 16, 32, 32
        generate(m, _prompts(gen, [4] * B), n, temperature=0, compile=True)
        assert decoder.compilations == count
    assert [k[:2] for k in decoder.caches] == [(1, 16), (3, 16), (2, 32), (1, 32)]  # (2, 16) went first
    generate(m, _prompts(gen, [4]), 10, temperature=0, compile=True)  # used again: last in line
    assert [k[:2] for k in decoder.caches] == [(3, 16), (2, 32), (1, 32), (1, 16)] and decoder.compilations == 5
    m.train()
    generate(m, _prompts(gen, [4]), 10, temperature=0, compile=True)
    m.eval()
    assert decoder.compilations == 6 and [k[:2] for k in decoder.caches][-1] == (1, 16) and len(decoder.caches) == 4
    states = {k[2] for k in decoder.caches if k[:2] == (1, 16)}
    assert len(states) == 2 and all(s[0] == torch.float32 for s in states)  # eval and training
    m.double()
    generate(m, _prompts(gen, [4]), 10, temperature=0, compile=True)
    assert decoder.compilations == 7 and list(decoder.caches)[-1][2][0] == torch.float64


@pytest.mark.reference
def test_a_step_in_training_mode_follows_the_eager_loop_and_warm_ups_change_no_buffer(gen, compiles):
    """An aux-loss-free router adds to its balance counters in training mode: the compiled loop
    leaves them as the eager loop does (its warm-ups put every buffer back), with the eager
    loop's tokens."""
    m = _model(gen, router=RouterConfig(bias_update_rate=0.01)).train()
    counters = [layer.router.load_counts for layer in moe_layers(m)]
    prompts = _prompts(gen, [6, 2, 4])
    runs = []
    for compile in (False, True):
        for c in counters:
            c.zero_()
        runs.append((generate(m, prompts, 9, temperature=0, compile=compile).tokens, [c.clone() for c in counters]))
    (eager, eager_counts), (compiled, compiled_counts) = runs
    assert compiled == eager and all(int(c.sum()) > 0 for c in eager_counts)
    assert all(torch.equal(a, b) for a, b in zip(compiled_counts, eager_counts))


@pytest.mark.reference
def test_a_generation_puts_packed_stand_ins_in_place_and_every_module_back(gen, compiles, monkeypatch):
    """On the CPU, for the length of a generation, every MoE layer's experts are a
    ``PackedCPUExperts`` and every plain fp32 linear but the head a ``PackedCPULinear`` (the
    same stand-ins, packed again, on the next call; the head's weight copied into the
    ``HeadProduct`` and dropped after); afterwards the model holds its own modules again, also
    when the generation fails; experts that change between calls are followed."""
    import moeflow.experts.packed as packed

    m = _model(gen)
    decoder = compiled_decoder(m)
    modules = dict(m.named_modules())
    with torch.no_grad(), decoder.generation(m):  # where the kernel does not build, nothing is packed
        assert dict(m.named_modules()) == modules and decoder.stand_ins == {} and decoder.linear_stand_ins == {}
    if packed_cpu._compiler() is None:
        pytest.skip("no C++ compiler: nothing is packed")
    for module in (compiled_decode, packed_dense):
        monkeypatch.setattr(module, "packed_cpu_available", packed_cpu.packed_cpu_available)
    linears = [n for n, mod in modules.items() if type(mod) is torch.nn.Linear and mod is not m.lm_head]
    experts = [layer.experts for layer in moe_layers(m)]
    seen: list[dict] = []
    with torch.no_grad(), decoder.generation(m):
        now = dict(m.named_modules())
        assert all(isinstance(now[n], PackedCPULinear) for n in linears) and now["lm_head"] is m.lm_head
        assert all(isinstance(layer.experts, PackedCPUExperts) for layer in moe_layers(m))
        assert decoder.head.packed is not None and decoder.head.weight_VD is m.lm_head.weight
        assert decoder.state is not None
        seen += [dict(decoder.stand_ins), dict(decoder.linear_stand_ins)]
        assert set(seen[1]) == set(linears) and all(now[n] is seen[1][n] for n in linears)
    assert dict(m.named_modules()) == modules and decoder.head.packed is None and decoder.state is None
    with pytest.raises(RuntimeError, match="inside"), decoder.generation(m):
        raise RuntimeError("inside")
    assert dict(m.named_modules()) == modules and decoder.head.packed is None
    # kept between generations: the same objects (the compiled step reads their buffers)
    assert decoder.stand_ins == seen[0] and decoder.linear_stand_ins == seen[1]
    assert all(decoder.linear_stand_ins[n] is seen[1][n] for n in linears)
    prompts = _prompts(gen, [6, 2, 4])
    before = generate(m, prompts, 6, temperature=0).tokens
    assert generate(m, prompts, 6, temperature=0, compile=True).tokens == before  # (its warm-up: 1 step)
    calls = []
    real = packed.packed_grouped_mm
    monkeypatch.setattr(packed, "packed_grouped_mm", lambda *a: calls.append(1) or real(*a))
    assert generate(m, prompts, 6, temperature=0, compile=True).tokens == before
    assert len(calls) == 2 * len(experts) * (1 + 5)  # the prefill and 5 steps, two products each
    w_in = experts[-1].w_in
    with torch.no_grad():
        w_in.data.copy_(w_in.roll(1, dims=0))  # the experts trade weights (no version moves)
    eager = generate(m, prompts, 6, temperature=0).tokens
    assert eager != before and generate(m, prompts, 6, temperature=0, compile=True).tokens == eager
    # experts no longer packable (a subclass may compute something else): theirs stay and their
    # stand-ins go; the linears are still packed (the same stand-ins); a linear no longer
    # packable keeps its own module and its stand-in goes
    for e in experts:
        e.__class__ = type("OwnGroupedExperts", (GroupedExperts,), {})
    first = linears[0]
    parent, _, attr = first.rpartition(".")
    own = type("OwnLinear", (torch.nn.Linear,), {})(m.config.dim, m.config.dim)
    setattr(m.get_submodule(parent), attr, own)
    with torch.no_grad(), decoder.generation(m):
        now = dict(m.named_modules())
        assert [layer.experts for layer in moe_layers(m)] == experts and decoder.stand_ins == {}
        assert now[first] is own and first not in decoder.linear_stand_ins
        assert all(now[n] is seen[1][n] for n in linears[1:])


@pytest.mark.unit
def test_the_packed_kernel_is_built_before_the_clock_starts_and_only_when_something_packs(gen, compiles,
                                                                                        monkeypatch):
    """The packed kernel's build (``packed_cpu_available``: seconds, once per machine) is asked
    for before a generation's clock first reads, not inside the timed prefill, whenever
    anything can be packed: the head, the experts or a linear (here: fp32 linears with a
    bias-free head, and with a head with a bias beside experts of one's own); a model with
    nothing to pack (fp64 weights, a head with a bias) never asks."""
    events: list[str] = []
    monkeypatch.setattr(compiled_decode, "packed_cpu_available", lambda: events.append("build") and False)

    def clock() -> float:
        events.append("clock")
        return float(len(events))

    plain = _model(gen)
    biased = _model(gen)
    biased.lm_head = torch.nn.Linear(biased.config.dim, biased.config.vocab_size, bias=True)
    for layer in moe_layers(biased):
        layer.experts.__class__ = type("OwnGroupedExperts", (GroupedExperts,), {})  # (not packable)
    nothing = _model(gen).double()
    nothing.lm_head = torch.nn.Linear(nothing.config.dim, nothing.config.vocab_size, bias=True, dtype=torch.float64)
    for m, builds in ((plain, True), (biased, True), (nothing, False)):
        events.clear()
        out = generate(m, [[1, 2, 3]], 3, temperature=0, compile=True, clock=clock)
        assert out.tokens == generate(m, [[1, 2, 3]], 3, temperature=0).tokens
        assert (events[0] == "build") == builds and ("build" in events) == builds, events


@pytest.mark.unit
def test_the_prefill_time_holds_the_packing_and_the_decode_time_the_rest(gen, compiles):
    """``clock`` reads five times: around the packing (counted in the prefill), at the prefill's
    start, after the first token (the prefill's end) and at the end (the decode's)."""
    m = _model(gen)
    generate(m, [[1, 2]], 3, temperature=0, compile=True)  # (compiled and warm: not timed anyway)
    ticks = iter(range(10, 1000, 10))
    readings: list[float] = []

    def clock() -> float:
        readings.append(float(next(ticks)))
        return readings[-1]

    out = generate(m, [[3, 4]], 3, temperature=0, compile=True, clock=clock)
    assert readings == [10.0, 20.0, 30.0, 40.0, 50.0]
    assert (out.prefill_s, out.decode_s) == ((20 - 10) + (40 - 30), 50 - 40)


@pytest.mark.unit
def test_the_first_step_of_every_generation_runs_the_guards_in_full(gen, compiles, monkeypatch):
    """Dynamo's guards are skipped on every compiled step but a generation's first, which runs
    them (a change the traced state does not name recompiles there, not silently replays)."""
    m = _model(gen)
    decoder = compiled_decoder(m)
    guarded: list[bool] = []
    real = decoder.run
    monkeypatch.setattr(decoder, "run", lambda *a, **kw: guarded.append(kw["guarded"]) or real(*a, **kw))
    for n in (5, 3):
        generate(m, [[1, 2, 3]], n, temperature=0, compile=True)
    assert guarded == [True, False, False, False] + [True, False]


@pytest.mark.unit
def test_steps_that_cannot_be_one_graph_and_experts_of_ones_own_are_refused(gen, compiles, monkeypatch):
    """Experts of one's own in any MoE layer are refused up front naming the layer, prompts
    outside the vocabulary naming the id; a step
    whose tracing fails is a ``ValueError`` naming ``compile`` and the first line of dynamo's
    error; ``cache`` and ``slot_cache`` outside ``generation`` are errors."""
    m = _model(gen)
    layers = moe_layers(m)
    i = int(torch.randint(0, len(layers), (1,), generator=gen))
    own = layers[i].experts
    layers[i].experts = ModuleExperts([torch.nn.Linear(m.config.dim, m.config.dim) for _ in range(own.num_experts)])
    with pytest.raises(ValueError, match=f"compile=True needs .* MoE layer {i} has ModuleExperts with LocalDispatcher"):
        generate(m, [[1, 2]], 3, temperature=0, compile=True)
    layers[i].experts = own
    for prompts in ([[1, 61]], torch.tensor([[4, 61]])):  # prompts are checked against the vocabulary
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 61\), got 61"):
            generate(m, prompts, 3, temperature=0, compile=True)
    decoder = compiled_decoder(m)

    def untraceable(*args):  # type: ignore[no-untyped-def]
        raise torch._dynamo.exc.Unsupported("a host read\nof a tensor")

    monkeypatch.setattr(decoder, "step", untraceable)
    with pytest.raises(ValueError, match=r"does not compile as one graph \(a host read\); generate without compile"):
        generate(m, [[1, 2]], 3, temperature=0, compile=True)
    assert decoder.compilations == 0
    for call in (lambda: decoder.cache(m, torch.zeros(1, dtype=torch.long), 16),
                 lambda: decoder.slot_cache(m, 2, 16, (1,))):
        with pytest.raises(RuntimeError, match="inside CompiledDecoder.generation"):
            call()


@pytest.mark.reference
def test_slot_caches_step_each_row_view_like_the_eager_step(gen, compiles):
    """``slot_cache``: a zeroed cache of the slots, no row padded, a row view per size warmed up
    with a column per row (the cache zeroed again after); steps on a view with ``pos [n]``
    give the eager step's logits and write only its rows."""
    m = _model(gen)
    decoder = compiled_decoder(m)
    with torch.no_grad(), decoder.generation(m):
        cache, views = decoder.slot_cache(m, 4, MAX_SEQ, (1, 3))
        assert set(views) == {1, 3} and [views[n].batch for n in (1, 3)] == [1, 3] and decoder.compilations == 2
        assert cache.batch == 4 and cache.capacity == MAX_SEQ and cache.pad_B.eq(0).all()
        assert all(t.eq(0).all() for t in (*cache.k, *cache.v)) and decoder.caches == {}
        ref = m.new_cache(torch.zeros(3, dtype=torch.long), MAX_SEQ, zeroed=True)
        lens = [5, 2, 7]
        for s, n in enumerate(lens):
            p = torch.randint(0, 61, (1, n), generator=gen)
            for c in (cache, ref):
                m.forward_cached(p, c.rows(s, s + 1))
        next_B, pos_B = torch.randint(0, 61, (3,), generator=gen), torch.tensor(lens)
        for step in range(4):
            got = decoder.run(next_B, pos_B, views[3], guarded=step == 0)
            want = m.decode_step(next_B, pos_B, ref)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
            next_B, pos_B = want.argmax(-1), pos_B + 1
        assert all(t[3].eq(0).all() for t in (*cache.k, *cache.v))


@pytest.mark.reference
def test_the_compiled_loop_makes_its_tensors_on_the_models_device(gen, compiles):
    """With ``meta`` as the default device a CPU model's compiled generation gives the tokens it
    gives without it (greedy and sampled, stop tokens, the window sliding): every tensor the
    loop and its caches make names the model's device."""
    m = _model(gen)
    batch = _prompts(gen, [6, 2, 4])

    def run() -> list:  # type: ignore[type-arg]
        greedy = generate(m, batch, MAX_SEQ + 3, temperature=0, compile=True).tokens
        sampled = generate(m, batch, 5, temperature=0.8, top_k=9, generator=torch.Generator().manual_seed(3),
                           compile=True).tokens
        return [greedy, sampled, generate(m, batch, 9, temperature=0, eos=[greedy[1][2]], compile=True).tokens]

    want = run()
    with torch.device("meta"):
        assert run() == want
