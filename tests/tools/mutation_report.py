"""The per-package mutation score of ``make mutation`` (mutmut's results under ``mutants/``).

    python tests/tools/mutation_report.py            # the table, after `mutmut run`
    python tests/tools/mutation_report.py --survivors  # and every survivor not triaged

mutmut keeps one ``<module>.py.meta`` JSON per mutated file under ``mutants/``, holding each
mutant's exit status (``exit_code_by_key``: 1 killed, 0 survived, 33 no covering test, ...,
``None`` not run yet). Mutants triaged as equivalent (no test can tell them from the original:
the reason is written beside each) are listed in ``tests/tools/mutation_equivalent.txt``, one
``mutant-name  # why`` per line; they leave the denominator. The score of a package is
``killed / (run - equivalent)``, where ``run`` counts every mutant with a result. A survivor
and a mutant without a covering test count against the score; a timeout (the mutant made the
covering tests run past mutmut's limit, which a test run notices) counts as killed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EQUIVALENT = Path(__file__).with_name("mutation_equivalent.txt")

# mutmut's exit statuses (mutmut.stats.status_by_exit_code), folded into what the score needs
KILLED = {1, 3, 36, -24, 24, 152, 255, 37}  # failed, pytest internal error, timeouts, type check
SURVIVED = {0}
NO_TESTS = {33, 5}
SKIPPED = {34}


def category(code: int | None) -> str:
    """The report's column for one of mutmut's exit statuses."""
    if code is None:
        return "not run"
    for name, codes in (("killed", KILLED), ("survived", SURVIVED), ("no test", NO_TESTS), ("skipped", SKIPPED)):
        if code in codes:
            return name
    return "other"


# the parallel and models modules under mutation, reported by module (their rows' names)
PARALLEL_ROWS = {"exchange.assignment": "parallel/assignment", "exchange.alltoall": "parallel/exchange",
                 "placement.tuner": "parallel/tuner", "placement.plan": "parallel/placement",
                 "placement.rebalance": "parallel/placement", "placement.costmodel": "parallel/placement"}
MODELS_ROWS = {"decoding": "models/sampling", "generation": "models/sampling",
               "kv_cache": "models/decode", "compiled_decode": "models/decode", "gpt": "models/gpt"}


def package_of(mutant: str) -> str:
    """``moeflow.routing.scores.x_f__mutmut_3`` -> ``routing``; the parallel and models
    modules are reported by module (``moeflow.parallel.placement.tuner.x_...`` ->
    ``parallel/tuner``, ``moeflow.models.decoding.x_...`` -> ``models/sampling``)."""
    parts = mutant.split(".")
    if parts[1] in ("parallel", "models"):
        module = ".".join(parts[2:-1])
        rows = PARALLEL_ROWS if parts[1] == "parallel" else MODELS_ROWS
        return rows.get(module, parts[1] + "/" + module.replace(".", "/"))
    return parts[1]


def read_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """``{mutant name: why}`` from the triage file (blank lines and ``#`` lines skipped)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, why = line.partition("#")
        if not sep or not why.strip():
            raise ValueError(f"{path}:{n}: an equivalent mutant needs its reason after '#': {line!r}")
        out[name.strip()] = why.strip()
    return out


def read_results(mutants: Path) -> dict[str, int | None]:
    """Every mutant's exit status from the ``.meta`` files under ``mutants``."""
    results: dict[str, int | None] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        results.update(json.loads(meta.read_text())["exit_code_by_key"])
    return results


def score_table(results: dict[str, int | None], equivalent: dict[str, str]) -> list[dict]:
    """One row per package: mutants, equivalent, killed, survived, no test, not run, score."""
    rows: dict[str, Counter] = defaultdict(Counter)
    for name, code in results.items():
        c = rows[package_of(name)]
        c["mutants"] += 1
        c["equivalent" if name in equivalent else category(code)] += 1
    table = []
    for pkg in sorted(rows):
        c = rows[pkg]
        judged = c["killed"] + c["survived"] + c["no test"] + c["other"]
        table.append({"package": pkg, **{k: c[k] for k in ("mutants", "equivalent", "killed", "survived", "no test",
                                                            "other", "not run")},
                      "score": c["killed"] / judged if judged else float("nan")})
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's directory (default: %(default)s)")
    p.add_argument("--survivors", action="store_true", help="list every survivor not triaged as equivalent")
    args = p.parse_args(argv)
    if not args.mutants.is_dir():
        p.error(f"--mutants {args.mutants} is not a directory: run `make mutation` (mutmut run) first")
    results = read_results(args.mutants)
    equivalent = read_equivalent()
    run_packages = {package_of(name) for name in results}  # a package never run says nothing of its names
    unknown = sorted(n for n in set(equivalent) - set(results) if package_of(n) in run_packages)
    cols = ("mutants", "equivalent", "killed", "survived", "no test", "other", "not run")
    print(f"{'package':<22}" + "".join(f"{c:>11}" for c in cols) + f"{'score':>8}")
    for row in score_table(results, equivalent):
        print(f"{row['package']:<22}" + "".join(f"{row[c]:>11}" for c in cols) + f"{row['score']:>8.1%}")
    if unknown:
        print(f"\n{len(unknown)} names in {EQUIVALENT.name} are no mutant of this run (the code changed?): "
              + ", ".join(unknown[:10]))
    if args.survivors:
        left = sorted(n for n, code in results.items()
                      if n not in equivalent and (code in SURVIVED or code in NO_TESTS))
        print(f"\n{len(left)} survivors not triaged (`mutmut show NAME` prints the change):")
        for name in left:
            print(f"  {name}  [{'no test' if results[name] in NO_TESTS else 'survived'}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
