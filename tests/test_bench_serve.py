"""``python -m bench.serve`` (moeflow serve under load beside sequential generate and
transformers' generate): its flags refused by name, its quantile, and (slow tier) a whole run at
tiny shapes reporting every level with the tokens it asked for. No timing is asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("httpx2")

from bench import serve  # noqa: E402


@pytest.mark.unit
@pytest.mark.parametrize("argv, match", [
    (["--requests", "0"], "--requests must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--concurrency", "1,64", "--slots", "32"], "--concurrency: every level must be in"),
    (["--concurrency", "0"], "--concurrency: every level must be in"),
])
def test_bad_flags_are_refused_by_name(argv, match):
    with pytest.raises(SystemExit, match=match):
        serve.main(argv)


@pytest.mark.unit
def test_the_quantile_interpolates_between_order_statistics():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert serve._quantile(xs, 0.0) == 1.0 and serve._quantile(xs, 1.0) == 5.0
    assert serve._quantile(xs, 0.5) == 3.0
    assert serve._quantile(xs, 0.99) == pytest.approx(4.96)
    assert serve._quantile([7.0], 0.99) == 7.0


@pytest.mark.e2e
@pytest.mark.slow
def test_a_tiny_run_reports_every_level_and_both_baselines(tmp_path):
    out = tmp_path / "serve.json"
    assert serve.main(["--shape", "tiny", "--concurrency", "1,2", "--requests", "3", "--max-tokens", "5",
                       "--prompt-len", "8", "--slots", "2", "--no-compile", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["concurrency"] for r in report["serve"]] == [1, 2]
    for row in report["serve"]:
        assert row["requests"] == 3 and 3 <= row["tokens"] <= 15 and row["latency_p99_s"] >= row["latency_p50_s"] > 0
    assert set(report["sequential"]) == {"moeflow generate", "transformers generate"}
    # greedy on the same weights: the server and both baselines generate as many tokens
    assert report["sequential"]["moeflow generate"]["tokens"] == report["sequential"]["transformers generate"]["tokens"]
    assert report["serve"][0]["tokens"] == report["sequential"]["moeflow generate"]["tokens"]
