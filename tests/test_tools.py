"""The test tools under ``tests/tools/``: the mutation report's reading and scoring (``make
mutation``; docs/testing.md)."""

from __future__ import annotations

import json
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
                                          "parallel/assignment", "parallel/exchange", "parallel/tuner"}, name


def test_scores_per_package_leave_out_equivalents_and_unrun(tmp_path):
    meta = tmp_path / "moeflow" / "routing"
    meta.mkdir(parents=True)
    codes = {"moeflow.routing.s.x_f__mutmut_1": 1, "moeflow.routing.s.x_f__mutmut_2": 0,
             "moeflow.routing.s.x_f__mutmut_3": 0, "moeflow.routing.s.x_f__mutmut_4": 33,
             "moeflow.routing.s.x_f__mutmut_5": 36, "moeflow.routing.s.x_f__mutmut_6": None,
             "moeflow.parallel.tuner.x_g__mutmut_1": 1}
    (meta / "s.py.meta").write_text(json.dumps({"exit_code_by_key": codes}))
    rows = {r["package"]: r for r in report.score_table(report.read_results(tmp_path),
                                                         {"moeflow.routing.s.x_f__mutmut_3": "same"})}
    r = rows["routing"]
    assert (r["mutants"], r["equivalent"], r["killed"], r["survived"], r["no test"], r["not run"]) == (6, 1, 2, 1, 1, 1)
    assert r["score"] == pytest.approx(2 / 4)  # a timeout counts as killed, no covering test as survived
    assert rows["parallel/tuner"]["score"] == 1.0
