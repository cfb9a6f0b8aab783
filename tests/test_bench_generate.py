"""``bench.generate``'s honest decode figures (``bench.generate_checks``, ``bench.generate_runs``,
``bench.common``): the bytes a decode step must read against a hand count, the bandwidth
fraction's arithmetic, the experts a step hits, the fp32 token check catching a planted
difference, the first-step logits comparison, the warm-up that waits for the time to settle,
the like-with-like ratios and their withdrawal, transformers' static-cache generate reusing one
``StaticCache`` without compiling again, and the bench's report on a tiny model."""

from __future__ import annotations

import json
import time

import pytest
import torch

from bench import generate_checks as checks
from bench import generate_runs as runs
from bench.common import CompileWatch, copy_bandwidth_gbps


def _tiny(**overrides):  # type: ignore[no-untyped-def]
    from moeflow.config import RouterConfig
    from moeflow.models import GPTConfig, MoEGPT

    fields = dict(vocab_size=32, dim=16, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=24, moe_every=1,
                  num_experts=4, top_k=2, expert_hidden=8, router=RouterConfig(scoring="topk_softmax"), init_std=0.05)
    torch.manual_seed(0)
    return MoEGPT(GPTConfig(**{**fields, **overrides})).eval()


@pytest.mark.unit
def test_step_bytes_match_a_hand_count():
    model = _tiny()
    got = checks.decode_step_bytes(model, rows=2, cache_len=5, experts_hit=[2, 3])
    # per block: q 16x16, k and v 8x16 (2 KV heads of 4), o 16x16, two norms of 16, router 4x16
    dense = 2 * (256 + 128 + 128 + 256 + 2 * 16 + 4 * 16) + 16 + 32 * 16  # + the final norm, the head 32x16
    per_expert = 16 * 16 + 8 * 16  # w_in [D, 2H] and w_out [H, D] of one expert
    kv = 2 * 2 * 2 * 2 * 4 * 5  # keys and values, 2 blocks, 2 rows, 2 KV heads, head dim 4, 5 columns
    want = {"embedding": 2 * 16 * 4, "dense": dense * 4, "experts": (2 + 3) * per_expert * 4, "kv_cache": kv * 4}
    assert got == {**want, "total": sum(want.values())}
    # a head that shares the embedding reads all of it, once; bf16 halves every count
    tied = checks.decode_step_bytes(_tiny(tie_embeddings=True), rows=2, cache_len=5, experts_hit=[2, 3])
    assert tied["embedding"] == 0 and tied["dense"] == want["dense"]
    half = checks.decode_step_bytes(model.to(torch.bfloat16), rows=2, cache_len=5, experts_hit=[2, 3])
    assert half["total"] == got["total"] / 2
    with pytest.raises(ValueError, match="experts_hit"):
        checks.decode_step_bytes(model, rows=2, cache_len=5, experts_hit=[2, 5])
    with pytest.raises(ValueError, match="rows"):
        checks.decode_step_bytes(model, rows=0, cache_len=5, experts_hit=[2, 2])


@pytest.mark.unit
def test_bandwidth_fraction_arithmetic():
    # 3 GB a step at 3000 GB/s is 1 ms: a 4 ms step is at a quarter of the limit
    assert checks.bandwidth_fraction(3e9, 3000.0, 4e-3) == pytest.approx(0.25)
    assert checks.bandwidth_fraction(5e8, 250.0, 2e-3) == pytest.approx(1.0)
    for bad in [(0, 1.0, 1.0), (1.0, -2.0, 1.0), (1.0, 1.0, 0.0)]:
        with pytest.raises(ValueError, match="must be > 0"):
            checks.bandwidth_fraction(*bad)


@pytest.mark.unit
def test_copy_bandwidth_is_measured_and_checked():
    assert copy_bandwidth_gbps("cpu", nbytes=2**22, repeats=2) > 0
    with pytest.raises(ValueError, match="nbytes"):
        copy_bandwidth_gbps("cpu", nbytes=1000)
    with pytest.raises(ValueError, match="repeats"):
        copy_bandwidth_gbps("cpu", nbytes=2**22, repeats=0)


@pytest.mark.unit
def test_router_hits_count_the_experts_each_decode_step_selects():
    from moeflow.models.generation import generate

    model = _tiny()
    idx = torch.randint(0, 32, (1, 5), generator=torch.Generator().manual_seed(1))
    with checks.RouterHits(model) as hits:
        generate(model, idx, 6, temperature=0)
    assert [len(c) for c in hits.calls] == [6, 6]  # the prefill and 5 decode steps in each MoE layer
    assert hits.per_step() == [2.0, 2.0]  # one row: its top-2, two distinct experts
    idx = torch.randint(0, 32, (3, 5), generator=torch.Generator().manual_seed(2))
    with checks.RouterHits(model) as hits:
        generate(model, idx, 6, temperature=0)
    assert all(2 <= h <= 4 for h in hits.per_step())
    assert not any(layer.router._forward_hooks for layer in hits.layers)  # the hooks are gone


@pytest.mark.unit
def test_token_agreement_names_the_first_differing_step():
    a = [[5, 6, 7, 8], [1, 2, 3, 4]]
    assert checks.token_agreement(a, [r[:] for r in a]) == "identical"
    assert checks.token_agreement(a, [[5, 6, 7, 9], [1, 2, 0, 4]]) == "differ from step 2"
    assert checks.token_agreement(a, [[5, 6], [1, 2, 3, 4]]) == "differ from step 2"  # a row that ends early


@pytest.mark.unit
def test_the_fp32_check_catches_a_planted_difference(monkeypatch):
    import moeflow.models.generation as generation

    model = _tiny()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(3))
    real = generation.generate

    def planted(model, idx, n, **kw):  # type: ignore[no-untyped-def]
        out = real(model, idx, n, **{**kw, "compile": False})  # (the eager tokens, one changed when compiled)
        if kw.get("compile"):
            out.tokens[1][3] = (out.tokens[1][3] + 1) % 32
        return out

    monkeypatch.setattr(generation, "generate", planted)
    got = checks.fp32_token_check(model, idx, 6)
    assert got == {"checked": True, "equal": False, "agreement": "differ from step 3", "rows": 2, "new_tokens": 6}
    monkeypatch.setattr(generation, "generate",
                        lambda model, idx, n, **kw: real(model, idx, n, **{**kw, "compile": False}))
    assert checks.fp32_token_check(model, idx, 6)["equal"] is True
    with pytest.raises(ValueError, match="fp32"):
        checks.fp32_token_check(model.to(torch.bfloat16), idx, 6)


@pytest.mark.unit
def test_logits_difference_and_the_eager_step():
    ref = torch.tensor([[1.0, 4.0, -2.0], [0.5, 0.0, 3.0]])
    got = ref + torch.tensor([[0.0, 0.2, 0.0], [0.0, 4.0, 0.0]])  # row 1's argmax moves
    d = checks.logits_difference(got, ref)
    assert d == {"max_abs": pytest.approx(4.0), "max_rel": pytest.approx(1.0), "top1_agree": 0.5}
    with pytest.raises(ValueError, match="shapes"):
        checks.logits_difference(got[:1], ref)
    # the eager step's logits are the whole sequence's last column (up to rounding)
    model = _tiny()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    first = torch.tensor([3, 7])
    want = model(torch.cat([idx, first[:, None]], 1))[:, -1]
    torch.testing.assert_close(checks.eager_step_logits(model, idx, first), want.detach(), rtol=1e-5, atol=1e-5)
    bf16 = checks.first_step_logits(_tiny().to(torch.bfloat16), model, idx)
    assert set(bf16) == {"moeflow"} and 0 < bf16["moeflow"]["max_rel"] < 0.05  # bf16 rounding, not a bug


@pytest.mark.unit
def test_warm_up_runs_until_two_calls_agree():
    def calls(times):  # type: ignore[no-untyped-def]
        it = iter(times)
        return lambda: ([[0]], 0.0, next(it))

    got = runs.warm_until_settled(calls([30.0, 1.3, 1.0, 1.02, 9.0]), tol=0.05)
    assert got == {"calls": 4, "settled": True, "decode_s": [30.0, 1.3, 1.0, 1.02]}
    got = runs.warm_until_settled(calls([30.0, 1.0, 1.01, 1.0]), tol=0.05)
    assert got["calls"] == 3 and got["settled"]  # at least three: a compilation, then two to compare
    got = runs.warm_until_settled(calls([5.0, 4.0, 3.0, 2.0, 1.0, 9.0]), tol=0.05, max_calls=5)
    assert got["calls"] == 5 and not got["settled"]
    with pytest.raises(ValueError, match="min_calls"):
        runs.warm_until_settled(calls([1.0]), min_calls=4, max_calls=3)


def _row(name: str, tok_s: float, graphs: int = 0, cuda_graphs: int = 0) -> dict:
    return {"batch": 1, "new_tokens": 9, "candidate": name, "decode_tok_s": tok_s, "prefill_tok_s": 2 * tok_s,
            "timed_compile": {"graphs": graphs, "cuda_graphs": cuda_graphs, "recompiles": []}}


@pytest.mark.unit
def test_ratios_compare_like_with_like_and_withdraw_a_recording_side():
    rows = [_row("moeflow", 80.0), _row("moeflow:compiled", 1000.0), _row("hf:eager", 50.0),
            _row("hf:grouped_mm", 100.0), _row("hf:static", 400.0)]
    got = {r["pair"]: r for r in checks.like_for_like_ratios(rows)}
    assert list(got) == ["moeflow eager / transformers eager", "moeflow compiled / transformers static-cache compiled",
                         "moeflow compiled / moeflow eager"]
    eager = got["moeflow eager / transformers eager"]
    assert (eager["baseline"], eager["decode_x"], eager["withdrawn"]) == ("hf:grouped_mm", 0.8, None)  # the fastest
    assert got["moeflow compiled / transformers static-cache compiled"]["decode_x"] == 2.5
    assert all(r["baseline"] in ("hf:static", "moeflow") for r in got.values() if r["candidate"] == "moeflow:compiled")
    rows[-1] = _row("hf:static", 40.0, cuda_graphs=254)  # transformers recording its graphs at every call
    got = {r["pair"]: r for r in checks.like_for_like_ratios(rows)}
    static = got["moeflow compiled / transformers static-cache compiled"]
    assert static["decode_x"] is None and "hf:static" in static["withdrawn"]
    assert "254 CUDA graphs recorded" in static["withdrawn"]
    assert got["moeflow compiled / moeflow eager"]["withdrawn"] is None


@pytest.mark.e2e
def test_compile_watch_counts_a_recompile():
    f = torch.compile(lambda x: x * 2 + 1, dynamic=False)
    with CompileWatch() as first:
        f(torch.randn(3))
    with CompileWatch() as again:
        f(torch.randn(3))
    with CompileWatch() as other:
        f(torch.randn(5))
    assert (first.graphs, again.graphs, other.graphs) == (1, 0, 1)
    assert again.recompiles == [] and "size mismatch" in other.recompiles[0]


@pytest.mark.e2e
def test_transformers_static_cache_is_made_once_and_reused_without_compiling_again(tmp_path):
    pytest.importorskip("transformers")
    import argparse

    from bench.generate import build_model, load_hf
    from moeflow.convert.mixtral import gpt_to_hf

    args = argparse.Namespace(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, experts=4, top_k=2, hidden=32,
                              init_std=0.05, seed=0)
    gpt_to_hf(build_model(args, 16), tmp_path / "hf")
    hf = load_hf(tmp_path / "hf")
    hf.set_experts_implementation("grouped_mm")
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    static = runs.HFStaticGenerate(hf)
    with CompileWatch() as first:
        tokens, _, _ = static(idx, 6, time.perf_counter)
    cache = static.caches[(2, 11)]
    keys = cache.layers[0].keys
    with CompileWatch() as second:
        again, _, _ = static(idx, 6, time.perf_counter)
    assert first.graphs >= 1 and second.graphs == 0 and second.recompiles == []  # compiled once, then replayed
    assert static.caches_made == 1 and static.caches[(2, 11)] is cache and cache.layers[0].keys is keys
    eager, _, _ = runs.run_hf(hf, idx, 6, time.perf_counter)
    assert tokens == again == eager


@pytest.mark.e2e
def test_generate_bench_report_on_a_tiny_model(tmp_path):
    pytest.importorskip("transformers")
    from bench.generate import main

    out = tmp_path / "generate.json"
    assert main(["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--hidden", "32", "--experts", "4",
                 "--vocab", "64", "--prompt-len", "5", "--batch-sizes", "1,2", "--new-tokens", "6", "--repeats", "1",
                 "--threads", "1", "--hf-experts", "grouped_mm", "--layer-tokens", "", "--max-warmups", "3",
                 "--fp32-check-batches", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"copy_gbps", "cases", "ratios", "hf_static", "results"} <= set(report) and report["copy_gbps"] > 0
    assert report["hf_static"].startswith("not run")  # auto: not on a CPU
    one, two = report["cases"]
    assert one["fp32_tokens"]["checked"] is False and two["fp32_tokens"]["equal"] is True
    assert set(two["first_step_logits"]) == {"moeflow", "moeflow:compiled", "transformers"}
    assert all(d["max_rel"] < 1e-4 for d in two["first_step_logits"].values())  # fp32 against fp32: rounding only
    assert one["limit"]["experts_hit_per_step"] == [2.0, 2.0] and one["limit"]["cache_len"] == 8.0
    assert [r["pair"] for r in report["ratios"]] == ["moeflow eager / transformers eager",
                                                     "moeflow compiled / moeflow eager"] * 2
    rows = report["results"]
    assert all(0 < r["bandwidth_fraction"] < 1 and r["step_ms"] > 0 for r in rows)
    compiled = [r for r in rows if r["candidate"] == "moeflow:compiled"]
    assert all(r["warmup"]["calls"] == 3 and r["timed_compile"]["graphs"] == 0 for r in compiled)


@pytest.mark.unit
@pytest.mark.parametrize("argv,needle", [
    (["--settle", "0"], "--settle"),
    (["--max-warmups", "2"], "--max-warmups"),
    (["--batch-sizes", "1,8", "--fp32-check-batches", "4"], "--fp32-check-batches"),
])
def test_bad_generate_flags_are_refused(argv, needle, capsys):
    from bench.generate import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2 and needle in capsys.readouterr().err
