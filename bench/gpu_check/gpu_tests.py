"""Stage gpu-tests: ``pytest -m gpu`` on the test files that mark a test ``gpu``, with compiled
Triton kernels (``TRITON_INTERPRET`` removed from the environment), less the torchrun trainer
test (``TRAINER_TEST``: the train and resume stages run its commands); passed / failed / skipped
from its JUnit XML. Without CUDA: ``--collect-only`` (the gpu tests still import)."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from bench.common import REPO
from bench.gpu_check.runner import NO_CUDA, Context, StageFailed, python, run_command, tail

__all__ = ["TRAINER_TEST", "junit_counts", "collected_counts", "gpu_test_files", "stage_gpu_tests"]

# the gpu test that runs ``torchrun -m moeflow train --device cuda`` and resumes it: the train and
# resume stages run the same commands (a quarter of this stage's time on an H100, which the
# decode stage needs)
TRAINER_TEST = "tests/test_gpu.py::test_trainer_on_cuda_under_torchrun_trains_and_resumes"


def junit_counts(xml_path: Path) -> dict:
    """``{"passed", "failed", "errors", "skipped", "tests", "failures": [test ids]}`` from a
    pytest JUnit XML file."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing = [f"{case.get('classname')}::{case.get('name')}" for case in root.iter("testcase")
               if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "tests": counts["tests"], "failures": failing}


def collected_counts(pytest_quiet_output: str) -> dict[str, int]:
    """``{file: tests}`` from ``pytest --collect-only -qq`` (lines ``tests/x.py: 11``)."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\S+\.py): (\d+)$", pytest_quiet_output, re.M)}


def gpu_test_files() -> list[str]:
    """The test files that mark a test ``gpu`` (collecting only those is what ``-m gpu`` keeps of
    the whole suite, without importing every other test module)."""
    return [f"tests/{p.name}" for p in sorted((REPO / "tests").glob("test_*.py")) if "mark.gpu" in p.read_text()]


def stage_gpu_tests(ctx: Context, timeout_s: float) -> dict:
    def pytest(*args: str) -> list[str]:
        return python("-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *args)

    files = gpu_test_files()
    if not files:
        raise StageFailed("no test file under tests/ marks a test gpu")
    if ctx.device == "cpu":
        done = run_command(ctx, "gpu-tests", pytest(*files, "--collect-only"), timeout_s)
        collected = collected_counts(done.stdout)
        if not collected:
            raise StageFailed(f"pytest collected no gpu test: {tail(done.stdout)}")
        n = sum(collected.values())
        return {"collected": n, "files": collected, "summary": f"{n} gpu tests collected ({NO_CUDA}: --collect-only)"}
    xml = ctx.out / "gpu-tests.xml"
    xml.unlink(missing_ok=True)
    try:
        run_command(ctx, "gpu-tests", pytest(*files, "--deselect", TRAINER_TEST, "-rfEs", "--junitxml", str(xml)),
                    timeout_s)
    except StageFailed as err:
        if not xml.exists():
            raise
        counts = junit_counts(xml)
        raise StageFailed(f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                          f"{counts['skipped']} skipped; failing: {', '.join(counts['failures'][:5])}") from err
    counts = junit_counts(xml)
    if counts["tests"] == 0:
        raise StageFailed("pytest ran no gpu test")
    summary = f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    if counts["skipped"]:
        summary += " (skips on a GPU machine: see the log)"
    return {**counts, "summary": summary}
