"""``make mutation``: mutmut over the core, one package at a time, each against its own tests.

    python tests/tools/mutation_run.py                    # every package in PACKAGES, in order
    python tests/tools/mutation_run.py layer experts      # these packages
    python tests/tools/mutation_run.py layer --mutants 'moeflow.layer.moe.*' '*ǁRouterǁ__init__*'   # some functions
    python tests/tools/mutation_report.py                 # the score per package, afterwards

Why one run per package: mutmut runs each mutant against the tests that ran the mutated
function in its coverage pass. Over all the core's test files, the functions every layer test
reaches (``MoE.__init__``, ``Router.forward``, ``GroupedExperts.forward``, ...) have 1,200 to
1,400 covering tests each, some of them gloo runs; one survivor then costs minutes, and a run
over the whole core takes many hours on 2 cores (``docs/testing.md``). Each package's own test
files (``PACKAGES``) still hold every test that kills its mutants, at a fraction of the cost.

Each package runs in its own work directory, ``mutants/<package>/`` (git-ignored): a copy of
``moeflow/`` and ``tests/`` and a ``pyproject.toml`` whose ``[tool.mutmut]`` is the repository's
with ``only_mutate`` and ``pytest_add_cli_args_test_selection`` set to the package's. mutmut
writes its results under ``mutants/<package>/mutants/``, where ``mutation_report.py`` finds
them, and keeps them: a rerun continues, running again only what changed (a changed function's
mutants; every mutant of the package when its test selection or a test it ran changed). The
copy is refreshed before each run; git is kept out of the work directory
(``GIT_CEILING_DIRECTORIES``), so mutmut notices changed files by their contents rather than by
the repository's history.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# package -> (modules mutmut mutates, the test files it runs them against). A test file that
# kills a package's mutants belongs in its list; the lists are what keeps a run affordable.
PACKAGES: dict[str, tuple[list[str], list[str]]] = {
    "routing": (["moeflow/routing/*"],
                ["test_routing.py", "test_layer_moe.py", "test_inference_paths.py", "test_layer_replay.py",
                 "test_compat_tutel.py", "test_layer_moe_training.py"]),
    "dispatch": (["moeflow/dispatch/*"],
                 ["test_routing.py", "test_dispatch.py", "test_dispatch_capacity.py", "test_dispatch_protocol.py",
                  "test_layer_moe.py", "test_inference_paths.py", "test_layer_replay.py", "test_layer_matrix.py"]),
    "layer": (["moeflow/layer/*"],
              ["test_layer_moe.py", "test_routing.py", "test_layer_replay.py", "test_inference_paths.py",
               "test_config.py", "test_layer_matrix.py", "test_layer_moe_training.py", "test_experts_recompute*.py",
               "test_parallel_dispatcher.py", "test_dispatch_protocol.py"]),
    "experts": (["moeflow/experts/*"],
                ["test_experts_*.py", "test_kernels.py", "test_layer_matrix.py", "test_inference_paths.py",
                 "test_config.py", "test_layer_moe.py"]),
    "kernels": (["moeflow/kernels/*.py"],
                ["test_kernels.py", "test_dispatch.py", "test_experts_grad_accumulation.py", "test_layer_matrix.py",
                 "test_experts_recompute.py"]),
    "parallel/assignment": (["moeflow/parallel/exchange/assignment.py"],
                            ["test_parallel_assignment.py", "test_parallel_dispatcher.py", "test_layer_*.py",
                             "test_inference_paths.py", "test_routing.py", "test_config.py", "test_compat_tutel.py",
                             "test_parallel_exchange.py", "test_experts_*.py", "test_kernels.py"]),
    "parallel/exchange": (["moeflow/parallel/exchange/alltoall.py"],
                          ["test_parallel_exchange.py", "test_parallel_tuner.py", "test_parallel_dispatcher.py",
                           "test_parallel_assignment.py", "test_layer_matrix.py"]),
    "parallel/tuner": (["moeflow/parallel/placement/tuner.py"],
                       ["test_parallel_tuner.py", "test_parallel_exchange.py", "test_parallel_dispatcher.py",
                        "test_parallel_assignment.py", "test_layer_matrix.py"]),
    # how the next token is chosen and the loops that choose it. Not test_models_generation_compiled.py:
    # its tests count compilations of shapes the tests before them compiled, and mutmut runs a
    # mutant's covering tests in an order of its own (its clean run fails there)
    "models/sampling": (["moeflow/models/decoding.py", "moeflow/models/generation.py"],
                        ["test_sampling_distribution.py", "test_models_generation.py",
                         "test_models_compiled_loop.py"]),
    # the gradient a rank applies: which parameters are sharded, reductions, global-norm clipping
    # (test_parallel_placement.py: the norm of replicated experts)
    "parallel/gradients": (["moeflow/parallel/gradients.py"],
                           ["test_parallel_gradients.py", "test_parallel_placement.py"]),
    # moeflow serve's text side (ids to text as they come, stop strings, chat templates), its
    # OpenAI request bodies with their checks, and the engine: continuous batching over decode
    # slots (admission, chunked prefill, the step, stop and length, cancellation, timeouts,
    # errors). app.py and server.py are not here: the HTTP tests run the server in a subprocess,
    # where mutmut's trampolines record nothing. Not test_serve_engine_compiled.py: its
    # compilation (15 s) would run for every engine mutant; the eager tests run the same engine
    "serve": (["moeflow/serve/text.py", "moeflow/serve/protocol.py", "moeflow/serve/engine.py",
               "moeflow/serve/slots.py"],
              ["test_serve_text.py", "test_serve_protocol.py", "test_serve_engine.py"]),
    # which rank holds which expert and which share of its rows, moving experts and their optimizer
    # state there, replicas' gradients, and the exchange's cost model (test_parallel_assignment.py:
    # the slot tables every rank routes by)
    "parallel/placement": (["moeflow/parallel/placement/plan.py", "moeflow/parallel/placement/rebalance.py",
                            "moeflow/parallel/placement/costmodel.py"],
                           ["test_parallel_placement.py", "test_parallel_costmodel.py", "test_parallel_assignment.py"]),
    # the vocabulary-parallel collectives: token exchanges and the cross-entropy over split logits
    "parallel/vocab": (["moeflow/parallel/vocab.py"], ["test_parallel_vocab.py"]),
    # the checkpoint a resumed run trusts: written, verified, refused when damaged or hostile,
    # loaded and resharded onto any layout, converted to and from DCP
    # (test_parallel_vocab.py and test_parallel_placement.py: vocabulary shards and replicas)
    "checkpoint": (["moeflow/checkpoint/*"],
                   ["test_checkpoint*.py", "test_parallel_dcp.py", "test_parallel_vocab.py",
                    "test_parallel_placement.py"]),
    # the batches a run sees (which windows of which source, by step: a resumed run's too, the
    # mixture weights) and the documents and tokens they come from. Its tests are in-process but
    # for the training runs of test_train_own_data.py (one a minute long), which test_train_lm.py's
    # runs (ten minutes of them, most spawning ranks) would join if the two were one package
    "train/data": (["moeflow/train/tokens.py", "moeflow/train/sources.py", "moeflow/train/data.py",
                    "moeflow/train/lm_data.py"],
                   ["test_distribution_contracts.py", "test_train_data.py", "test_train_val_split.py",
                    "test_train_own_data.py"]),
    # the run directory and the checkpoint a resumed run continues from (what it saves of the run,
    # what it refuses), and the training loop
    "train/lm": (["moeflow/train/lm.py", "moeflow/train/lm_checkpoint.py"],
                 ["test_train_lm.py", "test_train_own_data.py", "test_train_val_split.py"]),
    # the weights a user imports and exports: where each tensor lives in a family's Hugging Face
    # checkpoint (both ways), its config.json read field by field, the quantised weights
    # dequantised. Not test_family_*.py: their compiled greedy-decode tests take about a minute
    # each (five of them), and every loader function is covered by them
    "convert": (["moeflow/convert/*"], ["test_convert_*.py"]),
    # the expert weights a store hands the model: what is loaded, evicted, checksummed and written
    # back (the cache, the ring, the disk tier, the offloaded optimizer and what they share).
    # Every test runs in this process (the CLI tests' subprocesses record nothing, but kill)
    "storage": (["moeflow/storage/*"],
                ["test_storage.py", "test_storage_damage.py", "test_models_generation_offload.py"]),
    # the KV cache and the static decode step (the columns a call writes and reads, each row's
    # rotary positions, the padding and sliding-window masks, row views) and the compiled decoder
    # that runs the step; test_models_attention.py: the window masks and every attention option's
    # cached and static steps against the whole sequence; test_models_compiled_loop.py: the compiled
    # decoder's loop, caches and stand-ins with the step left uncompiled (the compiling tests skip in
    # mutmut's coverage pass, whose call records dynamo cannot trace: they cover no mutant)
    "models/decode": (["moeflow/models/kv_cache.py", "moeflow/models/compiled_decode.py"],
                      ["test_models_kv_cache.py", "test_models_attention.py", "test_models_compiled_loop.py"]),
    # the language model around the blocks: its forward and loss, the cache it makes, the cached
    # call and the static step (test_models_kv_cache.py, test_models_attention.py: against the
    # whole sequence)
    "models/gpt": (["moeflow/models/gpt.py"], ["test_models.py", "test_models_kv_cache.py", "test_models_attention.py"]),
}


# what a work directory holds a copy of: the code, the tests, and the benchmark harness some tests
# import (``bench``; ``also_copy`` in ``[tool.mutmut]`` takes it on into mutmut's own copy)
COPIED = ("moeflow", "tests", "bench")


def test_files(package: str, tests: Path = ROOT / "tests") -> list[str]:
    """The package's test files as paths relative to the repository (globs expanded, sorted);
    ``ValueError`` for a pattern that matches nothing (a renamed file would otherwise leave its
    mutants without tests silently)."""
    out: list[str] = []
    for pattern in PACKAGES[package][1]:
        found = sorted(p.relative_to(tests.parent).as_posix() for p in tests.glob(pattern))
        if not found:
            raise ValueError(f"PACKAGES[{package!r}]: no test file matches {pattern!r} in {tests}")
        out += [f for f in found if f not in out]
    return out


def work_config(package: str, pyproject: str) -> str:
    """``pyproject.toml`` for the package's work directory: the repository's ``[tool.mutmut]``
    with the package's modules and test files, and its ``[tool.pytest.ini_options]``, as TOML
    text.

    The pytest section must be there: mutmut runs pytest in ``mutants/<package>/mutants/`` (its
    copy of this file), and pytest takes its settings from the nearest ``pyproject.toml`` that
    has that section. Without it, that was the repository's own, whose ``pythonpath = ["."]``
    put the repository ahead of the mutated copy on ``sys.path``: every test imported the
    unmutated ``moeflow``, and mutmut found no test covering any mutant."""
    tool = tomllib.loads(pyproject)["tool"]
    config = dict(tool["mutmut"])
    config["only_mutate"] = PACKAGES[package][0]
    config["pytest_add_cli_args_test_selection"] = test_files(package)
    lines = []
    for section, values in (("mutmut", config), ("pytest.ini_options", tool["pytest"]["ini_options"])):
        lines.append(f"[tool.{section}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"[tool.mutmut] value of type {type(value).__name__} is not supported: {value!r}")


def cores() -> int:
    """The cores this process may run on (all of the machine's where the OS cannot say)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def work_dir(package: str) -> Path:
    return ROOT / "mutants" / package.replace("/", "-")


def prepare(package: str) -> Path:
    """The package's work directory with fresh copies of ``COPIED`` and its
    ``pyproject.toml`` (rewritten only when it changed: mutmut reruns everything when it does)."""
    work = work_dir(package)
    work.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in COPIED:
        shutil.rmtree(work / name, ignore_errors=True)
        shutil.copytree(ROOT / name, work / name, ignore=ignore)
    config = work_config(package, (ROOT / "pyproject.toml").read_text())
    target = work / "pyproject.toml"
    if not target.exists() or target.read_text() != config:
        target.write_text(config)
    return work


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("packages", nargs="*", metavar="PACKAGE",
                   help=f"packages to run (default: all, in this order): {', '.join(PACKAGES)}")
    p.add_argument("--mutants", nargs="+", default=None, metavar="GLOB",
                   help="only mutants whose names match one of these, e.g. 'moeflow.layer.moe.*' (one package)")
    p.add_argument("--max-children", type=int, default=2, help="mutants run at once (default: %(default)s)")
    p.add_argument("--mutmut", default=str(Path(sys.executable).with_name("mutmut")), help="mutmut's executable")
    args = p.parse_args(argv)
    unknown = [pkg for pkg in args.packages if pkg not in PACKAGES]
    if unknown:
        p.error(f"unknown package(s) {', '.join(unknown)}; known: {', '.join(PACKAGES)}")
    packages = args.packages or list(PACKAGES)
    if args.mutants and len(packages) != 1:
        p.error(f"--mutants {args.mutants!r} needs exactly one package, got {len(packages)}")
    if args.max_children < 1:
        p.error(f"--max-children must be >= 1, got {args.max_children}")
    for package in packages:
        work = prepare(package)
        # mutmut forks its children from one process that has loaded the tests: each would keep
        # that process's torch threads, and max_children of them at 2 threads each on 2 cores
        # spend their time in OpenMP spin-waits; the cores are shared out (tests/conftest.py
        # takes OMP_NUM_THREADS) unless the caller set OMP_NUM_THREADS
        threads = max(1, cores() // args.max_children)
        env = {"OMP_NUM_THREADS": str(threads), **os.environ, "GIT_CEILING_DIRECTORIES": str(work.parent)}
        cmd = [args.mutmut, "run", "--max-children", str(args.max_children), *(args.mutants or [])]
        print(f"== {package}: {' '.join(PACKAGES[package][0])} against {len(PACKAGES[package][1])} test patterns "
              f"(in {work.relative_to(ROOT)})", flush=True)
        code = subprocess.run(cmd, cwd=work, env=env).returncode
        if code != 0:
            print(f"mutmut exited with {code} for {package}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
