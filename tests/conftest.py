"""Shared fixtures (fresh random inputs per test, never zeros) and the cost tiers.

Every test carries exactly one tier marker (registered in pyproject.toml, cheapest first):
``unit`` (config, shapes, validation; no MoE compute), ``reference`` (one process, CPU, against
references), ``distributed`` (gloo ranks), ``triton`` (Triton kernels under the interpreter),
``e2e`` (short training runs, the docs, the CLI), ``integration`` (transformers, Tutel, Mixtral).
A file of one tier says so once (``pytestmark``), a mixed file per test. Collection fails on a
test with no tier or with two, and runs the tiers cheapest first (file order within a tier).
``gpu`` and ``slow`` are not tiers; they go on top of one. Helpers live in ``helpers.py``.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator

import torch  # noqa: E402  (importing torch does not import Triton)

# Without CUDA, the Triton tests run the kernels under the interpreter, which must be on before
# Triton is first imported in this process, and importing transformers (the integration tests)
# imports Triton. Collection imports the test modules in file-name order, so it is switched on
# here, before any of them. With CUDA it stays off: the ``gpu`` tests run the compiled kernels
# (``tests/test_gpu.py`` fails if they are interpreted) and the interpreter tests are skipped.
# moeflow itself never reads the variable (``moeflow.kernels.triton`` asks Triton).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# cheapest first; the order tests run in
TIERS = ("unit", "reference", "distributed", "triton", "e2e", "integration")

# Hypothesis: no per-example deadline (the first torch call of a process can be slow on a loaded
# 2-core machine, and a deadline would make that a flaky failure), a moderate number of examples
# so the whole suite stays fast. ``HYPOTHESIS_PROFILE=thorough`` runs many more.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Threads: at most 2 (small matmuls on a 2-core machine: more only add overhead and run-to-run
# variation), and under pytest-xdist (``make test`` runs 2 workers) the cores shared among the
# workers: each worker, and through OMP_NUM_THREADS every process it starts that does not set its
# own (the CLI and the ranks read it), gets torch's thread count (the cores, or OMP_NUM_THREADS)
# // workers. Two workers at 2 threads each on 2 cores spend their time in OpenMP spin-waits: the
# layer, matrix, dispatch and recompute files took 195 s under 2 workers at 2 threads and 73 s at
# 1 (EPYC VM, 2026-11-27).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, torch.get_num_threads() // WORKERS))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)


def _test_seed(nodeid: str) -> int:
    # zlib.crc32 is stable across processes (``hash(str)`` is salted per process, which would
    # make a failure impossible to reproduce).
    return zlib.crc32(nodeid.encode()) % (2**31)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A seeded generator per test: reproducible, different for each test through its node id."""
    return torch.Generator().manual_seed(_test_seed(request.node.nodeid))


@pytest.fixture(autouse=True)
def _threads_back() -> Iterator[None]:
    """Each test starts with ``THREADS`` threads, whatever the one before it set (the in-process
    CLI sets its ``--threads``)."""
    torch.set_num_threads(THREADS)
    yield


@pytest.fixture(autouse=True)
def _seed_global_rng(request: pytest.FixtureRequest) -> None:
    """Seed the global RNG too (noise, jitter and dropout in the router draw from it)."""
    torch.manual_seed(_test_seed(request.node.nodeid) + 1)


@pytest.fixture(autouse=True)
def _cpu_paths_unless_gpu_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``gpu`` tests the CPU paths on any machine, as CI (no GPU) runs it:
    on a machine with CUDA, the commands' ``--device`` default (CUDA where available) and the
    ranks a test starts (``--nproc 2`` on one GPU would be refused) would otherwise move it onto
    the GPU. CUDA is hidden from it (``torch.cuda.is_available``) and from the processes it starts
    (``CUDA_VISIBLE_DEVICES``). Nothing changes on a machine without CUDA."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _tier(item: pytest.Item) -> str:
    tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
    if len(tiers) != 1:
        raise pytest.UsageError(
            f"{item.nodeid}: needs exactly one tier marker of {', '.join(TIERS)}, has "
            f"{', '.join(sorted(tiers)) or 'none'} (pytestmark = pytest.mark.<tier> for a whole file)"
        )
    return tiers.pop()


@pytest.hookimpl(tryfirst=True)  # before -m deselects anything: the rule holds for every test
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Fail collection on a test without exactly one tier; run the cheaper tiers first (stable)."""
    rank = {item.nodeid: TIERS.index(_tier(item)) for item in items}
    items.sort(key=lambda item: rank[item.nodeid])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """End the pool of gloo ranks ``helpers.spawn_ranks`` keeps (if a test started one)."""
    import helpers

    helpers.close_rank_pool()
