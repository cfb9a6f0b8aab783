"""Compiled decode (``generate(..., compile=True)``): the static step ``MoEGPT.decode_step``
traces as one graph with no host synchronisation, equals the eager cached step, and compiled
generation gives the eager loop's tokens (greedy and seeded sampling, one row and a
left-padded batch, stop tokens, a sliding window, ``MoEGPT.generate``) with a bounded number of
compilations, also after the model's dtype or mode changed between calls; the same with every
grouped-query attention option on (windows, sinks, query/key norms, biases, scaled partial
rotary).

Compiling with inductor on this CPU takes tens of seconds a shape, so every compiled test
shares one model and the shapes of two batch sizes (1 and 3 rows) and one cache capacity (32
columns): ``compilations`` counts them (one test compiles the same shapes for a fresh copy:
the recompile limit; one compiles a model in three dtypes and modes).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode

import moeflow.models.gpt as gpt_module
from moeflow import RouterConfig
from moeflow.experts.packed import PackedCPUExperts
from moeflow.kernels import packed_cpu
from moeflow.layer.moe import moe_layers
from moeflow.models.compiled_decode import STOP_CHECK_EVERY, HeadProduct, _bucket, compiled_decoder
from moeflow.models.generation import generate
from moeflow.models.gpt_config import AttentionConfig, RopeScaling

from helpers import small_gpt
from sampling_reference import assert_generation_fits

MAX_SEQ = 32
# prompts of a left-padded batch (3 rows) and of one row
PROMPTS = [[5, 9, 2, 7, 1, 3], [4, 8], [6, 6, 11, 30]]
ONE = [[17, 3, 44, 2, 9]]


@pytest.fixture(scope="module")
def model() -> gpt_module.MoEGPT:
    """A small MoE GPT in fp32 with weights drawn wide enough (std 0.3) that greedy picks are
    far from ties: compiled and eager kernels round differently in the last bits."""
    torch.manual_seed(0)
    m = small_gpt(max_seq_len=MAX_SEQ).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    return m


# every grouped-query option: block 0 slides over 3 columns (the prompts are longer), sinks,
# per-head query/key norms, biases, clipping, YaRN on half of each 12-dim head
EVERY_OPTION = dict(attention=AttentionConfig(head_dim=12, qk_norm="head", qkv_bias=True, o_bias=True, clip_qkv=1.5,
                                              sliding_window=3, sliding_layers=(0,), sinks=True, rotary_fraction=0.5),
                    rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8, beta_fast=8.0,
                                             truncate=False))


@pytest.fixture(scope="module")
def every_option_model() -> gpt_module.MoEGPT:
    """``model``'s shape with ``EVERY_OPTION``; every parameter drawn (norm weights around one,
    biases and sinks nonzero)."""
    torch.manual_seed(2)
    m = small_gpt(max_seq_len=MAX_SEQ, **EVERY_OPTION).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    return m


class SyncCounter(TorchFunctionMode):
    """Counts the tensor calls that read values on the host (a synchronisation with a GPU, and a
    graph break or a shape that depends on data under ``torch.compile``)."""

    NAMES = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy",
                       "bincount", "unique", "masked_select", "repeat_interleave"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.seen.append(name)
        elif name == "__getitem__" and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool
                                           for a in _flat(args[1:])):
            self.seen.append("__getitem__[bool]")
        return func(*args, **(kwargs or {}))


def _flat(items):  # type: ignore[no-untyped-def]
    for a in items:
        if isinstance(a, (tuple, list)):
            yield from _flat(a)
        else:
            yield a


def _prefilled(model, prompts: list[list[int]], capacity: int = MAX_SEQ):  # type: ignore[no-untyped-def]
    """A zeroed cache holding the left-padded prompts, the prefill's logits, the next column."""
    P = max(len(r) for r in prompts)
    idx = torch.tensor([[0] * (P - len(r)) + r for r in prompts])
    cache = model.new_cache(torch.tensor([P - len(r) for r in prompts]), capacity, zeroed=True)
    return cache, model.forward_cached(idx, cache), P


# ------------------------------------------------------------------------------------------
# the static step, eager


@pytest.mark.reference
def test_static_step_equals_the_cached_step(model):
    """Four decode steps of a left-padded batch: ``decode_step`` (whole cache, masked) against
    ``forward_cached`` (the filled columns), logits to fp32 rounding."""
    with torch.no_grad():
        cache, logits, P = _prefilled(model, PROMPTS)
        ref_cache, ref_logits, _ = _prefilled(model, PROMPTS)
        ref_cache.length = P
        pos = torch.tensor(P)
        for _ in range(4):
            next_B = logits.argmax(-1)
            logits = model.decode_step(next_B, pos, cache)
            ref_logits = model.forward_cached(next_B.unsqueeze(1), ref_cache)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            pos += 1


@pytest.mark.reference
def test_static_step_reads_nothing_on_the_host(model, monkeypatch):
    """No call of the step reads a tensor's value on the host; and the counter does see one
    when a step does (a sync planted in the step's inputs)."""
    with torch.no_grad():
        cache, logits, P = _prefilled(model, PROMPTS)
        next_B, pos = logits.argmax(-1), torch.tensor(P)
        with SyncCounter() as counter:
            model.decode_step(next_B, pos, cache)
        assert counter.seen == []

        real = gpt_module.static_step

        def planted(cache, pos):  # type: ignore[no-untyped-def]
            if int(pos) >= 0:  # a host read of the column
                return real(cache, pos)
            raise AssertionError

        monkeypatch.setattr(gpt_module, "static_step", planted)
        with SyncCounter() as counter:
            model.decode_step(next_B, pos, cache)
        assert counter.seen == ["__int__"]


@pytest.mark.reference
def test_static_step_traces_as_one_graph(model):
    """``torch._dynamo.explain``: one graph, no break (``torch.compile(fullgraph=True)`` would
    raise on any)."""
    torch._dynamo.reset()
    with torch.no_grad():
        cache, logits, P = _prefilled(model, PROMPTS)
        explained = torch._dynamo.explain(model.decode_step)(logits.argmax(-1), torch.tensor(P), cache)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.reference
def test_static_step_with_every_attention_option_is_one_graph_without_host_reads(every_option_model):
    """Windows, sinks, query/key norms and biases keep the static step one graph with no host
    read, equal to the eager cached step (four steps of the left-padded batch)."""
    m = every_option_model
    with torch.no_grad():
        cache, logits, P = _prefilled(m, PROMPTS)
        ref_cache, ref_logits, _ = _prefilled(m, PROMPTS)
        ref_cache.length = P
        pos = torch.tensor(P)
        next_B = logits.argmax(-1)
        with SyncCounter() as counter:
            m.decode_step(next_B, pos, cache)
        assert counter.seen == []
        torch._dynamo.reset()
        explained = torch._dynamo.explain(m.decode_step)(next_B, pos, cache)
        assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
        cache, logits, P = _prefilled(m, PROMPTS)
        for _ in range(4):
            next_B = logits.argmax(-1)
            logits = m.decode_step(next_B, pos, cache)
            ref_logits = m.forward_cached(next_B.unsqueeze(1), ref_cache)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            pos += 1


@pytest.mark.reference
def test_static_step_is_the_head_of_its_hidden_state(model):
    """``decode_step`` is ``lm_head(decode_hidden)`` (the CPU's compiled decoder compiles the
    second and multiplies the head itself); the step writes the same cache columns again."""
    with torch.no_grad():
        cache, logits, P = _prefilled(model, PROMPTS)
        next_B, pos = logits.argmax(-1), torch.tensor(P)
        logits = model.decode_step(next_B, pos, cache)
        torch.testing.assert_close(model.lm_head(model.decode_hidden(next_B, pos, cache)), logits, rtol=0, atol=0)


@pytest.mark.reference
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_head_product_gives_the_heads_logits_in_one_fixed_layout(rows):
    """``HeadProduct`` against ``F.linear`` in fp64 on fresh random inputs, at every row count
    the same layout (its ``[D, V]`` copy; no timing anywhere, so nothing but the inputs decides
    the logits: the same bits on every call); ``begin`` takes the weight as it is then, ``end``
    drops the copy, and a call outside them is an error."""
    gen = torch.Generator().manual_seed(rows)
    w_VD = torch.randn(37, 16, generator=gen, dtype=torch.float64)
    h_BD = torch.randn(rows, 16, generator=gen, dtype=torch.float64)
    head = HeadProduct()
    with pytest.raises(RuntimeError, match="begin comes first"):
        head(h_BD)
    head.begin(w_VD)
    assert head.weight_DV.is_contiguous() and torch.equal(head.weight_DV, w_VD.t())
    out = head(h_BD)
    torch.testing.assert_close(out, torch.nn.functional.linear(h_BD, w_VD), rtol=1e-12, atol=1e-12)
    assert out.shape == (rows, 37) and all(torch.equal(head(h_BD), out) for _ in range(3))
    w2_VD = w_VD + 1.0  # the weight changed between calls (an optimizer step): the next begin follows it
    head.begin(w2_VD)
    torch.testing.assert_close(head(h_BD), h_BD @ w2_VD.t(), rtol=1e-12, atol=1e-12)
    head.end()
    assert head.weight_DV is None


@pytest.mark.unit
def test_the_head_is_left_out_of_the_graph_only_for_a_plain_linear_head_on_the_cpu():
    """A plain bias-free ``nn.Linear`` head on the CPU: the decoder multiplies it (a
    ``HeadProduct``); a head with a bias (or any other module) stays in the compiled step, and
    swapping the head makes a new decoder (nothing compiles until a call)."""
    m = small_gpt(max_seq_len=MAX_SEQ)
    first = compiled_decoder(m)
    assert isinstance(first.head, HeadProduct) and compiled_decoder(m) is first
    m.lm_head = torch.nn.Linear(m.config.dim, m.config.vocab_size, bias=True)
    second = compiled_decoder(m)
    assert second is not first and second.head is None and second.compilations == 0


@pytest.mark.unit
def test_cache_capacities_round_up_to_a_power_of_two_within_the_window():
    assert [_bucket(n, 512) for n in (1, 16, 17, 33, 300, 512)] == [16, 16, 32, 64, 512, 512]
    assert _bucket(40, 48) == 48  # never past max_seq_len


@pytest.mark.unit
def test_compile_must_be_a_bool(model):
    with pytest.raises(TypeError, match="compile must be a bool"):
        generate(model, ONE, 2, compile="yes")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# compiled generation (inductor on this CPU)


@pytest.mark.e2e
def test_compiled_generation_gives_the_eager_tokens(model):
    """Greedy, fp32: one row and a left-padded batch; then seeded sampling (temperature, top-k,
    top-p) of the batch; then stop tokens (rows stop at different steps, the host looking every
    few steps); then three calls of other lengths: no new compilation."""
    torch._dynamo.reset()
    for prompts, n in ((ONE, 20), (PROMPTS, 20)):
        eager = generate(model, prompts, n, temperature=0)
        compiled = generate(model, prompts, n, temperature=0, compile=True)
        assert compiled.tokens == eager.tokens
        assert compiled.decode_tokens == eager.decode_tokens and compiled.prefill_tokens == eager.prefill_tokens
    decoder = compiled_decoder(model)
    assert decoder.compilations == 2  # (1 row, 32 columns) and (3 rows, 32 columns)

    sampling = dict(temperature=0.9, top_k=12, top_p=0.95)
    eager = generate(model, PROMPTS, 20, generator=torch.Generator().manual_seed(7), **sampling)
    compiled = generate(model, PROMPTS, 20, generator=torch.Generator().manual_seed(7), compile=True, **sampling)
    assert compiled.tokens == eager.tokens

    greedy = generate(model, PROMPTS, 20, temperature=0).tokens
    stop = [greedy[0][2], greedy[2][STOP_CHECK_EVERY + 3]]  # row 0 stops early, row 2 after a host check
    eager = generate(model, PROMPTS, 20, temperature=0, eos=stop)
    compiled = generate(model, PROMPTS, 20, temperature=0, eos=stop, compile=True)
    assert compiled.tokens == eager.tokens
    assert len(compiled.tokens[0]) < 20

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for prompts, n in ((PROMPTS, 12), ([r[:2] for r in PROMPTS], 25), (ONE, 15)):  # 17..32 columns: one capacity
        assert generate(model, prompts, n, temperature=0, compile=True).tokens == \
            generate(model, prompts, n, temperature=0).tokens
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    assert decoder.compilations == 2


@pytest.mark.e2e
def test_compiled_generation_follows_a_head_changed_between_calls(model):
    """On the CPU the compiled decoder multiplies the head itself (``HeadProduct``): it gives the
    eager loop's tokens, and after the head's weight changes in place (as an optimizer step
    changes it) the next compiled call gives the eager loop's new tokens, not the old ones: the
    ``[D, V]`` copy is taken per call (the shapes are those of the test above: no new
    compilation)."""
    decoder = compiled_decoder(model)
    assert decoder.head is not None
    before = generate(model, PROMPTS, 12, temperature=0).tokens  # 17 columns: capacity 32
    weight = model.lm_head.weight
    saved = weight.detach().clone()
    try:
        assert generate(model, PROMPTS, 12, temperature=0, compile=True).tokens == before
        for n in range(2):
            with torch.no_grad():  # another head each time: the copy must follow every change
                weight.copy_(saved.roll(7 + n, dims=0) + 0.1 * torch.randn(saved.shape, generator=torch.Generator().manual_seed(n)))
            eager = generate(model, PROMPTS, 12, temperature=0).tokens
            assert eager != before
            assert generate(model, PROMPTS, 12, temperature=0, compile=True).tokens == eager
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert decoder.head.weight_DV is None  # dropped after each generation
    assert decoder.compilations == 2


@pytest.mark.e2e
def test_compiled_generation_multiplies_packed_experts_and_follows_experts_changed_between_calls(model, monkeypatch):
    """On the CPU a compiled generation's MoE layers compute with ``PackedCPUExperts`` in place
    of their experts (the few-row kernel runs twice per MoE layer in the prefill and in every
    step) and give the eager loop's tokens, and the experts are back afterwards; after one
    layer's expert weights change through ``.data`` (as an EMA changes them: no version moves)
    the next compiled call still runs the kernel and gives the eager loop's new tokens: the
    packs are made again (no new compilation after the first call, which compiles the shape if
    no test before did: the tests may run in any order, or alone)."""
    import moeflow.experts.packed as packed

    if packed_cpu._compiler() is None:
        pytest.skip("no C++ compiler: the compiled step multiplies the weights themselves")
    generate(model, PROMPTS, 12, temperature=0, compile=True)  # (3 rows, 32 columns) compiled and warm
    compilations = compiled_decoder(model).compilations
    calls = []
    real = packed.packed_grouped_mm
    monkeypatch.setattr(packed, "packed_grouped_mm", lambda *a: calls.append(1) or real(*a))
    experts = [layer.experts for layer in moe_layers(model)]
    per_call = 2 * len(experts) * (1 + 11)  # the prefill (36 rows: few enough) and 11 compiled steps
    before = generate(model, PROMPTS, 12, temperature=0).tokens
    assert calls == []  # the eager loop multiplies the weights themselves
    assert generate(model, PROMPTS, 12, temperature=0, compile=True).tokens == before
    assert len(calls) == per_call
    assert [layer.experts for layer in moe_layers(model)] == experts  # (the same objects, back in place)
    assert all(isinstance(s, PackedCPUExperts) for s in compiled_decoder(model).stand_ins.values())
    w_in = experts[-1].w_in
    saved = w_in.detach().clone()
    try:
        w_in.data.copy_(saved.roll(1, dims=0))  # the experts trade weights
        eager = generate(model, PROMPTS, 12, temperature=0).tokens
        assert eager != before
        assert generate(model, PROMPTS, 12, temperature=0, compile=True).tokens == eager
        assert len(calls) == 2 * per_call  # the kernel ran on the new packs, not the weights themselves
    finally:
        w_in.data.copy_(saved)
    assert generate(model, PROMPTS, 12, temperature=0, compile=True).tokens == before
    assert compiled_decoder(model).compilations == compilations


@pytest.mark.e2e
def test_model_generate_takes_compile(model):
    """``MoEGPT.generate(..., compile=True)`` (a ``TypeError`` before: only the function took
    ``compile``) runs the compiled decoder and returns the eager method's tensor, and a second
    call compiles nothing new (one row and 32 columns: compiled by the first call if no test
    before did); ``compile`` is a bool and needs the cache."""
    idx = torch.tensor(ONE)
    decoder = compiled_decoder(model)
    model.generate(idx, 15, temperature=0, compile=True)
    compilations = decoder.compilations
    eager = model.generate(idx, 15, temperature=0)
    compiled = model.generate(idx, 15, temperature=0, compile=True)
    assert torch.equal(compiled, eager) and compiled.shape == (1, 5 + 15)
    assert compiled_decoder(model) is decoder and decoder.compilations == compilations
    with pytest.raises(ValueError, match="use_cache=False"):
        model.generate(idx, 3, compile=True, use_cache=False)
    with pytest.raises(TypeError, match="compile must be a bool"):
        model.generate(idx, 3, compile="yes")


@pytest.mark.e2e
def test_compiled_generation_slides_its_window_like_the_eager_loop(model):
    """Past ``max_seq_len`` columns both re-run the last window per token: the same tokens
    (the compiled steps up to the window's end share the shapes of the test above)."""
    eager = generate(model, PROMPTS, MAX_SEQ + 6, temperature=0)
    compiled = generate(model, PROMPTS, MAX_SEQ + 6, temperature=0, compile=True)
    assert compiled.tokens == eager.tokens


@pytest.mark.e2e
def test_cli_generate_compile_reaches_generate_and_refuses_offload(tmp_path, monkeypatch, capsys):
    """``moeflow generate --compile`` calls ``generate(..., compile=True)``; with ``--offload``
    it is a one-line usage error."""
    import moeflow.models.generation as generation
    from moeflow.cli.main import main

    from helpers import train_tiny_run

    run = train_tiny_run(tmp_path / "run")
    calls = []
    real = generation.generate

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(kwargs.get("compile"))
        return real(*args, **{**kwargs, "compile": False})  # (the wiring, not another compilation)

    monkeypatch.setattr(generation, "generate", spy)
    assert main(["generate", run, "--compile", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert calls == [True]
    assert main(["generate", run, "--compile", "--offload", "host", "--max-new-tokens", "3", "--device", "cpu"]) == 2
    assert "--compile cannot go with --offload host" in capsys.readouterr().err


@pytest.mark.reference
def test_compile_refuses_a_model_whose_step_cannot_be_one_graph(model):
    """Experts of one's own (here ``ModuleExperts``, which read group sizes on the host) are
    refused up front, naming the layer; a step that fails to trace (fp64 runs the ``loop``
    experts backend, which reads them too) is a ``ValueError``, not a dynamo traceback."""
    from moeflow import ModuleExperts
    from moeflow.layer.moe import moe_layers

    own = copy.deepcopy(model)
    layer = moe_layers(own)[0]
    layer.experts = ModuleExperts([torch.nn.Linear(own.config.dim, own.config.dim) for _ in range(layer.config.num_experts)])
    with pytest.raises(ValueError, match="compile=True needs .* MoE layer 0 has ModuleExperts"):
        generate(own, ONE, 3, temperature=0, compile=True)
    with pytest.raises(ValueError, match="does not compile as one graph"):
        generate(copy.deepcopy(model).double(), ONE, 3, temperature=0, compile=True)


@pytest.mark.e2e
def test_compiled_decode_outlives_dynamos_recompile_limit(model):
    """Every model, batch size and cache capacity is one more graph of the same function, and
    dynamo keeps ``recompile_limit`` (8) of them, failing past it under ``fullgraph=True``: a
    process decoding its ninth shape failed. The decoder raises the limit for its own warm-ups;
    here the limit is 1 and a fresh copy of the model compiles two shapes (whatever this process
    compiled before counts too)."""
    fresh = copy.deepcopy(model)
    with torch._dynamo.config.patch(recompile_limit=1):
        one = generate(fresh, ONE, 3, temperature=0, compile=True)
        three = generate(fresh, PROMPTS, 3, temperature=0, compile=True)
    assert compiled_decoder(fresh).compilations == 2
    assert one.tokens == generate(model, ONE, 3, temperature=0).tokens
    assert three.tokens == generate(model, PROMPTS, 3, temperature=0).tokens


@pytest.mark.e2e
def test_compiled_generation_follows_the_models_dtype_and_mode_between_calls():
    """A compiled step is traced for the model's dtype and its modules' ``training`` flags,
    which its inputs do not carry, and runs with dynamo's guards skipped: a compiled call after
    ``model.to(dtype)`` failed ("Expected query, key, and value to have the same dtype": the
    cache of the former dtype was reused), and one after ``model.train()`` replayed the eval
    graph. One model (with an aux-loss-free router, whose balance counters ``load_counts`` grow
    in training mode only) generates compiled in bf16, then after ``.float()`` (the eager fp32
    tokens), then after ``.train()`` (the eager training-mode tokens and counts; the step's
    warm-up leaves the counters alone), then in eval mode again (no new compilation); in fp64,
    whose step cannot be one graph (the experts' loop backend reads counts on the host), it is
    a clear error, not a dtype clash."""
    torch.manual_seed(1)
    m = small_gpt(max_seq_len=MAX_SEQ, router=RouterConfig(bias_update_rate=0.01)).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else None
    counters = [layer.router.load_counts for layer in moe_layers(m)]
    n = 12  # PROMPTS: 17 columns, capacity 32
    m.to(torch.bfloat16)
    bf16 = generate(m, PROMPTS, n, temperature=0, compile=True).tokens
    assert [len(r) for r in bf16] == [n] * 3
    m.float()
    assert generate(m, PROMPTS, n, temperature=0, compile=True).tokens == generate(m, PROMPTS, n, temperature=0).tokens

    m.train()
    runs = []
    for compile in (False, True):
        for c in counters:
            c.zero_()
        runs.append((generate(m, PROMPTS, n, temperature=0, compile=compile).tokens, [c.clone() for c in counters]))
    (eager, eager_counts), (compiled, compiled_counts) = runs
    assert compiled == eager
    real = sum(len(r) for r in PROMPTS) + len(PROMPTS) * (n - 1)  # the prompts' tokens, then 3 rows a step
    assert all(int(c.sum()) == 2 * real for c in eager_counts)  # each real token's k = 2 choices
    assert all(torch.equal(a, b) for a, b in zip(compiled_counts, eager_counts))
    decoder = compiled_decoder(m)
    assert decoder.compilations == 3  # bf16, fp32, fp32 training: one shape each

    m.eval()
    assert generate(m, PROMPTS, n, temperature=0, compile=True).tokens == generate(m, PROMPTS, n, temperature=0).tokens
    assert decoder.compilations == 3
    m.double()
    with pytest.raises(ValueError, match="does not compile as one graph"):
        generate(m, PROMPTS, n, temperature=0, compile=True)


@pytest.mark.e2e
def test_compiled_generation_with_every_attention_option_gives_the_eager_steps_and_tokens(every_option_model):
    """Windows, sinks, query/key norms, biases and scaled partial rotary, compiled: the compiled
    step's logits equal the eager cached step's over six steps of the left-padded batch (fp32
    rounding), and greedy generation gives the eager loop's tokens, in one compilation."""
    m = every_option_model
    eager = generate(m, PROMPTS, 20, temperature=0)
    assert generate(m, PROMPTS, 20, temperature=0, compile=True).tokens == eager.tokens
    decoder = compiled_decoder(m)
    assert decoder.compilations == 1  # (3 rows, 32 columns)
    P = max(map(len, PROMPTS))
    pad_B = torch.tensor([P - len(r) for r in PROMPTS])
    idx = torch.tensor([[0] * (P - len(r)) + r for r in PROMPTS])
    with torch.no_grad(), decoder.generation(m):
        cache = decoder.cache(m, pad_B, MAX_SEQ)
        ref_cache = m.new_cache(pad_B, MAX_SEQ)
        logits, ref_logits = m.forward_cached(idx, cache), m.forward_cached(idx, ref_cache)
        pos = torch.tensor(P)
        for step in range(6):
            next_B = ref_logits.argmax(-1)
            logits = decoder.run(next_B, pos, cache, guarded=step == 0)
            ref_logits = m.forward_cached(next_B.unsqueeze(1), ref_cache)
            torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
            pos += 1
    assert decoder.compilations == 1


@pytest.mark.e2e
def test_compiled_generation_draws_each_token_from_the_reference(model):
    """The compiled loop's draws follow the reference distribution (``tests/sampling_reference.py``)
    of each step's context, not only the eager loop's tokens at one seed: 40 generations of the
    left-padded batch, 26 tokens each (about 3100 draws with temperature, top-k and top-p), on
    the shapes compiled above (3 rows, 32 columns: no new compilation); the randomised
    probability integral transforms are uniform by chi-square at alpha = 1e-6 (10 bins)."""
    fields = dict(temperature=0.8, top_k=12, top_p=0.9)
    g = torch.Generator(device="cpu").manual_seed(23)
    prompts, tokens = [], []
    for _ in range(40):
        prompts += PROMPTS
        tokens += generate(model, PROMPTS, 26, generator=g, compile=True, **fields).tokens
    assert all(len(t) == 26 for t in tokens)
    assert assert_generation_fits(model, prompts, tokens, fields, seed=4, alpha=1e-6) > 3000
    assert compiled_decoder(model).compilations <= 2
