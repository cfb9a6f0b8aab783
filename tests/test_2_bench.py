"""Tier 2: the benchmark harness and CLI on a tiny configuration (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from moeflow.bench import BenchConfig, format_table, run_layer_bench
from moeflow.cli.main import main


def test_bench_report_has_every_implementation_and_pass():
    cfg = BenchConfig(tokens=32, dim=8, hidden=16, experts=4, top_k=2, repeats=2, warmup=0, threads=1)
    report = run_layer_bench(cfg)
    assert [r["name"] for r in report["records"]] == ["moeflow", "einsum", "loop", "floor"]
    for rec in report["records"]:
        for pass_name in ("forward", "forward_backward"):
            r = rec[pass_name]
            assert len(r["times_ms"]) == 2 and r["median_ms"] > 0
            assert r["tokens_per_s"] == pytest.approx(32 / (r["median_ms"] / 1e3))
            assert r["tflops"] == pytest.approx(report["flops"][pass_name] / (r["median_ms"] / 1e3) / 1e12)
            assert r["peak_mem_mb"] is None or r["peak_mem_mb"] >= 0
    floor = report["records"][3]["forward_backward"]
    assert floor["ratio_to_floor"] == pytest.approx(1.0)
    # useful FLOPs: 2*T*K*D*(2H + H) for SwiGLU, forward
    assert report["flops"]["forward"] == 2.0 * 32 * 2 * 8 * (32 + 16)
    assert "moeflow" in format_table(report)


def test_bench_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "--tokens", "16", "--dim", "8", "--hidden", "8", "--experts", "2", "--top-k", "1",
               "--capacity-factor", "0", "--repeats", "1", "--warmup", "0", "--threads", "1",
               "--impls", "moeflow,loop,floor", "--no-memory", "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["records"]] == ["moeflow", "loop", "floor"]
    assert report["config"]["capacity_factor"] == 0
    assert "forward_backward" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--top-k", "9"], "--top-k"),
        (["--tokens", "0"], "--tokens"),
        (["--impls", "moeflow,nope"], "--impls"),
        (["--capacity-factor", "-1", "--impls", "einsum"], "einsum"),
        (["--capacity-factor", "nan"], "--capacity-factor"),
    ],
)
def test_bench_cli_rejects_bad_flags(argv, needle, capsys):
    assert main(["bench", *argv]) == 2
    assert needle in capsys.readouterr().err
