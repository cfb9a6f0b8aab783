"""Generation with the experts offloaded (``moeflow.storage`` under ``moeflow.models.generation``
and ``moeflow generate --offload``): greedy tokens identical to the in-memory model for both
fast-tier layouts and both home tiers, the fast tier never above its budget, the cache fetching
only routed experts with the next layer's prefetched, and the storage flags checked up front."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import small_gpt, train_tiny_run

import moeflow
from moeflow.models.generation import generate
from moeflow.storage import StorageConfig, offload_experts, slot_bytes


def _prompts(gen: torch.Generator, lengths: list[int], vocab: int = 61) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.reference
@pytest.mark.parametrize("offload", ["host", "disk"])
@pytest.mark.parametrize("mode", ["ring", "cache"])
def test_offloaded_greedy_generation_equals_in_memory(offload, mode, gen, tmp_path) -> None:
    """A ragged batch, greedy, KV-cached: the offloaded model gives the in-memory tokens, with
    experts 4x the fast-tier budget (cache) or streaming through two layer slots (ring)."""
    model = small_gpt(n_layers=4, moe_every=1, num_experts=8).eval()
    layers = moeflow.moe_layers(model)
    per_expert = slot_bytes(layers[0].experts, single=True)
    budget = 8 * per_expert if mode == "cache" else 2 * slot_bytes(layers[0].experts)
    assert 4 * 8 * per_expert >= 4 * budget if mode == "cache" else 4 * 8 * per_expert >= 2 * budget
    prompts = _prompts(gen, [5, 9, 3])
    expected = generate(model, prompts, 10, temperature=0)
    offloaded = copy.deepcopy(model)
    directory = {"directory": tmp_path} if offload == "disk" else {}
    store = offload_experts(offloaded, StorageConfig(offload=offload, mode=mode, fast_memory=budget, **directory))
    with store:
        got = generate(offloaded, prompts, 10, temperature=0)
        one = generate(offloaded, prompts[:1], 10, temperature=0)  # batch 1: decode routes two experts a layer
        stats = store.stats
        assert got.tokens == expected.tokens
        assert one.tokens == expected.tokens[:1]
        assert stats.peak_fast_bytes <= budget and stats.fast_bytes <= budget
        assert stats.bytes_loaded > 0 and (stats.bytes_from_disk > 0) == (offload == "disk")
        if mode == "cache":
            assert store.prefetch_hits > 0  # the next layer's experts loaded while this one computed


@pytest.mark.reference
@pytest.mark.parametrize("prefetch", [0, 1])
def test_cache_decode_fetches_only_routed_experts(prefetch, gen) -> None:
    """One-token steps through a cache smaller than the experts: each layer asks for exactly
    its top-k experts, and only missing ones are read (an expert's bytes each, never a whole
    layer); a cache holding them all reads nothing on a second run."""
    n_layers, top_k, steps = 3, 2, 6
    model = small_gpt(n_layers=n_layers, moe_every=1, num_experts=8, top_k=top_k).eval()
    per_expert = slot_bytes(moeflow.moe_layers(model)[0].experts, single=True)
    prompt = _prompts(gen, [1])
    expected = generate(model, prompt, steps, temperature=0).tokens
    offloaded = copy.deepcopy(model)
    store = offload_experts(offloaded, StorageConfig(mode="cache", fast_memory=5 * per_expert, prefetch=prefetch))
    with store:
        assert generate(offloaded, prompt, steps, temperature=0).tokens == expected
        s = store.stats
        assert s.hits + s.misses == n_layers * top_k * steps  # one forward per new token, top-k per layer
        assert s.loads - s.prefetch_loads == s.misses  # on demand: only the misses
        assert s.bytes_loaded == s.loads * store.layers[0].expert_nbytes
        assert s.peak_fast_bytes <= 5 * per_expert
    cached = copy.deepcopy(model)
    big = offload_experts(cached, StorageConfig(mode="cache", fast_memory=8 * n_layers * per_expert))
    with big:
        assert generate(cached, prompt, steps, temperature=0).tokens == expected
        big.reset_stats()
        assert generate(cached, prompt, steps, temperature=0).tokens == expected
        assert big.stats.misses == 0 and big.stats.bytes_loaded == 0 and big.stats.hit_rate == 1.0


@pytest.mark.e2e
def test_cli_generate_offloaded_equals_in_memory(tmp_path, capsys) -> None:
    from moeflow.cli.main import main
    from moeflow.train import build_from_checkpoint

    run = train_tiny_run(tmp_path / "run")
    capsys.readouterr()
    model, _, _ = build_from_checkpoint(run)
    layers = moeflow.moe_layers(model)
    per_expert = slot_bytes(layers[0].experts, single=True)
    per_layer = slot_bytes(layers[0].experts)
    common = ["--prompt", "ROMEO.", "--max-new-tokens", "8", "--temperature", "0"]
    assert main(["generate", run, *common]) == 0
    in_memory = capsys.readouterr().out
    for offload in ("host", "disk"):
        for mode, budget in (("cache", 2 * per_expert), ("ring", 2 * per_layer)):
            assert main(["generate", run, *common, "--offload", offload, "--mode", mode,
                         "--fast-memory", str(budget)]) == 0, (offload, mode)
            out, err = capsys.readouterr()
            assert out == in_memory, (offload, mode)
            assert "prefill:" in err and "decode:" in err and "hit rate" in err and "read from disk" in err
            assert f"of the {moeflow.storage.format_bytes(budget)} budget" in err and "nothing transient" in err
    # every storage flag is checked before the model is built: one line, status 2
    for flags, needle in [(["--offload", "disk", "--fast-memory", "12XB"], "--fast-memory"),
                          (["--offload", "disk", "--fast-memory", "0"], "--fast-memory"),
                          (["--fast-memory", "1MB"], "--offload"), (["--mode", "ring"], "--offload"),
                          (["--offload", "host", "--dir", str(tmp_path)], "--dir"),
                          (["--offload", "disk", "--mode", "cache", "--ring-slots", "2"], "--ring-slots"),
                          (["--offload", "disk", "--fast-memory", "1kB"], "holds no expert")]:
        assert main(["generate", run, *common, *flags]) == 2, flags
        out, err = capsys.readouterr()
        assert needle in err and err.count("\n") == 1 and "Traceback" not in err and out == "", (flags, err)


@pytest.mark.e2e
def test_offload_benchmark_runs_and_skips_accelerate_when_missing(tmp_path, monkeypatch, capsys) -> None:
    """A tiny run of bench/generate_offload.py: identical greedy tokens, the budget respected;
    without accelerate its half is skipped with a message, not an error."""
    import json
    import sys

    from bench import generate_offload

    monkeypatch.setitem(sys.modules, "accelerate", None)  # import accelerate -> ImportError
    assert "accelerate is not installed" in generate_offload.accelerate_missing()
    out = tmp_path / "r.json"
    assert generate_offload.main(["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--hidden", "48",
                                  "--vocab", "64", "--prompt-len", "4", "--new-tokens", "3", "--repeats", "1",
                                  "--threads", "1", "--no-rss", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["accelerate_skipped"] and "accelerate is not installed" in capsys.readouterr().err
    assert [r["candidate"] for r in report["results"]] == ["moeflow:memory", "moeflow:disk-direct", "moeflow:disk-cached"]
    assert all(r["tokens_vs_in_memory"] == "identical" for r in report["results"])
    assert report["experts_over_budget"] >= 4
    assert all(s["peak_fast_bytes"] <= report["budget"] for s in report["moeflow_store"].values())
