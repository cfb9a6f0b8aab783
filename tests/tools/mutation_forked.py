"""Run a package's mutants from one process that has imported its tests, into mutmut's record.

    python tests/tools/mutation_run.py checkpoint --mutants 'moeflow.checkpoint.io.*'  # makes them
    python tests/tools/mutation_forked.py checkpoint --mutants 'moeflow.checkpoint.io.*'
    python tests/tools/mutation_report.py

Why: on 2 shared cores ``mutmut run`` managed 1-4 mutants a minute for the packages whose tests
build models, and its wall-clock limits, sized from a coverage pass under another load, let a
hanging mutant hold a run for many minutes. Earlier sessions ran most mutants by hand instead,
each with ``MUTANT_UNDER_TEST`` set, in forked children of a process that had collected the tests
once (15-20 a minute), and tallied the verdicts in ``docs/testing.md`` by hand: the report did
not see them. This does the same and writes each verdict into the ``.meta`` file where mutmut
keeps its own (``exit_code_by_key``: 1 killed, 0 survived, 36 timed out, 33 no covering test),
so ``mutation_report.py`` scores them and a later ``mutmut run`` keeps them.

Each mutant runs in a child forked from this process, with ``MUTANT_UNDER_TEST`` set to its
name, ``pytest -x`` over the tests that covered its function in mutmut's coverage pass
(``mutmut-stats.json``, fastest first), or over the package's test files where that pass did
not record the function. The parent imports torch, the mutated package and the test modules
once (``pytest --collect-only``), runs no test itself, and runs torch at one thread: a forked
child inherits no thread pool then, and the runs sharing the machine are not slowed by
OpenMP spin-waits. A child past ``--limit`` seconds is killed and counted as a timeout (killed,
as mutmut counts its timeouts).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import sys
import time
from pathlib import Path

TIMEOUT = 36  # mutmut's exit status for a timeout
NO_TESTS = 33  # mutmut's for a mutant no test covered


def read_metas(mutants: Path) -> dict[Path, dict]:
    """``{path: content}`` of every ``.py.meta`` file under ``mutants`` (mutmut's record)."""
    return {meta: json.loads(meta.read_text()) for meta in sorted(mutants.rglob("*.py.meta"))}


def select(metas: dict[Path, dict], patterns: list[str], *, rerun: bool) -> list[str]:
    """The mutant names matching one of ``patterns`` (fnmatch), in the order of their files;
    only those without a result unless ``rerun``."""
    out = []
    for meta in metas.values():
        for name, code in meta["exit_code_by_key"].items():
            if any(fnmatch.fnmatchcase(name, p) for p in patterns) and (rerun or code is None):
                out.append(name)
    return out


def covering_tests(stats: dict | None, name: str) -> list[str] | None:
    """The tests that ran ``name``'s function in mutmut's coverage pass, fastest first; None when
    the pass did not record the function (then the package's files are run)."""
    if stats is None:
        return None
    function = name.partition("__mutmut_")[0]
    tests = stats["tests_by_mangled_function_name"].get(function)
    if tests is None:
        return None
    durations = stats["duration_by_test"]
    return sorted(tests, key=lambda t: (durations.get(t, float("inf")), t))


def record(metas: dict[Path, dict], name: str, code: int, seconds: float) -> None:
    """Write ``name``'s verdict into the ``.meta`` file that lists it (at once: a stopped run keeps
    every verdict it reached)."""
    for path, meta in metas.items():
        if name in meta["exit_code_by_key"]:
            meta["exit_code_by_key"][name] = code
            meta.setdefault("durations_by_key", {})[name] = seconds
            path.write_text(json.dumps(meta, indent=4))
            return
    raise KeyError(f"mutant {name!r} is in no .meta file")


def run_one(name: str, pytest_args: list[str], limit_s: float) -> int:
    """Exit status of ``pytest -x pytest_args`` in a child forked with ``MUTANT_UNDER_TEST=name``
    (``TIMEOUT`` when it ran past ``limit_s`` seconds and was killed)."""
    import pytest

    pid = os.fork()
    if pid == 0:  # the child: run, and leave without this process's exit handlers
        code = 3
        try:
            quiet = os.open(os.devnull, os.O_WRONLY)  # the verdict is the exit status; the log says which
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            os.environ["MUTANT_UNDER_TEST"] = name
            code = int(pytest.main(["-x", "-q", "--tb=no", "--no-header", "-p", "no:randomly", *pytest_args]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + limit_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return TIMEOUT
        time.sleep(0.05)


def verdict(code: int) -> int:
    """mutmut's status for a child's exit status: pytest's 0 (passed) survives, 5 (no test
    collected) has no test, a timeout stays one, anything else (failures, errors, a crash) kills."""
    if code in (0, 5, TIMEOUT):
        return {0: 0, 5: NO_TESTS, TIMEOUT: TIMEOUT}[code]
    return 1


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mutation_run import PACKAGES, test_files, work_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("package", help=f"one of: {', '.join(PACKAGES)}")
    p.add_argument("--mutants", nargs="+", required=True, metavar="GLOB",
                   help="the mutants to run, e.g. 'moeflow.checkpoint.io.*'")
    p.add_argument("--rerun", action="store_true", help="run mutants that have a result too")
    p.add_argument("--limit", type=float, default=120.0, help="seconds a mutant may run (default: %(default)s)")
    p.add_argument("--tests", nargs="+", default=None, metavar="FILE",
                   help="test files for functions the coverage pass did not record (default: the package's)")
    p.add_argument("--work", type=Path, default=None, help="mutmut's work directory (default: the package's)")
    args = p.parse_args(argv)
    if args.package not in PACKAGES:
        p.error(f"unknown package {args.package!r}; known: {', '.join(PACKAGES)}")
    if not args.limit > 0:
        p.error(f"--limit must be > 0 seconds, got {args.limit}")
    mutants = args.work or work_dir(args.package) / "mutants"
    metas = read_metas(mutants) if mutants.is_dir() else {}
    if not metas:
        p.error(f"no mutants in {mutants}: run `tests/tools/mutation_run.py {args.package} --mutants ...` first "
                "(mutmut makes them; it may be stopped once it starts running them)")
    names = select(metas, args.mutants, rerun=args.rerun)
    stats_file = mutants / "mutmut-stats.json"
    stats = json.loads(stats_file.read_text()) if stats_file.exists() else None
    files = args.tests or test_files(args.package)
    marks = ["-p", "no:cacheprovider", "-m", "not slow and not triton and not gpu"]
    print(f"{len(names)} mutants of {args.package} in {mutants}", flush=True)

    os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts: see the module docstring
    os.chdir(mutants)
    sys.path.insert(0, str(mutants))
    import pytest
    import torch

    torch.set_num_threads(1)
    pytest.main(["--collect-only", "-q", *marks, *files])  # imports everything once, runs nothing
    tally: dict[int, int] = {}
    for i, name in enumerate(names, 1):
        tests = covering_tests(stats, name)
        start = time.monotonic()
        code = NO_TESTS if tests == [] else verdict(run_one(name, [*marks, *(tests or files)], args.limit))
        seconds = time.monotonic() - start
        record(metas, name, code, seconds)
        tally[code] = tally.get(code, 0) + 1
        print(f"[{i}/{len(names)}] {name}: {code} ({seconds:.1f} s)", flush=True)
    print("verdicts (mutmut's exit statuses):", dict(sorted(tally.items())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
