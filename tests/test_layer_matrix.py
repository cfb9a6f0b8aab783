"""Every execution path of the MoE layer against the readable reference, over one configuration
matrix (legend: moeflow.types).

``PATHS`` is the table of paths: autograd, ``no_grad`` inference, the experts' backwards (lean,
recompute, recompute over chunks, gradient accumulation into ``.grad``), each experts backend
(``triton`` under the Triton interpreter) and the expert-parallel modes on 2 gloo ranks. A new
path joins by one line there. ``AXES`` is the matrix: ``DispatchConfig.weight_at`` x
``ExpertsConfig.activation`` x capacity mode (dropless, capacity with drops, capped with drops)
x ``DispatchConfig.drop_policy`` x dtype x ``top_k``, plus ``ExpertsConfig.bias`` and
``DispatchConfig.renormalize_after_drop`` (which switch the experts and the combine weights onto
other code). The values are read from the config ``Literal`` types (``typing.get_args``), so a
value added to the library joins every path's design at once and fails there until the layer
and the reference agree on it; ``test_paths_table_covers_every_registered_path`` fails when an
experts backend, a parallel mode, a backward or a config field has no place in the table, and
``test_matrix_covers_every_value_of_every_axis`` when a design misses a value (or, pairwise, a
pair of values) of an axis.

Each (path, configuration) runs the layer on fresh random inputs (``N(0, 1)``; parameters
``N(0, 0.25)``, never zeros) and ``moeflow.testing.loop_moe`` on the same parameters: the
reference routes token by token and drops by an independent per-expert loop, so a path that
mis-weights, mis-drops or mis-differentiates anything disagrees by far more than rounding. It
compares the output and, where the path has a backward, the gradient of x and of every
parameter (router and experts; each rank's expert shard and the dense gradients summed over the
ranks for the expert-parallel paths). Tolerances (``assert_close_rel``: max abs error over the
largest reference magnitude, floor 1): fp64 1e-10; fp32 ``TOL["fp32"]`` (two fp32 programs that
sum in different orders; the largest error seen over the matrix is ~1e-6, so 2e-5 is a wide
margin that still fails on any dropped term).

Sizes of the designs: the autograd and ``no_grad`` paths run the full product of the six named
axes (540 configurations each, the two bool axes drawn per configuration from a seeded RNG);
every other path runs a seeded pairwise covering design over its axes (``covering_design``,
``DESIGN_SEED``; ~20 configurations: every pair of values of every two axes appears at least
once, so every value of every axis does). ``python tests/test_layer_matrix.py`` prints every
path's configurations; a pytest id names the path and the configuration, and a failure message
the seed of its inputs (``case_seed``).
"""

from __future__ import annotations

import copy
import itertools
import random
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import get_args

import pytest
import torch

import moeflow
from moeflow import DispatchConfig, ExpertsConfig, ParallelConfig, RouterConfig
from moeflow.config import Activation, DropPolicy, ExpertsBackend, ParallelMode, WeightAt
from moeflow.dispatch.capacity import capacity_rows, resolve_capacity
from moeflow.kernels import GROUPED_MM_BACKENDS
from moeflow.testing import loop_moe, reference_routing

from helpers import assert_close_rel, make_layer, output_and_grads, rand, spawn_ranks

D, H, E = 8, 8, 6  # tiny: fp32 rows of 8 are 32 bytes, as F.grouped_mm needs
T = 16  # tokens of a single-process call
EP_WORLD = 2
EP_TOKENS = (10, 14)  # each rank's tokens (uneven); the reference runs on the 24 concatenated
TRITON_TOKENS = 12  # the interpreter runs a Python call per program instance: fewer rows
DESIGN_SEED = 20240611

DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
TOL = {"fp64": 1e-10, "fp32": 2e-5}

# capacity mode -> capacity_factor (``MoEConfig``; ``moeflow.dispatch.capacity``): the fixed
# capacity and the capped factors are below the mean load, so with T*K/E > 2 some expert always
# gets more than its cap (pigeonhole) and something is dropped; ``_check_drops`` asserts it
CAPACITY_MODES = {"dropless": 0.0, "capacity": 0.5, "capped": -0.75}

# the matrix: axis -> its values (the config Literals, so a new library value shows up here)
AXES: dict[str, tuple[object, ...]] = {
    "weight_at": get_args(WeightAt),
    "activation": get_args(Activation),
    "capacity": tuple(CAPACITY_MODES),
    "drop_policy": get_args(DropPolicy),
    "dtype": tuple(DTYPES),
    "top_k": (1, 2, 3),
    "bias": (False, True),
    "renormalize": (False, True),
}
PRODUCT_AXES = ("weight_at", "activation", "capacity", "drop_policy", "dtype", "top_k")  # "full" designs


@dataclass(frozen=True)
class Case:
    """One configuration of the matrix (a value of every axis in ``AXES``)."""

    weight_at: str
    activation: str
    capacity: str
    drop_policy: str
    dtype: str
    top_k: int
    bias: bool
    renormalize: bool

    @property
    def id(self) -> str:
        return (f"{self.weight_at}-{self.activation}-{self.capacity}-{self.drop_policy}-{self.dtype}-k{self.top_k}"
                f"{'-bias' if self.bias else ''}{'-renorm' if self.renormalize else ''}")


@dataclass(frozen=True)
class Path:
    """One execution path of the layer.

    ``run``: how it is driven: ``"autograd"`` (one forward, gradients by ``autograd.grad``),
    ``"no_grad"`` (forward under ``torch.no_grad``: the inference shortcuts), ``"accumulate"``
    (two micro-batches, each ``.backward()``, the second adding into ``.grad``) or ``"parallel"``
    (``expert_parallel`` on ``EP_WORLD`` gloo ranks, per-call ``parallel``/``overlap_degree``).
    ``experts``: ``ExpertsConfig`` fields the path sets. ``only``: axes the path restricts, with
    ``why``. ``design``: ``"full"`` (the product of ``PRODUCT_AXES``) or ``"pairwise"``.
    ``tier``: the marker its tests carry.
    """

    name: str
    run: str
    experts: Mapping[str, object] = field(default_factory=dict)
    parallel: str | None = None
    overlap_degree: int = 1
    only: Mapping[str, tuple[object, ...]] = field(default_factory=dict)
    why: str = ""
    design: str = "pairwise"
    tier: str = "reference"

    def domain(self) -> dict[str, tuple[object, ...]]:
        return {axis: self.only.get(axis, values) for axis, values in AXES.items()}


FP32_ONLY = {"dtype": ("fp32",)}
PATHS: list[Path] = [
    Path(name="autograd", run="autograd", design="full"),  # backend "auto": loop in fp64, grouped_mm in fp32
    Path(name="no_grad", run="no_grad", design="full"),  # dropless: run_dropless_no_grad + lean_ffn_no_grad
    Path(name="recompute", run="autograd", experts={"recompute": True}),
    Path(name="recompute_chunks", run="autograd", experts={"recompute": True, "recompute_chunks": 2}),
    Path(name="grad_accumulation", run="accumulate"),
    Path(name="grad_accumulation_recompute", run="accumulate", experts={"recompute": True}),
    Path(name="backend_loop", run="autograd", experts={"backend": "loop"}),
    Path(name="backend_grouped_mm", run="autograd", experts={"backend": "grouped_mm"}, only=FP32_ONLY,
         why="F.grouped_mm has no fp64 kernel on CPU (resolve_grouped_mm_backend refuses it)"),
    Path(name="backend_grouped_mm_no_grad", run="no_grad", experts={"backend": "grouped_mm"}, only=FP32_ONLY,
         why="F.grouped_mm has no fp64 kernel on CPU"),
    Path(name="backend_triton", run="autograd", experts={"backend": "triton"}, only=FP32_ONLY, tier="triton",
         why="the Triton kernels take fp32/bf16/fp16"),
    Path(name="ep_expert", run="parallel", parallel="expert", tier="distributed"),
    Path(name="ep_expert_overlap2", run="parallel", parallel="expert", overlap_degree=2, tier="distributed"),
    Path(name="ep_data", run="parallel", parallel="data", tier="distributed"),
    Path(name="ep_sharded", run="parallel", parallel="sharded", tier="distributed"),
    Path(name="ep_hybrid2", run="parallel", parallel="hybrid:2", only={"bias": (False,)}, tier="distributed",
         why="hidden slices need experts without biases (b_out would be added r times)"),
    Path(name="ep_auto", run="parallel", parallel="auto", tier="distributed"),  # one call: a candidate the tuner times
]


# ----------------------------------------------------------------------------- designs


def _pairs(row: tuple[int, ...]) -> Iterator[tuple[int, int, int, int]]:
    for i, j in itertools.combinations(range(len(row)), 2):
        yield (i, row[i], j, row[j])


def covering_design(domain: Mapping[str, tuple[object, ...]], seed: int,
                    chosen: Sequence[Mapping[str, object]] = ()) -> list[dict[str, object]]:
    """A pairwise covering design over ``domain`` (greedy, AETG-style, seeded): rows of one value
    per axis such that every pair of values of every two axes appears in some row. ``chosen``:
    rows drawn already (not returned), whose pairs need no new row."""
    names = list(domain)
    sizes = [len(domain[n]) for n in names]
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in range(sizes[i]) for b in range(sizes[j])}
    for done in chosen:
        uncovered -= set(_pairs(tuple(domain[n].index(done[n]) for n in names)))
    rng = random.Random(seed)
    rows: list[tuple[int, ...]] = []
    while uncovered:
        best: tuple[int, ...] | None = None
        best_gain = -1
        for _ in range(20):  # candidates; each starts from an uncovered pair, so each row gains
            i, a, j, b = rng.choice(sorted(uncovered))
            row: dict[int, int] = {i: a, j: b}
            order = [n for n in range(len(names)) if n not in row]
            rng.shuffle(order)
            for n in order:
                def gain(v: int, n: int = n) -> tuple[int, float]:
                    new = sum((min(m, n), row[m] if m < n else v, max(m, n), v if m < n else row[m]) in uncovered
                              for m in row)
                    return new, rng.random()
                row[n] = max(range(sizes[n]), key=gain)
            full = tuple(row[n] for n in range(len(names)))
            g = sum(p in uncovered for p in _pairs(full))
            if g > best_gain:
                best, best_gain = full, g
        assert best is not None
        rows.append(best)
        uncovered -= set(_pairs(best))
    return [{n: domain[n][v] for n, v in zip(names, row)} for row in rows]


def full_design(domain: Mapping[str, tuple[object, ...]], seed: int,
                chosen: Sequence[Mapping[str, object]] = ()) -> list[dict[str, object]]:
    """The product of ``PRODUCT_AXES``; the other axes drawn per row from a seeded RNG.
    ``chosen``: rows drawn already (not returned): their products are left out."""
    rng = random.Random(seed)
    done = {tuple(row[a] for a in PRODUCT_AXES) for row in chosen}
    rows = []
    for values in itertools.product(*(domain[a] for a in PRODUCT_AXES)):
        if values in done:
            continue
        row = dict(zip(PRODUCT_AXES, values))
        rows.append({a: row[a] if a in row else rng.choice(domain[a]) for a in domain})
    return rows


# values added to an axis after the designs were first drawn: a design draws its rows over the
# older values first, exactly as before, then adds rows for what the new values bring (their
# products, or their pairs), so a test id names the same case across library versions
LATER_VALUES: dict[str, tuple[object, ...]] = {"activation": ("swiglu_oai",)}


def design(path: Path) -> list[Case]:
    """The configurations ``path`` runs (deterministic: ``DESIGN_SEED`` and the path's name)."""
    make = full_design if path.design == "full" else covering_design
    seed = DESIGN_SEED + zlib.crc32(path.name.encode())
    domain = path.domain()
    older = {a: tuple(v for v in values if v not in LATER_VALUES.get(a, ())) or values for a, values in domain.items()}
    rows = make(older, seed)
    if older != domain:
        rows += make(domain, seed + 1, chosen=rows)
    return [Case(**row) for row in rows]  # type: ignore[arg-type]


def case_seed(path: Path, case: Case) -> int:
    """The seed of a configuration's parameters and inputs (stable across processes)."""
    return zlib.crc32(f"{path.name}/{case.id}".encode()) % (2**31)


# ----------------------------------------------------------------------------- building and checking


def build_layer(path: Path, case: Case, gen: torch.Generator, **kw: object) -> moeflow.MoE:
    """The fp64/fp32 eval-mode layer of ``case`` with the path's experts settings."""
    return make_layer(
        gen, dim=D, hidden=H, num_experts=E, top_k=case.top_k, dtype=DTYPES[case.dtype],
        capacity_factor=CAPACITY_MODES[case.capacity],
        dispatch=DispatchConfig(drop_policy=case.drop_policy, weight_at=case.weight_at,  # type: ignore[arg-type]
                                renormalize_after_drop=case.renormalize),
        experts_cfg=ExpertsConfig(activation=case.activation, bias=case.bias, **path.experts),  # type: ignore[arg-type]
        **kw,
    )


def _check_drops(layer: moeflow.MoE, case: Case, x_TD: torch.Tensor) -> None:
    """The capacity and capped modes drop something here (else they would test dropless again)."""
    if case.capacity == "dropless":
        return
    _, ids_TK = reference_routing(layer, x_TD, case.top_k)
    cap = capacity_rows(abs(CAPACITY_MODES[case.capacity]), num_tokens=x_TD.shape[0], top_k=case.top_k,
                        num_experts=E)
    assert int(torch.bincount(ids_TK.flatten(), minlength=E).max()) > cap, f"{case.id}: nothing dropped"


class Failures:
    """Collects the mismatches of one configuration under its path, configuration and seed."""

    def __init__(self, path: Path, case: Case, seed: int, dtype: str) -> None:
        self.where = f"path {path.name!r}, configuration {case.id} (seed {seed})"
        self.tol = TOL[dtype]
        self.found: list[str] = []

    def close(self, actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
        if actual is None:
            actual = torch.zeros_like(expected)
        try:
            assert_close_rel(actual, expected, self.tol, what)
        except AssertionError as err:
            self.found.append(f"{self.where}: {err}")


def _reference(layer: moeflow.MoE, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return output_and_grads(lambda x: loop_moe(layer, x), x, [p for _, p in layer.named_parameters()], grad_out)


def run_single_process(path: Path, case: Case) -> list[str]:
    """One process: ``path`` against ``loop_moe`` on ``case`` (outputs; x and every parameter's
    gradient where the path has a backward). Returns the mismatches."""
    seed = case_seed(path, case)
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    layer = build_layer(path, case, gen)
    names = [n for n, _ in layer.named_parameters()]
    tokens = TRITON_TOKENS if path.tier == "triton" else T
    x = rand(gen, tokens, D, dtype=dtype)
    _check_drops(layer, case, x)
    fail = Failures(path, case, seed, case.dtype)
    if path.run == "no_grad":
        with torch.no_grad():
            y, y_ref = layer(x), loop_moe(layer, x)
        fail.close(y, y_ref, "output")
    elif path.run == "autograd":
        grad_out = rand(gen, tokens, D, dtype=dtype)
        y_ref, grads_ref = _reference(layer, x, grad_out)
        y, grads = output_and_grads(layer, x, [p for _, p in layer.named_parameters()], grad_out)
        fail.close(y, y_ref, "output")
        for name, g, g_ref in zip(("x", *names), grads, grads_ref):
            fail.close(g, g_ref, f"grad of {name}")
    elif path.run == "accumulate":
        # two micro-batches: the first makes every .grad, the second adds into it (the experts'
        # fused accumulation, moeflow.experts.weight_grads); the sums against the reference's
        micro = [(x, rand(gen, tokens, D, dtype=dtype)),
                 (rand(gen, tokens, D, dtype=dtype), rand(gen, tokens, D, dtype=dtype))]
        refs = [_reference(layer, xm, gm) for xm, gm in micro]
        params = dict(layer.named_parameters())
        for m, ((xm, gm), (y_ref, grads_ref)) in enumerate(zip(micro, refs)):
            xm = xm.clone().requires_grad_(True)
            y = layer(xm)
            (y * gm).sum().backward()
            fail.close(y.detach(), y_ref, f"micro-batch {m} output")
            fail.close(xm.grad, grads_ref[0], f"micro-batch {m} grad of x")
            for i, name in enumerate(names):
                summed = sum(r[1][i + 1] for r in refs[: m + 1])
                fail.close(params[name].grad, summed, f"after micro-batch {m}: .grad of {name}")
    else:
        raise AssertionError(f"{path.name}: run {path.run!r} is not a single-process path")
    return fail.found


def run_parallel(rank: int, world: int, path: Path, case: Case) -> list[str]:
    """On every rank: ``path`` (``expert_parallel``, this rank's slice of the batch) against
    ``loop_moe`` on the concatenated batch with the full layer: the output and x-gradient rows of
    this rank, its expert shard's gradients, the dense gradients summed over the ranks. Every
    collective runs before any comparison, so a mismatch never leaves the ranks out of step:
    the mismatches are returned."""
    from moeflow.parallel import all_reduce_gradients, dense_parameters, expert_parallel

    seed = case_seed(path, case)
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[case.dtype]
    layer = build_layer(path, case, gen, router=RouterConfig(load_balance_coef=0.0))
    xs = [rand(gen, t, D, dtype=dtype) for t in EP_TOKENS]
    gs = [rand(gen, t, D, dtype=dtype) for t in EP_TOKENS]
    x_all = torch.cat(xs)
    _check_drops(layer, case, x_all)
    y_ref, grads_ref = _reference(layer, x_all, torch.cat(gs))
    ref = dict(zip(("x", *(n for n, _ in layer.named_parameters())), grads_ref))

    ep = expert_parallel(copy.deepcopy(layer))
    x = xs[rank].clone().requires_grad_(True)
    y = ep(x, parallel=path.parallel, overlap_degree=path.overlap_degree)
    (y * gs[rank]).sum().backward()
    all_reduce_gradients(dense_parameters(ep), None, average=False)

    start = sum(EP_TOKENS[:rank])
    rows = slice(start, start + EP_TOKENS[rank])
    e = E // world
    fail = Failures(path, case, seed, case.dtype)
    fail.close(y.detach(), y_ref[rows], f"rank {rank} output")
    fail.close(x.grad, ref["x"][rows], f"rank {rank} grad of x")
    for name, p in ep.named_parameters():
        expected = ref[name][rank * e : (rank + 1) * e] if getattr(p, "moeflow_expert", False) else ref[name]
        fail.close(p.grad, expected, f"rank {rank} grad of {name}")
    return fail.found


def _case_ep_matrix(rank: int, world: int) -> None:
    """Every expert-parallel path over its design, in one spawn (start-up is paid once)."""
    found: list[str] = []
    for path in PATHS:
        if path.run == "parallel":
            for case in design(path):
                found += run_parallel(rank, world, path, case)
    assert not found, f"{len(found)} mismatches:\n" + "\n".join(found)


CASES = {"ep_matrix": _case_ep_matrix}  # looked up by the spawned ranks


# ----------------------------------------------------------------------------- the tests


@pytest.mark.unit
def test_matrix_covers_every_value_of_every_axis() -> None:
    """Every path's design holds every value of every axis it runs (and every pair of values of
    two axes, for a pairwise design; the whole product of ``PRODUCT_AXES`` for a full one); a
    restriction says why; the capacity modes are the three layouts the library knows."""
    # the capacity modes are the three layouts moeflow.dispatch.capacity knows
    kinds = {}
    for mode, cf in CAPACITY_MODES.items():
        plan = resolve_capacity(cf, num_tokens=T, top_k=2, num_experts=E)
        kinds[mode] = ("padded" if plan.layout_capacity is not None else
                       "capped" if plan.row_cap is not None else "dropless")
    assert kinds == {"dropless": "dropless", "capacity": "padded", "capped": "capped"}
    for path in PATHS:
        domain, cases = path.domain(), design(path)
        assert not path.only or path.why, f"{path.name}: restricts {dict(path.only)} without saying why"
        for axis, values in domain.items():
            assert set(values) <= set(AXES[axis]), f"{path.name}: {axis} {values} not in the matrix"
            seen = {getattr(c, axis) for c in cases}
            assert seen == set(values), f"{path.name}: {axis} takes {sorted(map(str, seen))}, not all of {values}"
        if path.design == "pairwise":
            for a, b in itertools.combinations(domain, 2):
                seen_pairs = {(getattr(c, a), getattr(c, b)) for c in cases}
                missing = set(itertools.product(domain[a], domain[b])) - seen_pairs
                assert not missing, f"{path.name}: pairs of {a} x {b} never run: {missing}"
        else:
            assert len(cases) == len(list(itertools.product(*(domain[a] for a in PRODUCT_AXES))))
        assert len({c.id for c in cases}) == len(cases), f"{path.name}: a configuration runs twice"


# Every field of the configs that choose a code path is an axis of the matrix, a knob some path
# sets, or named here with the reason it is neither. A new field fails until it is placed.
FIELD_ROLES = {
    ExpertsConfig: {"activation": "axis", "bias": "axis", "backend": "path", "recompute": "path",
                    "recompute_chunks": "path", "init_std": "not a path: make_layer redraws every parameter",
                    "fp8": "not a path: e4m3 changes the numbers by design; test_kernels_fp8.py holds it to its own "
                           "fp32-dequantised reference, outputs and gradients",
                    "fp8_gemm": "not a path: fp8's reference switch (test_kernels_fp8.py)"},
    DispatchConfig: {"drop_policy": "axis", "weight_at": "axis", "renormalize_after_drop": "axis",
                     "parallel": "deprecated: moved to ParallelConfig", "overlap_degree": "deprecated: moved to "
                     "ParallelConfig", "tuner": "deprecated: moved to ParallelConfig"},
    ParallelConfig: {"parallel": "path", "overlap_degree": "path",
                     "tuner": "not a path: how 'auto' times the paths (ep_auto runs its first choice)"},
}


@pytest.mark.unit
def test_paths_table_covers_every_registered_path() -> None:
    """``PATHS`` has a path for every experts backend (``ExpertsBackend``, the grouped-GEMM
    registry and "auto"), every parallel mode (``ParallelMode`` and ``"hybrid:r"``), overlap
    degrees 1 and > 1, and every backward (none, lean, recompute, recompute over chunks,
    gradient accumulation with and without recompute); every config field is placed."""
    assert set(get_args(ExpertsBackend)) == {"auto", *GROUPED_MM_BACKENDS}, "a backend is not in ExpertsBackend"
    backends = {ExpertsConfig(**p.experts).backend for p in PATHS}  # type: ignore[arg-type]
    assert backends == set(get_args(ExpertsBackend)), f"backends without a path: {set(get_args(ExpertsBackend)) - backends}"

    parallel = {p.parallel for p in PATHS if p.run == "parallel"}
    for mode in parallel:
        ParallelConfig(parallel=mode)  # type: ignore[arg-type]  (a valid mode)
    named = {m.split(":")[0] + (":r" if ":" in m else "") for m in parallel if m is not None}
    modes = {*get_args(ParallelMode), "hybrid:r"}
    assert named == modes, f"parallel modes without a path: {modes - named}, unknown: {named - modes}"
    degrees = {p.overlap_degree > 1 for p in PATHS if p.parallel == "expert"}
    assert degrees == {False, True}, f"the expert mode needs a path with overlap_degree 1 and one > 1: {degrees}"

    def backward(p: Path) -> str:
        cfg = ExpertsConfig(**p.experts)  # type: ignore[arg-type]
        if p.run == "no_grad":
            return "none"
        kind = "recompute_chunks" if cfg.recompute_chunks is not None else "recompute" if cfg.recompute else "lean"
        return f"accumulate+{kind}" if p.run == "accumulate" else kind

    backwards = {backward(p) for p in PATHS}
    wanted = {"none", "lean", "recompute", "recompute_chunks", "accumulate+lean", "accumulate+recompute"}
    assert wanted <= backwards, f"backwards without a path: {wanted - backwards}"
    assert {p.run for p in PATHS} == {"autograd", "no_grad", "accumulate", "parallel"}

    for cls, roles in FIELD_ROLES.items():
        names = {f.name for f in fields(cls)}
        assert names == set(roles), f"{cls.__name__}: fields not placed {names - set(roles)}, gone {set(roles) - names}"
        for name, role in roles.items():
            assert role in ("axis", "path") or ": " in role, f"{cls.__name__}.{name}: say why it is not a path"
    assert len({p.name for p in PATHS}) == len(PATHS), "two paths share a name"
    assert {p.tier for p in PATHS} == {"reference", "triton", "distributed"}, "a tier lost its paths"


def _groups(path: Path) -> Iterator[tuple[str, list[Case]]]:
    """A test per configuration of a pairwise design; a full design's 540 run as one test per
    (activation, capacity mode) (fewer pytest items: their per-test overhead was a third of the
    run). Either way a mismatch names the path, the configuration and its seed."""
    cases = design(path)
    if path.design == "pairwise":
        yield from ((c.id, [c]) for c in cases)
        return
    for activation, capacity in itertools.product(AXES["activation"], AXES["capacity"]):
        yield f"{activation}-{capacity}", [c for c in cases if (c.activation, c.capacity) == (activation, capacity)]


_MARKS = {"reference": pytest.mark.reference, "triton": pytest.mark.triton}
SINGLE_PROCESS = [pytest.param(p, cases, id=f"{p.name}-{key}", marks=_MARKS[p.tier])
                  for p in PATHS if p.run != "parallel" for key, cases in _groups(p)]


@pytest.mark.parametrize(("path", "cases"), SINGLE_PROCESS)
def test_path_matches_reference(path: Path, cases: list[Case]) -> None:
    """One process: the path's output and (where it has a backward) the gradients of x and of
    every parameter against ``loop_moe`` at ``TOL[dtype]``, on each configuration of ``cases``."""
    if path.tier == "triton":
        from moeflow.kernels.triton import triton_available

        if not triton_available(torch.device("cpu")):
            pytest.skip("the Triton kernels run on CPU only under the interpreter (TRITON_INTERPRET=1, no CUDA)")
    found = [msg for case in cases for msg in run_single_process(path, case)]
    assert not found, f"{len(found)} mismatches:\n" + "\n".join(found)


@pytest.mark.distributed
def test_expert_parallel_paths_match_reference() -> None:
    """Every expert-parallel path over its design on 2 gloo ranks, in one spawn: each rank's
    output rows, x-gradient rows and expert-shard gradients and the summed dense gradients
    against ``loop_moe`` on the concatenated batch."""
    spawn_ranks(EP_WORLD, __name__, "ep_matrix")


if __name__ == "__main__":  # print the matrix: every path's configurations and seeds
    for p in PATHS:
        cases = design(p)
        print(f"{p.name} ({p.run}, {p.tier}, {p.design}: {len(cases)} configurations)")
        for c in cases:
            print(f"  {c.id}  seed={case_seed(p, c)}")
