"""``python -m bench.families`` (the public families against transformers, whole models on the
same weights) at tiny shapes: a row per family with both candidates' figures, the same
first-step loss from both models, greedy tokens compared, bf16 models, the time cap, the peak
memory counter, and bad flags refused by name. No timing is asserted."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from bench import families  # noqa: E402
from bench.common import PeakMemory  # noqa: E402

pytestmark = pytest.mark.e2e

TINY = ["--shape", "tiny", "--repeats", "1", "--tokens", "17", "--new-tokens", "4", "--prompt-len", "5",
        "--threads", "1", "--clock", "cpu"]


def test_a_tiny_family_run_reports_both_candidates(tmp_path):
    out = tmp_path / "families.json"
    assert families.main(["--families", "mixtral", *TINY, "--decode-batch", "1,2", "--hf-experts", "eager",
                          "--no-hf-static", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["device"], report["dtype"], report["shape"], report["not_run"]) == ("cpu", "float32", "tiny", {})
    (row,) = report["rows"]
    assert row["family"] == "mixtral" and row["parameters"] > 0 and row["seconds"] >= row["build_s"] > 0
    train = row["train"]
    assert [d["batch"] for d in row["decode"]] == [1, 2]
    decode = row["decode"][1]
    assert train["tokens"] == 2 * 16 and set(train["median_s"]) == {"moeflow", "hf:eager"}
    assert train["ratio"] == pytest.approx(train["median_s"]["hf:eager"] / train["median_s"]["moeflow"])
    assert train["ratios"] == {"hf:eager": train["ratio"]}
    # the same weights and targets (every next token: transformers' labels alone would drop the last one's)
    assert train["first_loss"]["hf:eager"] == pytest.approx(train["first_loss"]["moeflow"], rel=1e-5)
    assert train["peak_gib"] == {"moeflow": None, "hf:eager": None} and row["resident_gib"] is None  # CPU
    assert set(decode["tokens_per_s"]) == {"moeflow:compiled", "hf:generate"}
    assert decode["tokens_equal"]["moeflow:compiled"] is True  # the same weights, greedy: the same tokens


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_both_models_take_the_same_loss(tmp_path, family):
    """The train step times the same loss: every next token of the row (transformers' ``labels``
    alone are shifted inside and drop the last target)."""
    args = argparse.Namespace(seed=0, dtype="float32", shape="tiny", prompt_len=5, new_tokens=4, tokens=17,
                              device=torch.device("cpu"))
    hf, model = families._build(family, args, tmp_path)
    idx_BS = torch.randint(0, hf.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model.loss(idx_BS[:, :-1], idx_BS[:, 1:])
        theirs = families._hf_loss(hf, "eager", idx_BS)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=0)


def test_bf16_models_and_a_train_only_run(tmp_path):
    args = argparse.Namespace(seed=0, dtype="bfloat16", shape="tiny", prompt_len=5, new_tokens=4, tokens=17,
                              device=torch.device("cpu"))
    hf, model = families._build("qwen3_moe", args, tmp_path / "dirs")
    assert {p.dtype for p in hf.parameters()} == {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = tmp_path / "families.json"
    assert families.main(["--families", "qwen3_moe,olmoe", "--decode-families", "", "--dtype", "bfloat16", *TINY,
                          "--hf-experts", "grouped_mm", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16" and [r["family"] for r in report["rows"]] == ["qwen3_moe", "olmoe"]
    for row in report["rows"]:
        losses = row["train"]["first_loss"]
        assert row["decode"] == [] and all(math.isfinite(v) for v in losses.values())
        assert losses["hf:grouped_mm"] == pytest.approx(losses["moeflow"], rel=1e-2)  # bf16 rounding apart


def test_a_decode_only_run(tmp_path):
    """``--no-train``: the decoding rows alone, the report's ``train`` null."""
    out = tmp_path / "families.json"
    assert families.main(["--families", "gpt_oss", *TINY, "--no-train", "--decode-batch", "2", "--hf-experts", "eager",
                          "--no-hf-static", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["train"] is None and [d["batch"] for d in row["decode"]] == [2]
    assert row["decode"][0]["tokens_equal"]["moeflow:compiled"] is True


def test_the_time_cap_starts_a_family_only_while_one_fits(tmp_path):
    out = tmp_path / "families.json"
    assert families.main(["--families", "olmoe,mixtral", "--decode-families", "", *TINY, "--hf-experts", "eager",
                          "--time-cap", "0.001", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["family"] for r in report["rows"]] == ["olmoe"]  # the first always runs
    assert list(report["not_run"]) == ["mixtral"] and "time cap" in report["not_run"]["mixtral"]


def test_peak_memory_is_the_most_of_any_watched_call(monkeypatch):
    cpu = PeakMemory("cpu")
    fn = lambda x: x + 1  # noqa: E731
    assert cpu.wrap(fn) is fn and cpu.bytes is None and cpu.gib is None  # no counter on the CPU
    peaks = iter([3 * 2**30, 5 * 2**30, 2 * 2**30])
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(peaks))
    cuda = PeakMemory("cuda")
    watched = cuda.wrap(lambda x: calls.append("call") or x * 2)
    assert [watched(1), watched(2), watched(3)] == [2, 4, 6]
    assert cuda.gib == 5.0  # the most of the three calls, not the last
    assert calls[:4] == ["sync", "reset", "call", "sync"]  # reset before each call, read after it finished


@pytest.mark.parametrize("argv, match", [
    (["--families", "llama"], "not one of|does not convert"),
    (["--families", ","], "--families: name at least one"),
    (["--tokens", "1"], "--tokens must be at least 2"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--decode-batch", "1,0"], "--decode-batch: every batch must be at least 1"),
    (["--decode-batch", "x"], "--decode-batch: comma-separated integers"),
    (["--max-warmups", "2"], "--max-warmups must be at least 3"),
    (["--device", "tpu"], "--device: cpu or cuda"),
    (["--device", "cuda", "--clock", "cpu"], "--clock cpu with --device cuda"),
    (["--time-cap", "0"], "--time-cap must be a positive number"),
    (["--hf-experts", "grouped_mm,fast"], "--hf-experts: 'fast'"),
    (["--hf-experts", ","], "--hf-experts: name at least one"),
    (["--families", "olmoe", "--decode-families", "mixtral"], "--decode-families: mixtral not among --families"),
])
def test_bad_flags_are_refused_by_name(argv, match):
    with pytest.raises(SystemExit, match=match):
        families.main(argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device is visible"):
        families.main(["--device", "cuda"])


@pytest.mark.parametrize("argv", [["--dtype", "int8"], ["--shape", "huge"]])
def test_bad_choices_are_refused_by_argparse(argv, capsys):
    with pytest.raises(SystemExit) as done:
        families.main(argv)
    assert done.value.code == 2 and argv[0] in capsys.readouterr().err
