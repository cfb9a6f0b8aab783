"""Generation with ``MoEGPT`` (``moeflow.models.generation``): the KV-cached path against the
plain loop (tokens and logits), ragged batches against each prompt alone, stop tokens, the
sampling cuts (top-k, top-p), argument errors, ``moeflow generate``'s flags, and where the draws
run: on the generator's device (a CPU generator with a CUDA model works), the command's generator
on the model's (``@pytest.mark.gpu`` tests check both on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

import moeflow
from moeflow.models.generation import SamplingConfig, draw_device, generate, generate_uncached, sample_next

from helpers import needs_cuda, rand, small_gpt, train_tiny_run


def _prompts(gen: torch.Generator, lengths: list[int], vocab: int = 61) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_decode_logits_equal_the_full_forward(gen, dtype) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=24).to(dtype).eval()
    seq = torch.randint(0, 61, (3, 24), generator=gen)
    with torch.no_grad():
        full_BSV = model(seq)
        cache = model.new_cache(torch.zeros(3, dtype=torch.long), 24)
        steps = [model.forward_cached(seq[:, :6], cache)]  # prefill, then one token at a time
        steps += [model.forward_cached(seq[:, j:j + 1], cache) for j in range(6, 24)]
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.stack(steps, 1), full_BSV[:, 5:], **tol)
    assert cache.length == 24
    with pytest.raises(ValueError, match="holds 24 columns"):
        model.forward_cached(seq[:, :1], cache)


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cached_greedy_tokens_equal_the_uncached_loop_past_max_seq_len(gen, dtype) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=16, n_kv_heads=1).to(dtype).eval()
    idx = torch.randint(0, 61, (2, 9), generator=gen)
    cached = model.generate(idx, 20, temperature=0)  # slides past max_seq_len after 7 tokens
    plain = model.generate(idx, 20, temperature=0, use_cache=False)
    assert cached.shape == (2, 29) and torch.equal(cached, plain)
    assert generate(model, idx, 20, temperature=0).tokens == generate_uncached(model, idx, 20, temperature=0)


@pytest.mark.reference
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ragged_batch_gives_each_prompt_what_it_gets_alone(gen, dtype) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=20).to(dtype).eval()
    prompts = _prompts(gen, [3, 11, 1, 23, 7])
    batch = generate(model, prompts, 14, temperature=0)  # 23 > max_seq_len: cropped at once; 11 slides later
    alone = [generate(model, [p], 14, temperature=0).tokens[0] for p in prompts]
    plain = [generate_uncached(model, torch.tensor([p]), 14, temperature=0)[0] for p in prompts]
    assert batch.tokens == alone == plain
    assert batch.prefill_tokens == 45 and batch.decode_tokens == 5 * 13
    assert batch.prefill_s > 0 and batch.decode_s > 0 and batch.decode_tokens_per_s > 0


@pytest.mark.reference
def test_stop_tokens_end_each_row_and_the_rest_go_on(gen) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=32).double().eval()
    prompts = _prompts(gen, [4, 9, 2])
    free = generate(model, prompts, 12, temperature=0).tokens
    eos = free[0][3]  # row 0 stops at its 4th token (or earlier, if that token came before)
    cut = [row[: row.index(eos) + 1] if eos in row else row for row in free]
    stopped = generate(model, prompts, 12, temperature=0, eos=[eos])
    assert stopped.tokens == cut and len(cut[0]) <= 4
    assert stopped.tokens == [generate(model, [p], 12, temperature=0, eos=eos).tokens[0] for p in prompts]
    # the tensor form: a stopped row repeats its stop token
    idx = torch.tensor([prompts[1][:2], prompts[2]])
    out = model.generate(idx, 12, temperature=0, eos=eos)
    new = generate(model, idx, 12, temperature=0, eos=eos).tokens
    for b, row in enumerate(new):
        assert out[b, 2:2 + len(row)].tolist() == row
        assert (out[b, 2 + len(row):] == row[-1]).all()
    assert out.shape[1] == 2 + max(len(r) for r in new)


@pytest.mark.reference
def test_sampling_is_reproducible_and_cut_to_top_k_and_top_p(gen) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=32).eval()
    prompts = _prompts(gen, [5, 2])
    runs = [generate(model, prompts, 10, temperature=0.9, top_k=5, top_p=0.9,
                     generator=torch.Generator().manual_seed(7)).tokens for _ in range(2)]
    assert runs[0] == runs[1]
    assert generate(model, prompts, 10, temperature=1.5, top_k=1).tokens == generate(model, prompts, 10, temperature=0).tokens

    logits_BV = torch.randn(4, 50, generator=gen) * 3
    g = torch.Generator().manual_seed(3)
    top6_B = [set(r) for r in torch.topk(logits_BV, 6).indices.tolist()]
    draws = torch.stack([sample_next(logits_BV, SamplingConfig(temperature=2.0, top_k=6), g) for _ in range(300)], 1)
    for b in range(4):
        seen = set(draws[b].tolist())
        assert seen <= top6_B[b] and len(seen) > 1
    # top-p: only the smallest set of tokens whose probability reaches p
    probs_BV = logits_BV.softmax(-1)
    draws = torch.stack([sample_next(logits_BV, SamplingConfig(temperature=1.0, top_p=0.7), g) for _ in range(300)], 1)
    for b in range(4):
        p_sorted, order = probs_BV[b].sort(descending=True)
        n = int((p_sorted.cumsum(0) < 0.7).sum()) + 1
        assert set(draws[b].tolist()) <= set(order[:n].tolist())
    tiny = torch.stack([sample_next(logits_BV, SamplingConfig(top_p=1e-6), g) for _ in range(20)], 1)
    assert torch.equal(tiny, logits_BV.argmax(-1, keepdim=True).expand(4, 20))


@pytest.mark.reference
def test_every_step_runs_the_moe_layers_own_forward(gen) -> None:
    """The decode loop goes through each MoE layer (router, dispatcher, experts), so experts
    held in moeflow.storage generate through the same code."""
    model = small_gpt(max_seq_len=32).eval()
    calls: list[int] = []
    for layer in moeflow.moe_layers(model):
        layer.register_forward_hook(lambda mod, args, out: calls.append(args[0].reshape(-1, 32).shape[0]))
    generate(model, [[1, 2, 3], [4]], 5, temperature=0)
    n_moe = len(moeflow.moe_layers(model))
    # prefill sees the 4 real tokens only (no padding), then 4 steps of 2 tokens
    assert calls == [4] * n_moe + [2] * (4 * n_moe)


@pytest.mark.unit
def test_generation_arguments_are_checked_naming_the_value() -> None:
    model = small_gpt()
    ok = [[1, 2]]
    for kwargs, err, needle in [
        (dict(temperature=float("nan")), ValueError, "temperature"), (dict(temperature=math.inf), ValueError, "inf"),
        (dict(temperature=-0.5), ValueError, "-0.5"), (dict(temperature="hot"), TypeError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"), (dict(top_p=1.5), ValueError, "1.5"),
        (dict(top_p=float("nan")), ValueError, "top_p"), (dict(top_k=-1), ValueError, "top_k"),
        (dict(top_k=2.5), TypeError, "top_k"), (dict(eos=61), ValueError, "eos"),
        (dict(eos="x"), TypeError, "eos"), (dict(generator=3), TypeError, "generator"),
    ]:
        with pytest.raises(err, match=needle):
            generate(model, ok, 2, **kwargs)
    with pytest.raises(ValueError, match="^max_new_tokens must be >= 0, got -1"):
        generate(model, ok, -1)
    for prompts, err, needle in [([], TypeError, "prompts"), ([[1], []], ValueError, r"prompts\[1\]"),
                                 ([[1, 61]], ValueError, r"prompts\[0\]: token ids must be in \[0, 61\), got 61"),
                                 ([[1, -2]], ValueError, "-2"), ([[3], [1.5]], TypeError, r"prompts\[1\] holds float 1.5"),
                                 ("abc", TypeError, "prompts"), (["ab"], ValueError, r"prompts\[0\] must be a non-empty"),
                                 ([[1], 5], ValueError, r"prompts\[1\] must be a non-empty"),
                                 (torch.full((1, 2), 61), ValueError, "got 61"),
                                 (torch.zeros(2, 0, dtype=torch.long), ValueError, "at least one token"),
                                 (torch.full((1, 2), 99), ValueError, "99"),
                                 (torch.ones(1, 2), ValueError, r"int tensor \[batch, seq\] .* got torch.float32 \(1, 2\)"),
                                 (torch.ones(1, 2, 2, dtype=torch.long), ValueError, r"got torch.int64 \(1, 2, 2\)"),
                                 (torch.ones(3, dtype=torch.int32), ValueError, r"got torch.int32 \(3,\)")]:
        with pytest.raises(err, match=needle):
            generate(model, prompts, 2)
    # a list may hold its rows as 1-D tensors
    rows = [torch.tensor([5, 9, 2]), [4, 8]]
    assert generate(model, rows, 3, temperature=0).tokens == generate(model, [[5, 9, 2], [4, 8]], 3, temperature=0).tokens
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 1, temperature=float("nan"))
    with pytest.raises(TypeError, match="model must be a decoder such as MoEGPT .* got Linear"):
        generate(torch.nn.Linear(2, 2), ok, 2)
    assert generate(model, ok, 0).tokens == [[]]


@pytest.mark.unit
def test_generate_tensor_defaults_to_the_eager_cached_loop_and_checks_idx(gen, monkeypatch) -> None:
    """``generate_tensor`` (public here, ``MoEGPT.generate``'s body) without ``use_cache`` or
    ``compile`` runs the eager KV-cached loop (``generate`` with ``compile=False``, never the
    uncached one) and returns ``idx`` followed by its tokens; ``idx`` must be a 2-D tensor with
    a column or more (one is enough), anything else a ``ValueError`` naming ``idx``."""
    import moeflow.models.generation as generation

    model = small_gpt(max_seq_len=32).eval()
    B, S, n = int(torch.randint(1, 4, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen)), 4
    calls: list[tuple[str, object]] = []
    real, real_uncached = generation.generate, generation.generate_uncached
    monkeypatch.setattr(generation, "generate",
                        lambda *a, **kw: calls.append(("cached", kw.get("compile"))) or real(*a, **kw))
    monkeypatch.setattr(generation, "generate_uncached",
                        lambda *a, **kw: calls.append(("uncached", None)) or real_uncached(*a, **kw))
    for cols, new, dtype in ((S, n, torch.int64), (1, n, torch.int32), (S, 1, torch.int64), (S, 0, torch.int32)):
        idx = torch.randint(0, 61, (B, cols), generator=gen, dtype=dtype)
        calls.clear()
        out = generation.generate_tensor(model, idx, new, temperature=0)
        assert calls == [("cached", False)] and out.shape == (B, cols + new) and out is not idx
        assert out.dtype == dtype  # idx's own
        assert torch.equal(out[:, :cols], idx) and out[:, cols:].tolist() == real(model, idx, new, temperature=0).tokens
    for bad in (torch.tensor([1, 2]), torch.zeros(1, 2, 2, dtype=torch.long), [[1, 2]], torch.zeros(2, 0, dtype=torch.long)):
        with pytest.raises(ValueError, match=r"idx must be \[batch, seq\] with at least one token per row"):
            generation.generate_tensor(model, bad, 2)  # type: ignore[arg-type]
    idx = torch.randint(0, 61, (B, S), generator=gen)
    calls.clear()
    for flags, err, needle in [(dict(use_cache="yes"), TypeError, "use_cache must be a bool, got str 'yes'"),
                               (dict(compile=1), TypeError, "compile must be a bool, got int 1"),
                               (dict(compile=True, use_cache=False), ValueError, "cannot go with use_cache=False")]:
        with pytest.raises(err, match=needle):
            generation.generate_tensor(model, idx, 2, **flags)  # type: ignore[arg-type]
    assert calls == []  # (a refused call generates nothing)


@pytest.mark.reference
def test_generation_makes_its_tensors_on_the_models_device(gen) -> None:
    """With ``meta`` as the default device a CPU model generates what it generates without it
    (greedy past ``max_seq_len``, where the window slides, and seeded sampling; the cached and
    the plain loop, ``MoEGPT.generate``'s tensor): every tensor a generation makes names the
    model's device."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=16).eval()
    prompts = _prompts(gen, [3, 7])
    idx = torch.tensor([prompts[1]])
    sampling = dict(temperature=0.8, top_k=9, top_p=0.9)

    def run() -> list:  # type: ignore[type-arg]
        return [generate(model, prompts, 14, temperature=0).tokens,
                generate(model, prompts, 6, generator=torch.Generator().manual_seed(1), **sampling).tokens,
                generate_uncached(model, idx, 4, temperature=0), model.generate(idx, 3, temperature=0).tolist()]

    want = run()
    with torch.device("meta"):
        assert run() == want


@pytest.mark.unit
def test_sampling_config_checks_stop_tokens_on_construction() -> None:
    assert SamplingConfig(eos=3).eos == frozenset({3}) and SamplingConfig(eos=None).eos == frozenset()
    assert SamplingConfig(eos=[5, 2, 5]).eos == frozenset({2, 5}) == SamplingConfig(eos=(2, 5)).eos
    for eos, err, needle in [(True, TypeError, "eos must be a token id"), ("x", TypeError, "str 'x'"),
                             ([1, 2.0], TypeError, "eos holds float 2.0"), ([4, -1], ValueError, "eos.*-1")]:
        with pytest.raises(err, match=needle):
            SamplingConfig(eos=eos)
    SamplingConfig(eos=[60]).check_vocab(61)
    with pytest.raises(ValueError, match=r"eos: token ids must be in \[0, 61\), got 61"):
        SamplingConfig(eos=[3, 61]).check_vocab(61)


@pytest.mark.e2e
def test_cli_generate_batches_prompts_and_rejects_bad_values(tmp_path, capsys) -> None:
    from moeflow.cli.main import main

    run = train_tiny_run(tmp_path / "run")
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO.\n\nJULIET. O\nKING\n")
    assert main(["generate", run, "--prompts-file", str(prompts), "--batch-size", "2", "--max-new-tokens", "6",
                 "--temperature", "0", "--eos", "\\n"]) == 0
    out, err = capsys.readouterr()
    texts = out.split("### prompt ")[1:]
    bodies = [t.split("\n", 1)[1] for t in texts]
    assert [b.startswith(p) for b, p in zip(bodies, ["ROMEO.", "JULIET. O", "KING"])] == [True] * 3 == [True] * len(bodies)
    assert "prefill: 19 tokens" in err and "decode:" in err and "tokens/s" in err
    assert err.splitlines()[0] == ("device: cuda:0 (default: CUDA is available)" if torch.cuda.is_available() else
                                   "device: cpu (default: CUDA is not available)")
    # greedy: a batch gives what each prompt gets alone
    assert main(["generate", run, "--prompt", "JULIET. O", "--max-new-tokens", "6", "--temperature", "0",
                 "--eos", "10"]) == 0
    assert capsys.readouterr().out == bodies[1]
    # the old spellings still work, with a note
    assert main(["generate", run, "--tokens", "2", "--top-k", "3"]) == 0
    assert "deprecated" in capsys.readouterr().err
    for flags, needle in [(["--temperature", "-1"], "--temperature"), (["--top-k", "-1"], "--top-k"),
                          (["--top-p", "0"], "--top-p"), (["--top-p", "1.5"], "1.5"),
                          (["--sample-top-k", "-2"], "--sample-top-k"), (["--max-new-tokens", "-1"], "-1"),
                          (["--batch-size", "0"], "--batch-size"), (["--eos", "999"], "999"),
                          (["--eos", "ab"], "2 tokens"), (["--prompts-file", str(tmp_path / "none")], "cannot read"),
                          (["--tokens", "2", "--max-new-tokens", "2"], "one of them"), (["--seed", "-1"], "--seed")]:
        assert main(["generate", run, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err, (flags, err)


@pytest.mark.unit
def test_draws_run_on_the_generators_device_and_the_cli_makes_it_on_the_models(monkeypatch) -> None:
    """``sample_next`` draws where its generator lives (torch can draw nowhere else), on the
    logits' device without one; ``moeflow generate`` asks for its generator on the device of
    the model's logits, so a CUDA model draws on CUDA (checked on a meta model: no CUDA here)."""
    from moeflow.cli.generate import seeded_generator

    cuda0 = torch.device("cuda", 0)
    assert draw_device(None, cuda0) == cuda0 and draw_device(torch.Generator(), cuda0) == torch.device("cpu")
    assert draw_device(torch.Generator(), torch.device("cpu")) == torch.device("cpu")
    asked: list[torch.device] = []

    class Recorder:
        def __init__(self, device: object = "cpu") -> None:
            asked.append(torch.device(device))

        def manual_seed(self, seed: int) -> "Recorder":
            return self

    monkeypatch.setattr(torch, "Generator", Recorder)
    seeded_generator(small_gpt().to("meta"), 3)
    seeded_generator(small_gpt(), 3)
    assert asked == [torch.device("meta"), torch.device("cpu")]


@pytest.mark.reference
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("options", [dict(temperature=0.9), dict(temperature=1.3, top_k=5), dict(top_p=0.8),
                                     dict(temperature=0.7, top_k=10, top_p=0.9)])
def test_gpu_sampling_with_a_cpu_or_a_cuda_generator(options) -> None:
    """On CUDA every sampling option runs with a generator on either device: a CPU generator
    draws what it draws for the same (fp64) model on the CPU; a CUDA one repeats per seed."""
    torch.manual_seed(0)
    cpu_model = small_gpt(max_seq_len=32).double().eval()
    cuda_model = small_gpt(max_seq_len=32).double().eval()
    cuda_model.load_state_dict(cpu_model.state_dict())
    cuda_model.cuda()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    on_cpu = generate(cpu_model, prompts, 12, generator=torch.Generator().manual_seed(5), **options).tokens
    mixed = generate(cuda_model, prompts, 12, generator=torch.Generator().manual_seed(5), **options).tokens
    assert mixed == on_cpu
    runs = [generate(cuda_model, prompts, 12, generator=torch.Generator(device="cuda").manual_seed(5), **options).tokens
            for _ in range(2)]
    assert runs[0] == runs[1] and all(0 <= t < 61 for row in runs[0] for t in row)
    out = cuda_model.generate(torch.tensor(prompts[1:2], device="cuda"), 6, generator=torch.Generator().manual_seed(1),
                              **options)
    assert out.device.type == "cuda" and out.shape == (1, 11)
    logits_BV = torch.randn(3, 61, device="cuda")
    next_B = sample_next(logits_BV, SamplingConfig(**options), torch.Generator().manual_seed(2))
    assert next_B.device == logits_BV.device and next_B.dtype == torch.int64


@pytest.mark.e2e
@pytest.mark.gpu
@needs_cuda
def test_gpu_cli_generate_samples_on_cuda_with_and_without_offload(tmp_path, capsys) -> None:
    """`moeflow generate --device cuda` with sampling (the crash: a CPU generator for CUDA
    logits), in memory and with the experts offloaded; the same --seed gives the same text."""
    from moeflow.cli.main import main

    run = train_tiny_run(tmp_path / "run")
    capsys.readouterr()
    sampling = ["--temperature", "0.9", "--sample-top-k", "8", "--top-p", "0.95", "--max-new-tokens", "8",
                "--seed", "3"]
    for offload in ([], ["--offload", "host"], ["--offload", "disk"]):
        texts = []
        for i, device in enumerate((["--device", "cuda"], [])):  # explicit, and the default on a CUDA machine
            where = ["--dir", str(tmp_path / f"disk{i}")] if "disk" in offload else []
            assert main(["generate", run, *device, *sampling, *offload, *where]) == 0, offload
            out, err = capsys.readouterr()
            assert "device: cuda:0 (" in err, err
            texts.append(out)
        assert texts[0] == texts[1] and texts[0].startswith("ROMEO."), (offload, texts)


# ----------------------------------------------------------------------------- decode-shaped MoE


@pytest.mark.reference
@pytest.mark.parametrize("weight_at", ["combine", "dispatch"])
@pytest.mark.parametrize(("T", "K"), [(1, 2), (1, 1), (5, 3), (64, 2)])
def test_no_grad_dropless_run_equals_dispatch_then_combine(gen, weight_at, T, K) -> None:
    """The inference path of the local dispatcher (a decode step: a few tokens, no autograd)
    gives what dispatch -> experts -> combine gives, for built-in and per-module experts."""
    from moeflow.config import DispatchConfig
    from moeflow.experts import ModuleExperts

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    for experts in (None, ModuleExperts([torch.nn.Linear(16, 16) for _ in range(6)])):
        layer = moeflow.MoE(dim=16, hidden=24, num_experts=6, top_k=K, capacity_factor=0.0,
                            dispatch=DispatchConfig(weight_at=weight_at), experts_module=experts).double()
        x_TD = rand(gen, T, 16)
        routing = layer.router(x_TD, top_k=K)
        expert_in, plan = layer.dispatcher.dispatch(x_TD, routing, capacity_factor=0.0)
        ref_TD = layer.dispatcher.combine(layer.experts(expert_in, plan.counts_E), plan)
        with torch.no_grad():
            fast_TD = layer.dispatcher.run_dropless_no_grad(x_TD, routing, layer.experts)
            torch.testing.assert_close(fast_TD, ref_TD.detach(), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer(x_TD), ref_TD.detach() + (layer.shared(x_TD) if layer.shared else 0),
                                       rtol=1e-12, atol=1e-12)


@pytest.mark.integration
def test_generate_benchmark_matches_transformers_tokens(tmp_path) -> None:
    """The benchmark's own check at a tiny size: transformers' Mixtral, loaded from moeflow's
    export, generates the same greedy tokens as moeflow (B=2, 6 new tokens)."""
    pytest.importorskip("transformers")
    import json

    from bench.generate import main as bench_main

    out = tmp_path / "generate.json"
    assert bench_main(["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--hidden", "48",
                       "--vocab", "96", "--prompt-len", "5", "--batch-sizes", "2", "--new-tokens", "6",
                       "--repeats", "1", "--threads", "1", "--hf-experts", "grouped_mm,eager", "--layer-tokens", "1,3",
                       "--layer-calls", "2", "--no-compiled", "--json", str(out)]) == 0  # (compiled: gpu_check's smoke)
    report = json.loads(out.read_text())
    assert {r["candidate"] for r in report["results"]} == {"moeflow", "hf:grouped_mm", "hf:eager"}
    assert all(r["tokens_vs_moeflow"] == "identical" for r in report["results"])
    assert all(r["max_abs_diff"] < 1e-5 for r in report["layer"]) and len(report["layer"]) == 8


@pytest.mark.reference
def test_the_uncached_reference_takes_every_argument_generate_takes(gen) -> None:
    """``generate_uncached`` is the reference loop, so it must honour what ``generate`` is given:
    draws from the generator it is handed (the same tokens for the same seed as ``generate``,
    the global RNG untouched), a temperature of 1 by default in both, stop ids that end a row
    after its stop token (every row stopping ends the loop and still returns), and a generator
    that is not one refused by name."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = small_gpt(max_seq_len=32).double().eval()
    idx = torch.randint(0, 61, (2, 5), generator=gen)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    state = torch.get_rng_state()
    drawn = generate_uncached(model, idx, 6, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(torch.get_rng_state(), state)
    assert drawn == generate(model, idx.tolist(), 6, generator=torch.Generator().manual_seed(seed)).tokens
    assert drawn == generate_uncached(model, idx, 6, temperature=1.0, generator=torch.Generator().manual_seed(seed))
    hot = generate_uncached(model, idx, 6, temperature=2.0, generator=torch.Generator().manual_seed(seed))
    cached_hot = generate(model, idx.tolist(), 6, temperature=2.0, generator=torch.Generator().manual_seed(seed)).tokens
    assert cached_hot == hot and hot != drawn  # the temperature tells: so 1 is the default, below
    assert generate(model, idx.tolist(), 6, temperature=1.0, generator=torch.Generator().manual_seed(seed)).tokens == \
        generate(model, idx.tolist(), 6, generator=torch.Generator().manual_seed(seed)).tokens
    greedy = generate_uncached(model, idx, 6, temperature=0)
    stop = greedy[0][2]
    cut = generate_uncached(model, idx, 6, temperature=0, eos=stop)
    assert cut == generate(model, idx.tolist(), 6, temperature=0, eos=stop).tokens
    assert cut[0] == greedy[0][:greedy[0].index(stop) + 1]
    every = generate_uncached(model, idx, 6, temperature=0, eos=[greedy[0][0], greedy[1][0]])
    assert every == [[greedy[0][0]], [greedy[1][0]]]
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        generate_uncached(model, idx, 2, generator=seed)


@pytest.mark.unit
def test_the_uncached_reference_takes_prompts_as_lists_too(gen) -> None:
    """A list of rows gives the tensor's tokens (it failed past its check, on ``.shape``), made
    on the model's device rather than the default one (a ``meta`` default device stands for a
    GPU's), and a bad list is refused by name before the model runs."""
    model = small_gpt(max_seq_len=32).eval()
    idx = torch.randint(0, 61, (2, 5), generator=gen)
    want = generate_uncached(model, idx, 4, temperature=0)
    with torch.device("meta"):
        assert generate_uncached(model, idx.tolist(), 4, temperature=0) == want
    with pytest.raises(ValueError, match=r"prompts: token ids must be in \[0, 61\), got 61"):
        generate_uncached(model, [[1, 2], [3, 61]], 2, temperature=0)
