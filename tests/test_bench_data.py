"""The own-data benchmark (``bench.data``) at a tiny size: every part runs and its report
holds the figures ``docs/benchmarks.md`` quotes, so the script cannot rot between runs."""

from __future__ import annotations

import json

import pytest

from bench import data as bench_data


@pytest.mark.e2e
def test_data_bench_runs_and_reports_its_figures(tmp_path):
    out = tmp_path / "data.json"
    assert bench_data.main(["--text-mb", "6", "--skip-bpe", "--reads", "200", "--steps", "6", "--batch-size", "4",
                            "--seq-len", "32", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    byte_rows = [r for r in report["prepare"] if r["tokenizer"] == "byte"]
    assert {r["workers"] for r in byte_rows} >= {1}
    assert all(r["tokens"] > 300_000 and r["tokens_per_s"] > 0 for r in byte_rows)
    # the window is a third of the token bytes; the whole mapping reads every page it touches
    assert report["window_bytes"] < report["token_bytes"]
    mem = report["loader_memory"]
    assert set(mem) == {"windowed", "whole"}
    train = report["train"]
    assert train["steps"] == 6 and train["tokens_per_s"] > 0 and 0 <= train["data_share"] < 1
    assert set(train["ranks"]) == {"0", "1"}
    for rank in train["ranks"].values():
        assert rank["samples"] > 0 and rank["timeline"] and rank["RssFile"]["max"] >= rank["RssFile"]["early"] > 0
