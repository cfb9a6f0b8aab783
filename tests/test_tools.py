"""The test tools under ``tests/tools/``: the mutation report's reading and scoring, and the
runner that gives each package its own work directory and tests (``make mutation``;
docs/testing.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "tools"))

import mutation_report as report  # noqa: E402

pytestmark = pytest.mark.unit


def test_equivalent_file_needs_a_reason_per_mutant(tmp_path):
    good = tmp_path / "eq.txt"
    good.write_text("# header\n\nmoeflow.routing.a.x_f__mutmut_1  # topk's default dim\n")
    assert report.read_equivalent(good) == {"moeflow.routing.a.x_f__mutmut_1": "topk's default dim"}
    bad = tmp_path / "bad.txt"
    bad.write_text("moeflow.routing.a.x_f__mutmut_2\n")
    with pytest.raises(ValueError, match=r"bad.txt:1: an equivalent mutant needs its reason"):
        report.read_equivalent(bad)
    # the project's own list parses, and every name in it is a mutant of a configured package
    for name in report.read_equivalent():
        assert report.package_of(name) in {"routing", "dispatch", "layer", "experts", "kernels",
                                          "parallel/assignment", "parallel/exchange", "parallel/tuner",
                                          "models/sampling", "parallel/gradients", "parallel/placement",
                                          "parallel/vocab", "serve", "checkpoint",
                                          "train", "convert", "storage", "models/decode", "models/gpt"}, name  # train/data and train/lm report as one row
    assert report.package_of("moeflow.models.decoding.x_sample_next__mutmut_3") == "models/sampling"
    assert report.package_of("moeflow.models.generation.x_generate__mutmut_1") == "models/sampling"
    assert report.package_of("moeflow.models.kv_cache.x_static_step__mutmut_1") == "models/decode"
    assert report.package_of("moeflow.models.compiled_decode.x__bucket__mutmut_1") == "models/decode"
    assert report.package_of("moeflow.models.gpt.xǁMoEGPTǁloss__mutmut_1") == "models/gpt"
    assert report.package_of("moeflow.parallel.placement.plan.x_plan_placement__mutmut_1") == "parallel/placement"
    assert report.package_of("moeflow.parallel.placement.costmodel.x_flat_time__mutmut_1") == "parallel/placement"
    assert report.package_of("moeflow.parallel.vocab.x_vocab_range__mutmut_1") == "parallel/vocab"


def test_scores_per_package_leave_out_equivalents_and_unrun(tmp_path):
    meta = tmp_path / "moeflow" / "routing"
    meta.mkdir(parents=True)
    codes = {"moeflow.routing.s.x_f__mutmut_1": 1, "moeflow.routing.s.x_f__mutmut_2": 0,
             "moeflow.routing.s.x_f__mutmut_3": 0, "moeflow.routing.s.x_f__mutmut_4": 33,
             "moeflow.routing.s.x_f__mutmut_5": 36, "moeflow.routing.s.x_f__mutmut_6": None,
             "moeflow.parallel.placement.tuner.x_g__mutmut_1": 1}
    (meta / "s.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    rows = {r["package"]: r for r in report.score_table(report.read_results(tmp_path),
                                                         {"moeflow.routing.s.x_f__mutmut_3": "same"})}
    r = rows["routing"]
    assert (r["mutants"], r["equivalent"], r["killed"], r["survived"], r["no test"], r["not run"]) == (6, 1, 2, 1, 1, 1)
    assert r["score"] == pytest.approx(2 / 4)  # a timeout counts as killed, no covering test as survived
    assert rows["parallel/tuner"]["score"] == 1.0


def test_each_package_runs_in_its_own_work_directory_with_its_own_tests(tmp_path, monkeypatch):
    """``mutation_run.py``: every package's test patterns match files (a renamed file would
    leave mutants without tests), the packages together mutate what ``[tool.mutmut]`` names and
    test with files its selection holds, and a package's work directory gets the repository's mutmut settings with only its own
    modules and test files, written again only when they change (mutmut reruns everything
    then)."""
    import tomllib

    import mutation_run as run

    root = Path(__file__).resolve().parents[1]
    configured = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert sorted(m for mods, _ in run.PACKAGES.values() for m in mods) == sorted(configured["only_mutate"])
    assert set(run.PACKAGES) == {"routing", "dispatch", "layer", "experts", "kernels", "parallel/assignment",
                                 "parallel/exchange", "parallel/tuner", "models/sampling", "parallel/gradients",
                                 "parallel/placement", "parallel/vocab", "serve", "checkpoint", "train/data",
                                 "train/lm", "convert", "storage", "models/decode", "models/gpt"}
    for package in run.PACKAGES:
        files = run.test_files(package)
        assert files and len(files) == len(set(files)) and all((root / f).is_file() for f in files), package
        # the whole-core selection (a plain `mutmut run`) holds every package's files
        assert set(files) <= set(configured["pytest_add_cli_args_test_selection"]), package
        work = tomllib.loads(run.work_config(package, (root / "pyproject.toml").read_text()))["tool"]["mutmut"]
        assert work["only_mutate"] == run.PACKAGES[package][0]
        assert work["pytest_add_cli_args_test_selection"] == files
        assert {k: v for k, v in work.items() if k not in ("only_mutate", "pytest_add_cli_args_test_selection")} == \
            {k: v for k, v in configured.items() if k not in ("only_mutate", "pytest_add_cli_args_test_selection")}
        # pytest's own settings too: without them pytest reads the repository's, whose pythonpath
        # puts the unmutated moeflow ahead of the mutated copy
        pytest_work = tomllib.loads(run.work_config(package, (root / "pyproject.toml").read_text()))["tool"]["pytest"]
        assert pytest_work == tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"], package
    assert "tests/test_experts_recompute_chunks.py" in run.test_files("experts")  # globs expand

    monkeypatch.setitem(run.PACKAGES, "nothing", (["moeflow/x/*"], ["test_no_such_*.py"]))
    with pytest.raises(ValueError, match=r"PACKAGES\['nothing'\]: no test file matches 'test_no_such_\*.py'"):
        run.test_files("nothing")

    fake = tmp_path / "repo"
    for name in ("moeflow", "tests", "bench"):
        (fake / name).mkdir(parents=True)
        (fake / name / "a.py").write_text("x = 1\n")
    (fake / "tests" / "test_routing.py").write_text("")
    (fake / "moeflow" / "__pycache__").mkdir()
    (fake / "pyproject.toml").write_text((root / "pyproject.toml").read_text())
    monkeypatch.setattr(run, "ROOT", fake)
    monkeypatch.setitem(run.PACKAGES, "parallel/tuner", (["moeflow/parallel/placement/tuner.py"], ["test_routing.py"]))
    monkeypatch.setattr(run, "test_files", lambda package, tests=fake / "tests": ["tests/test_routing.py"])
    work = run.prepare("parallel/tuner")
    assert work == fake / "mutants" / "parallel-tuner"
    assert (work / "moeflow" / "a.py").read_text() == "x = 1\n" and not (work / "moeflow" / "__pycache__").exists()
    assert (work / "bench" / "a.py").read_text() == "x = 1\n"  # tests import the harness
    config = (work / "pyproject.toml").stat().st_mtime_ns
    (fake / "moeflow" / "a.py").write_text("x = 2\n")
    (work / "tests" / "stale.py").write_text("")
    run.prepare("parallel/tuner")
    assert (work / "moeflow" / "a.py").read_text() == "x = 2\n" and not (work / "tests" / "stale.py").exists()
    assert (work / "pyproject.toml").stat().st_mtime_ns == config  # unchanged settings are not rewritten
    with pytest.raises(SystemExit):
        run.main(["no-such-package"])
    with pytest.raises(SystemExit):
        run.main(["routing", "dispatch", "--mutants", "x*"])  # --mutants: one package
    calls = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(run, "cores", lambda: 7)
    monkeypatch.setattr(run.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw)) or
                        type("Done", (), {"returncode": 0})())
    assert run.main(["parallel/tuner", "--mutants", "a.*", "*ǁBǁc*", "--max-children", "3"]) == 0
    (cmd, kw), = calls
    assert cmd[1:] == ["run", "--max-children", "3", "a.*", "*ǁBǁc*"]  # every glob reaches mutmut
    assert kw["cwd"] == work and kw["env"]["GIT_CEILING_DIRECTORIES"] == str(fake / "mutants")
    assert kw["env"]["OMP_NUM_THREADS"] == "2"  # 7 cores shared by 3 children
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert run.main(["parallel/tuner"]) == 0 and calls[-1][1]["env"]["OMP_NUM_THREADS"] == "5"  # the caller's wins


def test_forked_runs_record_each_mutants_verdict_in_mutmuts_files(tmp_path):
    """``mutation_forked.py``: each selected mutant runs with ``MUTANT_UNDER_TEST`` set over the
    tests that covered its function (or the files given), and its verdict lands in the ``.meta``
    file mutmut keeps, where the report reads it: a failing test kills, passing tests survive,
    a child past the limit times out, a function no test covered has no test, a mutant with a
    result is left alone (and one not matched)."""
    mutants = tmp_path / "mutants"
    (mutants / "tests").mkdir(parents=True)
    (mutants / "tests" / "test_fake.py").write_text(
        "import os, time\n"
        "def test_f():\n"
        "    name = os.environ.get('MUTANT_UNDER_TEST', '')\n"
        "    assert not name.endswith('f__mutmut_2')\n"
        "    if name.endswith('f__mutmut_3'):\n"
        "        time.sleep(60)\n"
        "def test_other():\n"
        "    assert os.environ.get('MUTANT_UNDER_TEST', '') != 'moeflow.fake.x_g__mutmut_1'\n")
    codes = {f"moeflow.fake.x_f__mutmut_{i}": None for i in (1, 2, 3)}
    codes |= {"moeflow.fake.x_g__mutmut_1": None, "moeflow.fake.x_h__mutmut_1": None,
              "moeflow.fake.x_f__mutmut_4": 1, "moeflow.other.x_k__mutmut_1": None}
    meta = mutants / "moeflow.fake.py.meta"
    meta.write_text(json.dumps({"exit_code_by_key": codes, "durations_by_key": {}}))
    (mutants / "mutmut-stats.json").write_text(json.dumps({
        "tests_by_mangled_function_name": {"moeflow.fake.x_f": ["tests/test_fake.py::test_f"], "moeflow.fake.x_h": []},
        "duration_by_test": {"tests/test_fake.py::test_f": 0.01}}))
    tool = Path(__file__).parent / "tools" / "mutation_forked.py"
    done = subprocess.run([sys.executable, str(tool), "serve", "--work", str(mutants), "--tests", "tests/test_fake.py",
                           "--mutants", "moeflow.fake.*", "--limit", "4"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    got = json.loads(meta.read_text())["exit_code_by_key"]
    assert got == {"moeflow.fake.x_f__mutmut_1": 0, "moeflow.fake.x_f__mutmut_2": 1, "moeflow.fake.x_f__mutmut_3": 36,
                   "moeflow.fake.x_g__mutmut_1": 1,  # not in the coverage pass: the files given, test_other kills
                   "moeflow.fake.x_h__mutmut_1": 33, "moeflow.fake.x_f__mutmut_4": 1,
                   "moeflow.other.x_k__mutmut_1": None}
    table = {row["package"]: row for row in report.score_table(got, {})}
    assert (table["fake"]["killed"], table["fake"]["survived"], table["fake"]["no test"]) == (4, 1, 1)
    bad = subprocess.run([sys.executable, str(tool), "serve", "--work", str(tmp_path / "none"), "--mutants", "x*"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no mutants in" in bad.stderr


def test_no_function_under_mutation_hides_behind_a_no_grad_decorator():
    """mutmut mutates no decorated function (but for ``staticmethod``/``classmethod``): with
    ``@torch.no_grad()`` on ``clip_grad_norm_``, ``generate`` and the replicas' gradient sync,
    their packages scored 100% while those functions had no mutant at all. They take
    ``with torch.no_grad():`` in the body instead; this keeps it so in every mutated module."""
    import ast
    import glob

    from mutation_run import PACKAGES, ROOT

    hidden = []
    for modules, _ in PACKAGES.values():
        for path in sorted({f for m in modules for f in glob.glob(str(ROOT / m)) if f.endswith(".py")}):
            for node in ast.walk(ast.parse(Path(path).read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for dec in node.decorator_list:
                        if ast.unparse(dec).startswith(("torch.no_grad", "torch.inference_mode", "torch.enable_grad")):
                            hidden.append(f"{Path(path).relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not hidden, f"decorated out of mutation testing (use `with torch.no_grad():`): {hidden}"
