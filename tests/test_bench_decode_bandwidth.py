"""``bench.decode_bandwidth`` (issue 50, item 3) and its GPU-check stage ``decode-bw``: the model
built on the meta device and drawn in place is the model a normal build gives (names, shapes,
buffers, norms at one, weights at the init scale); the full shape is Qwen3-30B-A3B's parameter
count; the expected distinct experts against a count of random draws; the routing count of the
eager steps; the order of the cases; a tiny run end to end with its figures consistent with
each other; the stage's line from a CUDA-shaped report, its arguments per mode, and a failed
run's figures kept."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench import decode_bandwidth as dbw
from bench.gpu_check import decode_bw
from bench.gpu_check.runner import Context, StageFailed, child_env
from moeflow.layer.moe import moe_layers
from moeflow.models.gpt import MoEGPT, RMSNorm


@pytest.mark.reference
def test_meta_build_is_a_normal_build_drawn_on_the_device():
    config = dbw.gpt_config_for("tiny")
    built = dbw.build_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    plain = MoEGPT(config)
    assert not built.training
    got, want = dict(built.named_parameters()), dict(plain.named_parameters())
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == {k: (v.shape, v.dtype) for k, v in want.items()}
    bufs, plain_bufs = dict(built.named_buffers()), dict(plain.named_buffers())
    assert bufs.keys() == plain_bufs.keys() and bufs
    for name, b in plain_bufs.items():  # the modules start their buffers at zero, as the build leaves them
        assert torch.equal(bufs[name], b), name
    norms = {id(m.weight) for m in built.modules() if isinstance(m, RMSNorm)}
    assert norms
    for name, p in got.items():
        assert p.device.type == "cpu"
        if id(p) in norms:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert p.std().item() == pytest.approx(config.init_std, rel=0.25), name
    again = dbw.build_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(built.parameters(), again.parameters()))  # seeded
    other = dbw.build_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=4)
    assert not torch.equal(built.lm_head.weight, other.lm_head.weight)


@pytest.mark.reference
def test_full_shape_is_qwen3_30b_a3b():
    """Built on the meta device only (no memory): the published counts, 30.5 B parameters and
    3.3 B active, 48 layers of 128 experts top-8."""
    config = dbw.gpt_config_for("qwen3-30b-a3b", backend="triton")
    model = MoEGPT(config, device="meta", dtype=torch.bfloat16)
    total, active = model.num_parameters()
    assert total == 30_532_122_624 and active == 3_353_032_704
    layers = moe_layers(model)
    assert len(layers) == 48 and {(m.config.num_experts, m.config.top_k) for m in layers} == {(128, 8)}
    assert {m.experts.config.backend for m in layers} == {"triton"}
    assert (config.dim, config.n_heads, config.kv_heads, config.head_dim, config.vocab_size) == (2048, 32, 4, 128, 151936)
    assert config.attention.qk_norm == "head" and config.expert_hidden == 768
    assert dbw.gpt_config_for("tiny", layers=5).n_layers == 5
    with pytest.raises(ValueError, match="shape must be one of"):
        dbw.gpt_config_for("qwen3-235b")
    with pytest.raises(ValueError, match="layers must be"):
        dbw.gpt_config_for("tiny", layers=0)


@pytest.mark.unit
def test_expected_experts_hit_against_random_draws():
    assert dbw.expected_experts_hit(128, 8, 1) == pytest.approx(8.0)
    assert dbw.expected_experts_hit(128, 8, 10_000) == pytest.approx(128.0)
    gen = torch.Generator().manual_seed(0)
    E, K, B, n = 16, 4, 3, 4000
    picks = torch.rand(n, B, E, generator=gen).topk(K, dim=-1).indices.reshape(n, B * K)
    distinct = torch.tensor([row.unique().numel() for row in picks], dtype=torch.float64)
    assert distinct.mean().item() == pytest.approx(dbw.expected_experts_hit(E, K, B), abs=0.1)
    for bad in [(16, 0, 1), (16, 17, 1), (16, 4, 0)]:
        with pytest.raises(ValueError, match="top_k"):
            dbw.expected_experts_hit(*bad)


@pytest.mark.reference
def test_count_experts_hit_counts_each_layers_distinct_experts():
    config = dbw.gpt_config_for("tiny")
    model = dbw.build_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=1)
    cache = model.new_cache(torch.zeros(3, dtype=torch.long), 16, zeroed=True)
    next_B, pos = torch.tensor([5, 9, 5]), torch.tensor(0)
    seen = []
    hooks = [layer.router.register_forward_hook(lambda m, a, out: seen.append(out.ids_TK.clone()))
             for layer in moe_layers(model)]
    hits = dbw.count_experts_hit(model, next_B, pos, cache, 2)
    for h in hooks:
        h.remove()
    assert int(pos) == 2 and len(hits) == config.n_layers
    per_layer = [seen[i::config.n_layers] for i in range(config.n_layers)]  # (the layers run in order each step)
    assert hits == [sum(s.unique().numel() for s in calls) / 2 for calls in per_layer]
    assert all(config.top_k <= h <= 3 * config.top_k for h in hits)


@pytest.mark.unit
def test_cases_run_every_backend_first_then_the_fastest():
    results: list[dict] = []
    cases = dbw._cases([1, 4, 16], ["grouped_mm", "triton"], results, "fastest")
    assert [next(cases), next(cases)] == [("grouped_mm", 1), ("triton", 1)]
    results += [{"batch": 1, "backend": "grouped_mm", "ms_per_step": 3.0},
                {"batch": 1, "backend": "triton", "ms_per_step": 2.0}]
    assert list(cases) == [("triton", 4), ("triton", 16)]
    assert list(dbw._cases([1, 4], ["a", "b"], [], "fastest")) == [("a", 1), ("b", 1), ("a", 4), ("b", 4)]  # none done
    assert list(dbw._cases([1, 4], ["a", "b"], [], "all")) == [("a", 1), ("b", 1), ("a", 4), ("b", 4)]


@pytest.mark.e2e
@pytest.mark.slow
def test_tiny_run_end_to_end(tmp_path):
    path = tmp_path / "dbw.json"
    report = dbw.main(["--shape", "tiny", "--device", "cpu", "--batch-sizes", "1,3", "--prompt-len", "5",
                       "--warmup", "1", "--steps", "3", "--count-steps", "2", "--json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(report))
    assert [(r["backend"], r["batch"]) for r in report["results"]] == [("auto", 1), ("auto", 3)]
    assert not report["failed"] and not report["skipped"] and report["copy_gbps"] > 0
    config = dbw.gpt_config_for("tiny")
    per_expert = 3 * config.dim * config.expert_hidden * 4  # w_in (gate and up) and w_out, fp32
    for r in report["results"]:
        assert r["timed_compile"] == {"graphs": 0, "cuda_graphs": 0, "recompiles": []} and r["finite_logits"]
        assert r["capacity"] == 16 and r["context"] == 5 + 1 + 3 and r["mean_context"] == 5 + 1 + 2
        nbytes = r["bytes_per_step"]
        assert nbytes["experts"] == pytest.approx(per_expert * r["experts_hit"] * config.n_layers)
        assert nbytes["kv_cache"] == pytest.approx(config.n_layers * 2 * r["batch"] * config.kv_heads
                                                   * config.head_dim * 4 * r["mean_context"])
        assert nbytes["total"] == pytest.approx(sum(v for k, v in nbytes.items() if k != "total"))
        assert r["floor_ms"] == pytest.approx(nbytes["total"] / (report["copy_gbps"] * 1e9) * 1e3)
        assert r["bandwidth_fraction"] == pytest.approx(r["floor_ms"] / r["ms_per_step"])
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / r["ms_per_step"] * 1e3)
    assert report["results"][0]["experts_hit"] == config.top_k  # one row picks top_k distinct experts


def _report(**over) -> dict:
    row = {"backend": "grouped_mm", "batch": 1, "ms_per_step": 2.5, "tokens_per_s": 400.0, "bandwidth_fraction": 0.57,
           "bytes_per_step": {"total": 6.13e9}, "compile_s": 70.0}
    rows = [row, {**row, "backend": "triton", "ms_per_step": 2.2, "bandwidth_fraction": 0.65},
            {**row, "backend": "triton", "batch": 4, "ms_per_step": 4.0, "tokens_per_s": 1000.0,
             "bandwidth_fraction": 0.9, "bytes_per_step": {"total": 15.2e9}, "compile_s": 80.0}]
    return {"shape": "qwen3-30b-a3b", "layers": 48, "parameters": 30.53e9, "copy_gbps": 4300.0, "results": rows,
            "skipped": [{"backend": "triton", "batch": 16, "why": "10 s left"}], "failed": [], **over}


@pytest.mark.unit
def test_stage_line_from_a_cuda_shaped_report():
    line = decode_bw.decode_bw_summary("bf16", _report())
    assert line.startswith("bf16 48 layers, 30.53 Gparams, copy 4,300 GB/s: ")
    assert "B=1: 2.20 ms/step (triton) = 65.0% of the limit (6.13 GB/step, 400 tok/s) [grouped_mm 2.50 ms]" in line
    assert "B=4: 4.00 ms/step (triton) = 90.0% of the limit (15.20 GB/step, 1,000 tok/s)" in line
    assert "compile 70-80 s a case" in line and "skipped triton B=16" in line
    failed = decode_bw.decode_bw_summary("bf16", _report(results=[], failed=[{"backend": "triton", "batch": 1,
                                                                               "error": "CompilationError: x"}]))
    assert "FAILED triton B=1 (CompilationError: x)" in failed


@pytest.mark.unit
@pytest.mark.parametrize("device,tiny", [("cuda", False), ("cuda", True), ("cpu", True)])
def test_stage_arguments_per_mode_and_failures_keep_figures(tmp_path, monkeypatch, device, tiny):
    calls: list[list[str]] = []
    outcome = {"report": _report(), "raise": None}

    def fake_run(ctx, log_name, argv, timeout_s):  # type: ignore[no-untyped-def]
        calls.append(argv)
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(outcome["report"]))
        if outcome["raise"]:
            raise StageFailed(outcome["raise"])

    monkeypatch.setattr(decode_bw, "run_command", fake_run)
    ctx = Context(device=device, tiny=tiny, out=tmp_path, env=child_env(device))
    figures = decode_bw.stage_decode_bw(ctx, 200.0)
    argv, fp8_argv = calls  # bf16, then the FP8 weight-only experts, each with its share of the time
    arg = lambda flag: argv[argv.index(flag) + 1]  # noqa: E731
    assert arg("--shape") == ("tiny" if tiny else "qwen3-30b-a3b") and arg("--device") == device
    assert arg("--experts-backend") == ("grouped_mm,triton" if device == "cuda" else "auto")
    assert arg("--weights") == "bf16" and 0 < float(arg("--time-budget")) < 100
    assert ("--batch-sizes" in argv) == (device == "cpu" or not tiny)
    fp8_arg = lambda flag: fp8_argv[fp8_argv.index(flag) + 1]  # noqa: E731
    assert fp8_arg("--weights") == "fp8" and fp8_arg("--experts-backend") == ("grouped_mm" if device == "cuda" else "auto")
    last = max(i for i, a in enumerate(fp8_argv) if a == "--batch-sizes")  # (argparse takes the last one)
    assert fp8_argv[last + 1] == "1"
    assert figures["fp8"]["batch_1"]["triton"]["bandwidth_fraction"] == 0.65
    assert figures["bf16"]["batch_1"]["triton"]["bandwidth_fraction"] == 0.65
    assert figures["summary"].startswith("bf16 48 layers")
    outcome["raise"] = "timed out after 200 s"
    with pytest.raises(StageFailed, match="bf16: timed out") as err:
        decode_bw.stage_decode_bw(ctx, 200.0)
    assert err.value.figures["bf16"]["batch_4"]["triton"]["ms_per_step"] == 4.0  # what it finished is kept
    outcome["raise"], outcome["report"] = None, _report(failed=[{"backend": "triton", "batch": 4, "error": "E"}])
    with pytest.raises(StageFailed, match="1 case"):
        decode_bw.stage_decode_bw(ctx, 200.0)
    assert math.isfinite(figures["bf16"]["copy_gbps"])


@pytest.mark.unit
def test_fp8_weights_count_their_codes_and_scales_as_the_experts_bytes():
    """``--weights fp8``: the experts' bytes a step reads are the e4m3 codes (1 byte a weight)
    plus their fp32 scales, read from the buffers that hold them; everything else unchanged."""
    from bench.generate_checks import decode_step_bytes

    config = dbw.gpt_config_for("tiny")
    model = dbw.build_model(config, device=torch.device("cpu"), dtype=torch.float32, seed=2)
    hits = [3.0] * len(moe_layers(model))
    before = decode_step_bytes(model, rows=2, cache_len=8, experts_hit=hits)
    layer = moe_layers(model)[0]
    E, D, F = layer.experts.w_in.shape
    H = layer.experts.w_out.shape[1]
    dbw.WEIGHT_FORMATS["fp8"](model)
    after = decode_step_bytes(model, rows=2, cache_len=8, experts_hit=hits)
    per_expert = D * F + F * 4 + H * D + D * 4  # codes and one fp32 scale per output column
    assert after["experts"] == pytest.approx(len(hits) * 3.0 * per_expert)
    assert before["experts"] == pytest.approx(len(hits) * 3.0 * (D * F + H * D) * 4)
    assert {k: after[k] for k in ("embedding", "dense", "kv_cache")} == {
        k: before[k] for k in ("embedding", "dense", "kv_cache")}
