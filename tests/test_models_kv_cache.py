"""The KV cache's pieces for continuous batching (``moeflow serve``): row views sharing a cache's
storage (``KVCache.rows``), a prompt prefilled in chunks behind filled columns
(``forward_cached`` on a filled cache), and the static decode step with a column per row
(``decode_step`` with ``pos [B]``), for every attention kind (grouped-query plain, with sliding
windows, sinks, query/key norms and scaled rotary, and latent attention's absorbed step): each
row's logits equal the whole sequence's (fp64), eager, and compiled on a row view.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from moeflow.layer.moe import moe_layers
from moeflow.models.compiled_decode import compiled_decoder
from moeflow.models.gpt import MoEGPT
from moeflow.models.gpt_config import AttentionConfig, GPTConfig
from moeflow.models.kv_cache import KVCache, static_step, step_inputs
from moeflow.models.rope import rope_cos_sin

from helpers import small_gpt
from test_models_attention import every_option_gpt
from test_models_generation_compiled import SyncCounter
from test_models_mla import _randomize, mla_gpt

KINDS = ["gqa", "yarn-head", "linear-proj-pairs", "mla"]  # (the two middle ones slide, sink and norm)
TOL = dict(rtol=1e-10, atol=1e-10)


def kind_gpt(kind: str, dtype: torch.dtype, gen: torch.Generator) -> MoEGPT:
    """A 3-block MoE model of the attention kind, every parameter drawn (max_seq_len 32)."""
    if kind == "mla":
        return mla_gpt(dtype, gen)
    if kind == "gqa":
        model = small_gpt(max_seq_len=32).to(dtype).eval()
        _randomize(model, gen)
        return model
    return every_option_gpt(kind, dtype, gen)


def _whole(model: MoEGPT, row: list[int]) -> torch.Tensor:
    return model(torch.tensor([row]))[0, -1]


def _prompt(gen: torch.Generator, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


def _skip_in_mutation_coverage_pass() -> None:
    """``make mutation``'s coverage pass (mutmut's ``MUTANT_UNDER_TEST=stats``) runs every
    mutated function through a trampoline that records the call in a ``ContextVar``, which
    dynamo cannot trace: the step breaks into graphs there and ``fullgraph=True`` fails. A test
    that compiles the step or counts its graphs skips in that pass alone (so it covers no mutant
    of the package; a mutant's own run traces through the trampoline and passes it)."""
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        pytest.skip("mutmut's coverage pass: its call records break dynamo's graph")


@pytest.mark.unit
def test_row_views_share_the_caches_storage_and_bad_rows_are_named():
    """What a view writes lands in the big cache's rows; the view keeps its own length and a
    view of the padding; rows out of range and a ``pos`` of the wrong shape are named."""
    model = small_gpt(max_seq_len=16)
    cache = model.new_cache(torch.tensor([0, 2, 1, 0]), 8, zeroed=True)
    cache.length = 5
    view = cache.rows(1, 3)
    assert view.batch == 2 and view.length == 0 and view.max_pad == 2 and view.capacity == 8
    assert view.window == cache.window and view.cos_LR is cache.cos_LR
    k = torch.randn(2, 2, 3, 8)
    view.write(1, 0, k, k + 1)
    assert torch.equal(cache.k[1][1:3, :, :3], k) and torch.equal(cache.v[1][1:3, :, :3], k + 1)
    assert cache.k[1][0].eq(0).all() and cache.k[1][3].eq(0).all() and cache.length == 5
    view.pad_B.copy_(torch.tensor([3, 4]))
    assert cache.pad_B.tolist() == [0, 3, 4, 0]
    unpadded = model.new_cache(torch.zeros(3, dtype=torch.long), 8)
    with SyncCounter() as counter:  # a slot's view of a cache without padding reads nothing on the host
        one = unpadded.rows(2, 3)
    assert counter.seen == [] and one.max_pad == 0 and one.batch == 1
    for start, stop, match in ((-1, 2, "start must be >= 0"), (2, 2, "stop must be >= 3"), (1, 5, "stop=5 is past")):
        with pytest.raises(ValueError, match=match):
            cache.rows(start, stop)
    with pytest.raises(ValueError, match=r"pos must be 0-dim or \[4\]"):
        static_step(cache, torch.tensor([1, 2]))


@pytest.mark.reference
@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_prefilled_in_chunks_gives_the_whole_sequences_logits(kind, gen):
    """fp64: one prompt in chunks of 1, 2, 5, 1 and 4 columns (each behind the filled ones: a
    chunk of two behind one column, a one-column decode between chunks, the last filling the
    cache to its capacity) gives after every chunk the whole prefix's last logits and the
    one-shot prefill's cache; a call of no column or past the capacity is refused by name; a
    left-padded batch in chunks (the first ones partly pad) gives each row's."""
    model = kind_gpt(kind, torch.float64, gen)
    V = model.config.vocab_size
    prompt = _prompt(gen, 13, V)
    with torch.no_grad():
        one_row = torch.zeros(1, dtype=torch.long)
        cache, once = model.new_cache(one_row, 13), model.new_cache(one_row, 16)
        model.forward_cached(torch.tensor([prompt]), once)
        col = 0
        for size in (1, 2, 5, 1, 4):
            if col == 8:
                with pytest.raises(ValueError, match="KV cache holds 13 columns; 8 are filled, 6 more do not fit"):
                    model.forward_cached(torch.tensor([prompt[:6]]), cache)
                with pytest.raises(ValueError, match="seq_len must be >= 1"):
                    step_inputs(cache, 0)
            logits = model.forward_cached(torch.tensor([prompt[col:col + size]]), cache)
            col += size
            torch.testing.assert_close(logits[0], _whole(model, prompt[:col]), **TOL)
        assert cache.length == 13
        for a, b in zip((*cache.k, *cache.v), (*once.k, *once.v)):
            torch.testing.assert_close(a[:, :, :13], b[:, :, :13], **TOL)

        rows = [_prompt(gen, n, V) for n in (9, 3, 6)]
        P = 9
        idx = torch.tensor([[0] * (P - len(r)) + r for r in rows])
        cache = model.new_cache(torch.tensor([P - len(r) for r in rows]), 16)
        for start, stop in ((0, 4), (4, 7), (7, 9)):
            logits = model.forward_cached(idx[:, start:stop], cache)
            for b, r in enumerate(rows):
                real = stop - (P - len(r))
                if real > 0:  # (a row still all pad has no logits to check)
                    torch.testing.assert_close(logits[b], _whole(model, r[:real]), **TOL)


@pytest.mark.reference
@pytest.mark.parametrize("kind", KINDS)
def test_decode_slots_with_a_column_per_row_give_each_rows_whole_sequence(kind, gen):
    """fp64, four slots of one zeroed cache: prompts of 7, 2 and 11 tokens prefilled in chunks
    of 4 on their rows' views (slots 0, 1, 3), slot 2 holding the first 4 columns of a
    9-token prompt; six static steps over all four rows with ``pos [4]`` (each decoding row at
    its own column, slot 2 given a dummy token at its next column) give each decoding row its
    whole sequence's logits; then slot 2's prefill goes on and gives its prompt's. A step with
    every column equal gives the 0-dim step's logits."""
    model = kind_gpt(kind, torch.float64, gen)
    V = model.config.vocab_size
    cache = model.new_cache(torch.zeros(4, dtype=torch.long), 32, zeroed=True)
    rows = {0: _prompt(gen, 7, V), 1: _prompt(gen, 2, V), 3: _prompt(gen, 11, V)}
    waiting = _prompt(gen, 9, V)

    def prefill(slot: int, tokens: list[int], start: int) -> torch.Tensor:
        view = cache.rows(slot, slot + 1)
        view.length = start
        for col in range(start, len(tokens), 4):
            logits = model.forward_cached(torch.tensor([tokens[col:col + 4]]), view)
        return logits[0]

    with torch.no_grad():
        last = {s: prefill(s, r, 0) for s, r in rows.items()}
        prefill(2, waiting[:4], 0)
        for _ in range(6):
            for s, r in rows.items():
                torch.testing.assert_close(last[s], _whole(model, r), **TOL)
                r.append(int(last[s].argmax()))
            next_B = torch.tensor([rows[s][-1] if s in rows else 0 for s in range(4)])
            pos_B = torch.tensor([len(rows[s]) - 1 if s in rows else 4 for s in range(4)])
            logits = model.decode_step(next_B, pos_B, cache)
            last = {s: logits[s] for s in rows}
        torch.testing.assert_close(prefill(2, waiting, 4), _whole(model, waiting), **TOL)

        same = model.new_cache(torch.tensor([0, 1, 3]), 16, zeroed=True)
        other = model.new_cache(torch.tensor([0, 1, 3]), 16, zeroed=True)
        idx = torch.randint(0, V, (3, 6), generator=gen)
        model.forward_cached(idx, same), model.forward_cached(idx, other)
        next_B = torch.randint(0, V, (3,), generator=gen)
        torch.testing.assert_close(model.decode_step(next_B, torch.tensor([6, 6, 6]), same),
                                   model.decode_step(next_B, torch.tensor(6), other), **TOL)


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["yarn-head", "mla"])
def test_a_step_with_a_column_per_row_is_one_graph_without_host_reads(kind, gen):
    """``pos [B]`` keeps the static step free of host reads and one graph (windows, sinks,
    latent attention's absorbed form)."""
    _skip_in_mutation_coverage_pass()
    model = kind_gpt(kind, torch.float32, gen)
    cache = model.new_cache(torch.zeros(3, dtype=torch.long), 16, zeroed=True)
    next_B, pos_B = torch.randint(0, 61, (3,), generator=gen), torch.tensor([4, 0, 9])
    with torch.no_grad():
        model.decode_step(next_B, pos_B, cache)  # (the experts' backend probe runs on a first call)
        with SyncCounter() as counter:
            model.decode_step(next_B, pos_B, cache)
        assert counter.seen == []
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model.decode_step)(next_B, pos_B, cache)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.e2e
def test_compiled_slot_steps_on_a_row_view_equal_the_eager_steps(gen):
    """``CompiledDecoder.slot_cache``: four slots, the step compiled for the view of rows [0, 2)
    (one graph); rows 0 and 1 prefilled with prompts of 6 and 3 tokens; five compiled steps
    with ``pos [2]`` give the eager step's logits (fp32, wide weights) and write the same
    columns into the big cache, rows 2 and 3 untouched."""
    _skip_in_mutation_coverage_pass()
    model = small_gpt(max_seq_len=32).eval()
    _randomize(model, gen)
    prompts = [_prompt(gen, 6, 61), _prompt(gen, 3, 61)]
    decoder = compiled_decoder(model)
    with torch.no_grad(), decoder.generation(model):
        cache, views = decoder.slot_cache(model, 4, 32, (2,))
        ref = model.new_cache(torch.zeros(2, dtype=torch.long), 32, zeroed=True)
        assert set(views) == {2} and views[2].batch == 2 and decoder.compilations == 1
        logits, ref_logits = [], []
        for s, p in enumerate(prompts):
            for c in (cache, ref):
                view = c.rows(s, s + 1)
                (logits if c is cache else ref_logits).append(model.forward_cached(torch.tensor([p]), view)[0])
        next_B, pos_B = torch.stack(ref_logits).argmax(-1), torch.tensor([6, 3])
        for step in range(5):
            got = decoder.run(next_B, pos_B, views[2], guarded=step == 0)
            want = model.decode_step(next_B, pos_B, ref)
            # fp32 rounding relative to the logits' scale: the compiled step sums in another order
            # (packed experts, the head's own layout, the kernel's build flags), which a fresh
            # clone's CI saw reach 2.5e-6 of the scale; a wrong column or position is O(scale)
            scale = float(want.abs().max())
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
            next_B, pos_B = want.argmax(-1), pos_B + 1
        for a, b in zip((*cache.k, *cache.v), (*ref.k, *ref.v)):
            torch.testing.assert_close(a[:2], b, rtol=1e-5, atol=1e-5)
            assert a[2:].eq(0).all()
    assert decoder.compilations == 1



@pytest.mark.unit
def test_a_new_cache_has_the_shapes_it_is_given_and_each_bad_size_is_refused_by_name(gen):
    """``KVCache``: per block keys ``[B, G, L, K]`` and values ``[B, G, L, V]`` of the dtype and
    device asked for (zeros when ``zeroed``), no column filled, ``pad_B`` as int64 on that
    device and its largest value read once; the tables and window kept as given. Every size is
    at least 1 but ``batch`` (0: no rows), and each is refused by name one below its minimum,
    as are a window of 0, tables that are not ``[L, R]`` with ``R`` even and at least 2, and
    ``pad_B`` of another shape."""
    n_layers, B, G, K, V, L = (int(v) for v in torch.randint(1, 5, (6,), generator=gen))
    R = 2 * int(torch.randint(1, 4, (1,), generator=gen))
    cos, sin = rope_cos_sin(L, R, 10000.0, "cpu", torch.float32)
    pad = torch.randint(0, L, (B,), generator=gen, dtype=torch.int32)
    kw = dict(n_layers=n_layers, batch=B, kv_heads=G, k_dim=K, v_dim=V, capacity=L, pad_B=pad, cos_LR=cos, sin_LR=sin)
    with torch.device("meta"):  # (the default device is not the cache's)
        cache = KVCache(**kw, window=1, device="cpu", dtype=torch.float64, zeroed=True)  # type: ignore[arg-type]
    assert len(cache.k) == len(cache.v) == n_layers and cache.length == 0 and cache.capacity == L
    assert all(k.shape == (B, G, L, K) and v.shape == (B, G, L, V) for k, v in zip(cache.k, cache.v))
    assert all(t.dtype == torch.float64 and t.device.type == "cpu" and t.eq(0).all() for t in (*cache.k, *cache.v))
    assert len({t.data_ptr() for t in (*cache.k, *cache.v)}) == 2 * n_layers  # (no block shares another's)
    assert cache.pad_B.dtype == torch.int64 and cache.pad_B.device.type == "cpu" and torch.equal(cache.pad_B, pad.long())
    assert cache.max_pad == int(pad.max()) and cache.batch == B and cache.window == 1
    assert cache.cos_LR is cos and cache.sin_LR is sin
    plain = KVCache(**kw)  # type: ignore[arg-type]
    assert plain.window is None and plain.k[0].dtype == torch.get_default_dtype() and plain.k[0].device.type == "cpu"
    empty = KVCache(**{**kw, "batch": 0, "pad_B": torch.zeros(0, dtype=torch.long)})  # type: ignore[arg-type]
    assert empty.batch == 0 and empty.max_pad == 0 and empty.k[0].shape == (0, G, L, K)
    for name in ("n_layers", "batch", "kv_heads", "k_dim", "v_dim", "capacity", "window"):
        low = -1 if name == "batch" else 0
        with pytest.raises(ValueError, match=f"^{name} must be"):
            KVCache(**{**kw, name: low})  # type: ignore[arg-type]
    for bad in (dict(cos_LR=cos[:, :1], sin_LR=sin[:, :1]), dict(cos_LR=cos[:, :0], sin_LR=sin[:, :0]),
                dict(cos_LR=cos[:, :R - 1], sin_LR=sin[:, :R - 1]), dict(sin_LR=sin[:, :R - 2]), dict(cos_LR=cos[0]),
                dict(cos_LR=torch.cat([cos, cos[:1]]), sin_LR=torch.cat([sin, sin[:1]]))):
        with pytest.raises(ValueError, match=r"cos_LR and sin_LR must both be \[\d+, R\] with R even"):
            KVCache(**{**kw, **bad})  # type: ignore[arg-type]
    two = rope_cos_sin(L, 2, 10000.0, "cpu", torch.float32)  # the smallest rotary part: one pair
    assert KVCache(**{**kw, "cos_LR": two[0], "sin_LR": two[1]}).cos_LR is two[0]  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"pad_B must have shape \({B},\), got \({B + 1},\)"):
        KVCache(**{**kw, "pad_B": torch.zeros(B + 1, dtype=torch.long)})  # type: ignore[arg-type]


@pytest.mark.reference
def test_kept_rows_and_a_reset_cache_decode_their_own_sequences(gen):
    """fp64: ``keep_rows`` keeps a random subset of left-padded rows in a random order, each
    with its padding and its columns, and a decode step then gives each kept row its whole
    sequence's logits; keeping no row leaves a cache of none. ``reset`` empties the cache in
    place (the same tensors, zeroed, as a fresh zeroed cache) for new rows, which then prefill
    and decode as on a fresh cache; new rows of another count are refused."""
    model = small_gpt(max_seq_len=24).double().eval()
    _randomize(model, gen)
    V, B = model.config.vocab_size, 5
    lens = (torch.randperm(8, generator=gen)[:B] + 1).tolist()  # distinct: the kept rows are padded unequally
    P = max(lens)
    rows = [_prompt(gen, n, V) for n in lens]
    cache = model.new_cache(torch.tensor([P - n for n in lens]), 16, zeroed=True)
    with torch.no_grad():
        logits = model.forward_cached(torch.tensor([[0] * (P - len(r)) + r for r in rows]), cache)
        keep = torch.randperm(B, generator=gen)[:3]
        k_before, v_before, pad_before = [t.clone() for t in cache.k], [t.clone() for t in cache.v], cache.pad_B.clone()
        cache.keep_rows(keep)
        assert cache.batch == 3 and torch.equal(cache.pad_B, pad_before[keep])
        assert cache.max_pad == max(P - lens[i] for i in keep.tolist()) and cache.length == P
        for after, before in zip((*cache.k, *cache.v), (*k_before, *v_before)):
            assert torch.equal(after, before[keep])
        kept = [list(rows[i]) for i in keep.tolist()]
        next_B = logits[keep].argmax(-1)
        for _ in range(2):
            for r, t in zip(kept, next_B.tolist()):
                r.append(t)
            logits = model.forward_cached(next_B.unsqueeze(1), cache)
            for b, r in enumerate(kept):
                torch.testing.assert_close(logits[b], _whole(model, r), **TOL)
            next_B = logits.argmax(-1)
        cache.keep_rows(torch.zeros(0, dtype=torch.long))
        assert cache.batch == 0 and cache.max_pad == 0 and all(t.shape[0] == 0 for t in (*cache.k, *cache.v))
        cache.reset(torch.zeros(0, dtype=torch.long))  # (no row: no padding to read)
        assert cache.batch == 0 and cache.max_pad == 0 and cache.length == 0

        cache = model.new_cache(torch.tensor([P - n for n in lens]), 16, zeroed=True)
        model.forward_cached(torch.tensor([[0] * (P - len(r)) + r for r in rows]), cache)
        tensors = [t.data_ptr() for t in (*cache.k, *cache.v)]
        new_lens = (torch.randperm(8, generator=gen)[:B] + 1).tolist()
        new_rows = [_prompt(gen, n, V) for n in new_lens]
        Q = max(new_lens)
        pad_B = torch.tensor([Q - n for n in new_lens])
        cache.reset(pad_B)
        assert [t.data_ptr() for t in (*cache.k, *cache.v)] == tensors
        assert all(t.eq(0).all() for t in (*cache.k, *cache.v)) and cache.length == 0
        assert torch.equal(cache.pad_B, pad_B) and cache.max_pad == Q - min(new_lens)
        logits = model.forward_cached(torch.tensor([[0] * (Q - len(r)) + r for r in new_rows]), cache)
        for b, r in enumerate(new_rows):
            torch.testing.assert_close(logits[b], _whole(model, r), **TOL)
        next_B = logits.argmax(-1)
        step = model.decode_step(next_B, torch.tensor(Q), cache)
        for b, r in enumerate(new_rows):
            torch.testing.assert_close(step[b], _whole(model, r + [int(next_B[b])]), **TOL)
        with pytest.raises(ValueError, match=r"pad_B must have shape \(5,\), got \(4,\)"):
            cache.reset(pad_B[:4])


@pytest.mark.reference
@pytest.mark.parametrize("kind", ["gqa", "yarn-head"])
def test_static_steps_from_the_first_column_give_the_whole_sequences_logits(kind, gen):
    """fp64: a sequence fed a token a step through ``decode_step`` from column 0 of a zeroed
    cache (no prefill), every row at its own column (``pos [B]``, rows started at different
    steps), gives each row's whole-prefix logits at every step: the step's rotary position is
    the column minus the padding from the first column on."""
    model = kind_gpt(kind, torch.float64, gen)
    V, B, n = model.config.vocab_size, 3, 7
    rows = [_prompt(gen, n, V) for _ in range(B)]
    start = torch.randperm(3, generator=gen)  # row b starts after start[b] steps of the others
    cache = model.new_cache(torch.zeros(B, dtype=torch.long), 16, zeroed=True)
    with torch.no_grad():
        for step in range(n + 2):
            col = (step - start).clamp(0, n - 1)
            logits = model.decode_step(torch.tensor([rows[b][int(col[b])] for b in range(B)]), col, cache)
            for b in range(B):
                if step - int(start[b]) in range(n):  # (a row not yet started rewrites its column 0)
                    torch.testing.assert_close(logits[b], _whole(model, rows[b][:int(col[b]) + 1]), **TOL)


@pytest.mark.reference
def test_step_tensors_are_made_on_the_caches_device():
    """Every tensor ``step_inputs`` and ``static_step`` make names the cache's device: with
    ``meta`` as the default device they come out on the CPU, equal to those made without it
    (prefill, chunk and decode of a padded sliding-window cache; a step at one column and at a
    column per row)."""
    cos, sin = rope_cos_sin(12, 4, 10000.0, "cpu", torch.float64)
    pad, pos, pos_B = torch.tensor([0, 3, 1]), torch.tensor(9), torch.tensor([9, 4, 6])

    def fields(step) -> list:  # type: ignore[no-untyped-def]
        return [getattr(step, f.name) for f in dataclasses.fields(step) if isinstance(getattr(step, f.name), torch.Tensor)]

    def calls(cache: KVCache) -> list[torch.Tensor]:
        out = []
        for length, S in ((0, 5), (5, 3), (8, 1)):
            cache.length = length
            out += fields(step_inputs(cache, S))
        return out + fields(static_step(cache, pos)) + fields(static_step(cache, pos_B))

    def cache() -> KVCache:
        return KVCache(n_layers=1, batch=3, kv_heads=1, k_dim=4, v_dim=4, capacity=12, pad_B=pad, cos_LR=cos,
                       sin_LR=sin, window=3, device="cpu", dtype=torch.float64, zeroed=True)

    want = calls(cache())
    with torch.device("meta"):
        got = calls(cache())
    assert len(got) == len(want) and all(g.device.type == "cpu" and torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.reference
@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_sliding_and_full_blocks_without_sinks_decode_an_unpadded_row(n_kv_heads, gen):
    """fp64, Qwen2-MoE's layout (a sliding block before full ones, no sinks): an unpadded row
    prefilled, then a chunk behind it, then decoded a token a call, gives the whole sequence's
    last logits after every call. The full blocks read the call's plain mask, which a window
    on the cache must not turn into SDPA's causal triangle (aligned top left: a decode query
    would see column 0 alone)."""
    attention = AttentionConfig(sliding_window=3, sliding_layers=(0,))
    model = MoEGPT(GPTConfig(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=32,
                             moe_every=2, num_experts=4, top_k=2, expert_hidden=24, attention=attention),
                   dtype=torch.float64).eval()
    _randomize(model, gen)
    row = _prompt(gen, 12, 61)
    cache = model.new_cache(torch.zeros(1, dtype=torch.long), 16)
    with torch.no_grad():
        col = 0
        for size in (5, 3, 1, 1, 1, 1):
            logits = model.forward_cached(torch.tensor([row[col:col + size]]), cache)
            col += size
            torch.testing.assert_close(logits[0], _whole(model, row[:col]), **TOL)


@pytest.mark.reference
def test_only_real_tokens_reach_the_moe_and_columns_behind_every_pad_need_no_index(gen):
    """``StepInputs.real_T``: the flat indices of a call's real tokens on a left-padded cache
    (a prefill, a chunk still partly pad), so each MoE layer routes those alone (its counts sum
    to top_k per real token: padding takes no expert capacity); None, with nothing read on the
    host, for a call whose columns all lie at or behind the deepest pad."""
    model = small_gpt(max_seq_len=24).eval()
    B = 4
    pad = torch.randperm(6, generator=gen)[:B]
    cache = model.new_cache(pad, 16)
    max_pad = int(pad.max())
    for start, S in ((0, 7), (0, 1), (1, max_pad), (max_pad - 1, 2), (max_pad, 3), (max_pad, 1), (max_pad + 2, 1)):
        cache.length = start
        with SyncCounter() as counter:
            real_T = step_inputs(cache, S).real_T
        if start >= max_pad:
            assert real_T is None and counter.seen == [], (start, S)
        else:
            want = [b * S + s for b in range(B) for s in range(S) if start + s >= int(pad[b])]
            assert real_T.tolist() == want, (start, S)
    cache.length = 0
    idx = torch.randint(0, 61, (B, 8), generator=gen)
    with torch.no_grad():
        model.forward_cached(idx, cache)
        real = int((8 - pad).sum())
        assert [int(layer.last_counts_E.sum()) for layer in moe_layers(model)] == [real * 2]
        model.forward_cached(idx[:, :1], cache)
        assert [int(layer.last_counts_E.sum()) for layer in moe_layers(model)] == [B * 2]
