"""The Triton kernels (``moeflow.kernels.triton``) against their torch references, under the Triton
interpreter (on machines without CUDA; with CUDA the module is skipped and ``tests/test_gpu.py``
runs the compiled kernels at full size).

Every kernel is compared with its reference on odd shapes (row counts that are not a multiple
of any block size, empty experts, K=1 and K=8, E up to 256), outputs and every gradient, fp32
plus a tiny bf16/fp16 case; integer outputs exactly. The interpreter runs each program instance
in Python (about a millisecond each), so the shapes are tiny; ``@pytest.mark.gpu`` tests run the
same comparisons at full size on CUDA (``tests/test_gpu.py``).

``TRITON_INTERPRET=1`` must be set before Triton is imported anywhere in the process, hence the
first lines below (without CUDA); ``conftest.py`` sets it too, before any test module is
collected (importing transformers imports Triton). The library itself never reads it:
``moeflow.kernels.triton`` asks Triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

import moeflow  # noqa: E402
from moeflow import DispatchConfig, ExpertsConfig  # noqa: E402
from moeflow.dispatch import LocalDispatcher, assign_slots  # noqa: E402
from moeflow.experts.ffn import GroupedExperts, grouped_ffn  # noqa: E402
from moeflow.kernels import grouped_mm_loop, resolve_grouped_mm_backend  # noqa: E402
from moeflow.kernels import triton as mt  # noqa: E402
from moeflow.kernels.activation import ACTIVATIONS, GATED  # noqa: E402
from moeflow.kernels.permute import permute_rows, unpermute_rows  # noqa: E402
# load every kernel module now, while the interpreter is on: @triton.jit picks the interpreter
# when a kernel is *defined* (a test below switches the interpreter off for a moment)
from moeflow.kernels.triton import grouped_gemm, permute, routing, slots  # noqa: E402, F401
from moeflow.routing import select_experts  # noqa: E402
from moeflow.types import RoutingResult  # noqa: E402

from helpers import assert_close_rel, random_counts  # noqa: E402

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not mt.interpreter_active(), reason="CUDA is present, so the Triton interpreter is off in this "
                       "process (the kernels run compiled: tests/test_gpu.py); these tests run the kernels on CPU"),
]

REPO = Path(__file__).resolve().parents[1]

# relative tolerance of a kernel vs the reference at the same precision
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def assert_kernel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``assert_close_rel`` at ``dtype``'s tolerance, relative to the largest reference magnitude."""
    assert_close_rel(actual, expected, TOL[dtype], what, floor=1e-6, same_dtype=False)


def distinct_ids(gen: torch.Generator, T: int, E: int, K: int, skip: int = 0) -> torch.Tensor:
    """``[T, K]`` ids, distinct per row, never using the last ``skip`` experts (empty experts)."""
    scores = torch.rand(T, E, generator=gen)
    if skip:
        scores[:, E - skip :] = -1
    return scores.topk(K, dim=1).indices


# ------------------------------------------------------------------------------------------
# selection and import hygiene


def test_importing_moeflow_does_not_import_triton_or_dcp():
    """Every process that imports moeflow (each CLI command, each rank) would pay for these at
    start: Triton about 0.1 s, torch.distributed.checkpoint (and DTensor, sympy) about 1 s."""
    code = ("import sys, moeflow, moeflow.kernels, moeflow.kernels.triton, moeflow.parallel, moeflow.checkpoint, "
            "moeflow.train, moeflow.cli.main\n"
            "late = [m for m in ('triton', 'torch.distributed.checkpoint', 'torch.distributed.tensor') if m in sys.modules]\n"
            "assert not late, late")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


def test_availability_and_registry():
    assert mt.interpreter_active() and mt.triton_available("cpu")
    assert not mt.triton_available("meta")
    # auto never picks Triton on CPU, not even under the interpreter
    assert resolve_grouped_mm_backend("auto", torch.device("cpu"), torch.float32, (8, 16)) != "triton"
    assert resolve_grouped_mm_backend("triton", torch.device("cpu"), torch.float32) == "triton"
    with pytest.raises(ValueError, match="backend='triton'.*float64"):
        resolve_grouped_mm_backend("triton", torch.device("cpu"), torch.float64)
    if not torch.cuda.is_available():
        assert not mt.triton_available("cuda")


def test_explicit_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not mt.triton_available("cpu")
    with pytest.raises(ValueError, match="backend='triton'.*interpreter"):
        resolve_grouped_mm_backend("triton", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="logits_TE is on device cpu"):
        mt.fused_topk_routing(torch.randn(3, 4), top_k=1, scoring="softmax")


# ------------------------------------------------------------------------------------------
# permute / unpermute primitives and the activation (the Triton launchers against the references;
# the differentiable permute_rows / unpermute_rows are tested in test_kernels.py)


@pytest.mark.parametrize("N,J,M,D", [(37, 1, 29, 20), (29, 8, 200, 33), (23, 3, 17, 130), (5, 2, 0, 7)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_triton_gather_reduce_and_dot_match_reference(gen, N, J, M, D, dtype):
    """Random indices with invalid entries (which may hold any value), weights or none. fp64 to
    fp64 rounding: the fp64 checks of the layer on CUDA (expert parallel against one process at
    1e-10) run these kernels, and fp32 sums there missed by 1e-7 on an H100."""
    from moeflow.kernels.permute import gather_dot_reference, gather_reduce_reference
    from moeflow.kernels.triton.permute import launch_gather_dot, launch_gather_reduce

    src = torch.randn(M, D, generator=gen).to(dtype)
    index = torch.randint(0, max(M, 1), (N, J), generator=gen)
    valid = torch.rand(N, J, generator=gen) < 0.8
    index[~valid] = 10**6  # never read
    w = (torch.rand(N, J, generator=gen) + 0.5).to(dtype)
    for v, ww in ((valid, w), (valid, None), (None, None) if M else (valid, None)):
        idx = index if v is not None else index.clamp(max=max(M - 1, 0))
        assert_kernel_close(launch_gather_reduce(src, idx, v, ww), gather_reduce_reference(src, idx, v, ww), dtype,
                            "gather_reduce")
    a = torch.randn(N, D, generator=gen).to(dtype)
    assert_kernel_close(launch_gather_dot(a, src, index, valid, dtype), gather_dot_reference(a, src, index, valid, w),
                        dtype, "gather_dot")


@pytest.mark.parametrize("T,K,M,D,keep", [(37, 1, 37, 20, 1.0), (29, 8, 200, 33, 0.6), (23, 3, 17, 130, 0.5)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_permute_ops_on_cuda_run_one_triton_gather_reduce(gen, monkeypatch, T, K, M, D, keep, dtype):
    """What ``moeflow::permute_rows`` and ``moeflow::unpermute_rows`` run for CUDA tensors (their
    registered CUDA kernels, called here on CPU tensors under the interpreter): one Triton
    gather-reduce launch each and no other op, equal to the references on random rows with
    drops (invalid entries holding any index) and odd sizes; the CUDA kernels of the backwards'
    gather-reduce and gather-dot likewise."""
    from moeflow.kernels import permute as ops

    for name in ("permute_rows", "unpermute_rows", "gather_reduce", "gather_dot"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"moeflow::{name}", "CUDA"), name
    launches: list[str] = []
    for name in ("launch_gather_reduce", "launch_gather_dot"):
        real = getattr(permute, name)
        monkeypatch.setattr(permute, name, lambda *a, _real=real, _name=name: launches.append(_name) or _real(*a))
    A = T * K
    slots = torch.randperm(A, generator=gen)[: min(A, M)]
    rows = torch.randperm(M, generator=gen)[: slots.numel()]
    kept = torch.rand(slots.numel(), generator=gen) < keep
    slots, rows = slots[kept], rows[kept]
    index_M = torch.randint(-5, 10**6, (M,), generator=gen)  # any value where invalid
    valid_M = torch.zeros(M, dtype=torch.bool)
    index_M[rows], valid_M[rows] = torch.div(slots, K, rounding_mode="floor"), True
    assign_M = torch.randint(0, A, (M,), generator=gen)
    assign_M[rows] = slots
    row_A = torch.randint(-5, 10**6, (A,), generator=gen)
    kept_A = torch.zeros(A, dtype=torch.bool)
    row_A[slots], kept_A[slots] = rows, True
    row_TK, kept_TK = row_A.view(T, K), kept_A.view(T, K)

    x = torch.randn(T, D, generator=gen, dtype=dtype)
    w_M = torch.rand(M, generator=gen, dtype=dtype) + 0.5
    for weights in (None, w_M):
        got = ops.permute_rows_cuda(x, index_M, valid_M, row_TK, kept_TK, weights)
        want = ops.gather_rows_reference(x, index_M.clamp(0, T - 1), valid_M, None, None)
        assert_kernel_close(got, want * (1 if weights is None else weights.unsqueeze(1)), dtype, "permute")
    y = torch.randn(M, D, generator=gen, dtype=dtype)
    w_TK = torch.rand(T, K, generator=gen, dtype=dtype)
    for weights in (None, w_TK):
        got = ops.unpermute_rows_cuda(y, row_TK, kept_TK, weights, assign_M, valid_M)
        want = ops.unpermute_rows_reference(y, row_TK.clamp(0, M - 1), kept_TK, weights, assign_M, valid_M)
        assert_kernel_close(got, want, dtype, "unpermute")
    assert launches == ["launch_gather_reduce"] * 4, launches
    # the backwards' primitives: grad_y of unpermute, and the weights' gradient
    g_TD = torch.randn(T, D, generator=gen, dtype=dtype)
    token_M1 = torch.div(assign_M, K, rounding_mode="floor").view(-1, 1)
    w_M1 = w_TK.reshape(-1)[assign_M].view(-1, 1)
    assert_kernel_close(ops.gather_reduce_cuda(g_TD, token_M1, valid_M.view(-1, 1), w_M1),
                        ops.gather_reduce_reference(g_TD, token_M1, valid_M.view(-1, 1), w_M1), dtype, "grad y")
    assert_kernel_close(ops.gather_dot_cuda(g_TD, y, row_TK, kept_TK, w_TK),
                        ops.gather_dot_reference(g_TD, y, row_TK, kept_TK, w_TK), dtype, "grad w")
    assert launches[4:] == ["launch_gather_reduce", "launch_gather_dot"], launches


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_activation_matches_reference(gen, activation, dtype):
    """Forward ``a = act(h)`` and the in-place backward on odd shapes (rows and widths not a
    multiple of the blocks)."""
    from moeflow.kernels.activation import activate_backward_reference_, activate_reference
    from moeflow.kernels.triton.activation import launch_activate, launch_activate_backward_

    gated = activation in GATED
    N, C = 13, 300
    # (* 4: beyond swiglu_oai's clamps at +-7 too; one gate and one up value exactly at them)
    h = (torch.randn(N, 2 * C if gated else C, generator=gen) * 4).to(dtype)
    if gated:
        h[0, :2] = h[0, C : C + 2] = torch.tensor([7.0, -7.0])
    assert_kernel_close(launch_activate(h, activation), activate_reference(h, activation), dtype, "activate")
    da = torch.randn(N, C, generator=gen).to(dtype)
    got, ref = h.clone(), h.clone()
    launch_activate_backward_(got, da.clone(), activation)
    activate_backward_reference_(ref, da.clone(), activation)
    assert_kernel_close(got, ref, dtype, "activate backward")
    # out=: into rows 2..2+N of a bigger buffer (the pipelined experts' layout), bit-equal to the
    # plain calls (the same kernel), h and the other rows untouched
    F_ = h.shape[1]
    a_buf = torch.full((N + 5, C), 3.0, dtype=dtype)
    h_before = h.clone()
    launch_activate(h, activation, out=a_buf[2 : 2 + N])
    assert torch.equal(a_buf[2 : 2 + N], launch_activate(h, activation)) and torch.equal(h, h_before)
    assert (a_buf[:2] == 3).all() and (a_buf[2 + N :] == 3).all()
    dh_buf = torch.full((N + 5, F_), 3.0, dtype=dtype)
    launch_activate_backward_(h, da.clone(), activation, out=dh_buf[2 : 2 + N])
    assert torch.equal(dh_buf[2 : 2 + N], got) and torch.equal(h, h_before)
    assert (dh_buf[:2] == 3).all() and (dh_buf[2 + N :] == 3).all()
    with pytest.raises(ValueError, match="out must be"):
        launch_activate(h, activation, out=a_buf[:N, :-1])
    with pytest.raises(ValueError, match="out must be"):
        launch_activate_backward_(h, da, activation, out=dh_buf[:N].to(torch.float64))


# ------------------------------------------------------------------------------------------
# slot assignment


@pytest.mark.parametrize("T,K,E", [(37, 1, 5), (50, 8, 256), (1, 2, 3), (101, 6, 64), (0, 2, 4), (300, 8, 256)])
def test_assign_positions_match_references(gen, T, K, E):
    ids_TK = distinct_ids(gen, T, E, K, skip=min(3, E - K)) if T else torch.empty(0, K, dtype=torch.long)
    cap = max(1, (T * K) // E)
    for choice_major in (True, False):
        pos, counts, kept = mt.assign_positions(ids_TK, E, capacity=cap, choice_major=choice_major)
        pos_ref, counts_ref, kept_ref = mt.assign_positions_reference(ids_TK, E, capacity=cap, choice_major=choice_major)
        assert torch.equal(pos, pos_ref) and torch.equal(counts, counts_ref) and torch.equal(kept, kept_ref)
        # the sort-based dispatcher reference gives the same positions
        policy = "position" if choice_major else None
        slots = assign_slots(ids_TK, torch.rand(T, K, generator=gen), num_experts=E, drop_policy=policy)
        assert torch.equal(pos, torch.empty_like(slots.pos_A).scatter_(0, slots.order_A, slots.pos_A))
        assert torch.equal(counts, slots.counts_E)
    pos32, counts32, none = mt.assign_positions(ids_TK.int(), E, choice_major=False)
    assert none is None and torch.equal(pos32, pos) and torch.equal(counts32, counts)


@settings(max_examples=25)
@given(
    T=st.integers(1, 40), E=st.integers(1, 300), K=st.integers(1, 8), cap=st.integers(0, 12),
    choice_major=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_assign_positions_random_shapes(T, E, K, cap, choice_major, seed):
    K = min(K, E)
    ids_TK = distinct_ids(torch.Generator().manual_seed(seed), T, E, K)
    got = mt.assign_positions(ids_TK, E, capacity=cap, choice_major=choice_major)
    ref = mt.assign_positions_reference(ids_TK, E, capacity=cap, choice_major=choice_major)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_assign_positions_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ids_TK must be"):
        mt.assign_positions(torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(TypeError, match="int32 or int64"):
        mt.assign_positions(torch.zeros(3, 1), 4)
    with pytest.raises(ValueError, match="num_experts"):
        mt.assign_positions(torch.zeros(3, 1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match="capacity"):
        mt.assign_positions(torch.zeros(3, 1, dtype=torch.long), 2, capacity=-1)


def test_assign_positions_out_of_range_ids_are_never_kept():
    """A -1 sentinel, E itself (a one-hot column exists for it: E=5 pads to 8) and anything
    beyond: position -1, counted nowhere, never kept; the valid ids are unaffected."""
    E = 5
    ids_TK = torch.tensor([[0, -1], [5, 2], [0, 7], [2, 0], [-3, 4], [100, 0]])
    valid = (ids_TK >= 0) & (ids_TK < E)
    for choice_major in (True, False):
        pos, counts, kept = mt.assign_positions(ids_TK, E, capacity=2, choice_major=choice_major)
        # the reference on the same ids with every invalid one sent to an extra expert E
        pos_ref, counts_ref, _ = mt.assign_positions_reference(
            torch.where(valid, ids_TK, E), E + 1, capacity=2, choice_major=choice_major
        )
        assert torch.equal(pos, torch.where(valid.reshape(-1), pos_ref, -1))
        assert torch.equal(counts, counts_ref[:E])
        assert torch.equal(kept, valid.reshape(-1) & (pos_ref < 2))


# ------------------------------------------------------------------------------------------
# fused routing


ROUTINGS = [
    dict(scoring="softmax"),
    dict(scoring="softmax", normalize_topk=True),
    dict(scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5),
    dict(scoring="topk_softmax"),
]


@pytest.mark.parametrize("T,E,K", [(37, 5, 1), (19, 256, 8), (33, 64, 6)])
@pytest.mark.parametrize("kw", ROUTINGS, ids=["softmax", "softmax-norm", "sigmoid-norm-scaled", "topk_softmax"])
def test_fused_routing_matches_select_experts(gen, T, E, K, kw):
    logits = torch.randn(T, E, generator=gen, requires_grad=True)
    bias = torch.randn(E, generator=gen) * 0.1
    got = mt.fused_topk_routing(logits, top_k=K, selection_bias_E=bias, **kw)
    ref = select_experts(logits, top_k=K, selection_bias_E=bias, **kw)
    assert torch.equal(got[1], ref[1])  # ids, exactly
    assert_kernel_close(got[0], ref[0], torch.float32, "weights")
    assert_kernel_close(got[2], ref[2], torch.float32, "scores")
    g_w, g_s = torch.randn(T, K, generator=gen), torch.randn(T, E, generator=gen)
    (gl,) = torch.autograd.grad((got[0] * g_w).sum() + (got[2] * g_s).sum(), logits)
    (gl_ref,) = torch.autograd.grad((ref[0] * g_w).sum() + (ref[2] * g_s).sum(), logits)
    assert_kernel_close(gl, gl_ref, torch.float32, "grad logits")


@pytest.mark.parametrize(
    "T,E,K,groups,topk_groups,group_score",
    [(19, 256, 8, 8, 4, "top2_sum"), (23, 64, 6, 8, 3, "max"), (17, 12, 2, 3, 2, "top2_sum")],
    ids=["deepseek-v3", "max", "small"],
)
def test_fused_routing_group_limits(gen, T, E, K, groups, topk_groups, group_score):
    logits = torch.randn(T, E, generator=gen, requires_grad=True)
    kw = dict(
        top_k=K, scoring="sigmoid", normalize_topk=True, routed_scaling_factor=2.5,
        selection_bias_E=torch.randn(E, generator=gen) * 0.1,
        num_groups=groups, topk_groups=topk_groups, group_score=group_score,
    )
    got = mt.fused_topk_routing(logits, **kw)
    ref = select_experts(logits, **kw)
    assert torch.equal(got[1], ref[1])
    assert_kernel_close(got[0], ref[0], torch.float32, "weights")
    g_w = torch.randn(T, K, generator=gen)
    (gl,) = torch.autograd.grad((got[0] * g_w).sum(), logits)
    (gl_ref,) = torch.autograd.grad((ref[0] * g_w).sum(), logits)
    assert_kernel_close(gl, gl_ref, torch.float32, "grad logits")


def test_fused_routing_bf16_computes_in_fp32(gen):
    # distinct values, exact in bf16 (multiples of 1/32 below 4): no ties, so the ids are unique
    logits = ((torch.randperm(21 * 12, generator=gen) - 126) / 32).view(21, 12).to(torch.bfloat16)
    w, ids, s = mt.fused_topk_routing(logits, top_k=3, scoring="softmax", normalize_topk=True)
    w_ref, ids_ref, s_ref = select_experts(logits.float(), top_k=3, scoring="softmax", normalize_topk=True)
    assert w.dtype == s.dtype == torch.bfloat16
    assert torch.equal(ids, ids_ref)
    assert_kernel_close(w, w_ref.to(torch.bfloat16), torch.bfloat16, "weights")
    assert_kernel_close(s, s_ref.to(torch.bfloat16), torch.bfloat16, "scores")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the all -inf row: NaN weights, as in torch
@pytest.mark.parametrize("scoring", ["topk_softmax", "sigmoid"])
def test_fused_routing_fewer_finite_logits_than_k_gives_distinct_ids(scoring):
    """Rows with fewer than K finite (biased) scores: the ids stay distinct, finite ones first
    (an argmax over an all -inf row would return expert 0 again and again)."""
    E, K = 6, 4
    logits = torch.full((4, E), float("-inf"))
    logits[0, 3] = 1.0  # one finite logit
    logits[1, [5, 1]] = torch.tensor([0.5, 2.0])  # two
    # row 2: all -inf; row 3: finite scores, but the bias rules out all but one expert
    logits[3] = torch.randn(E)
    bias = torch.zeros(E)
    if scoring == "sigmoid":  # sigmoid(-inf) = 0 is finite: the bias makes the -inf selections
        bias[:] = float("-inf")
        bias[2] = 0.0
    w, ids, _ = mt.fused_topk_routing(logits, top_k=K, scoring=scoring, selection_bias_E=bias)
    assert all(len(set(row)) == K for row in ids.tolist()), ids
    assert bool(((ids >= 0) & (ids < E)).all())
    if scoring == "topk_softmax":
        assert ids[0, 0] == 3 and ids[1, :2].tolist() == [1, 5]
        assert w[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    else:
        assert ids[:, 0].tolist() == [2, 2, 2, 2]


def test_fused_routing_nan_scores_rank_first_like_topk(gen):
    """NaN ranks above every number (torch.topk's order); the rest of the row as the reference."""
    T, E, K = 9, 16, 4
    logits = torch.randn(T, E, generator=gen)
    logits[2, [3, 11]] = float("nan")
    logits[5, 7] = float("nan")
    w, ids, _ = mt.fused_topk_routing(logits, top_k=K, scoring="sigmoid")
    w_ref, ids_ref, _ = select_experts(logits, top_k=K, scoring="sigmoid")
    assert all(len(set(row)) == K for row in ids.tolist())
    assert ids[2, :2].tolist() == [3, 11] and ids[5, 0] == 7  # NaNs first, lower id first
    assert sorted(ids[2, :2].tolist()) == sorted(ids_ref[2, :2].tolist()) and torch.equal(ids[2, 2:], ids_ref[2, 2:])
    others = [t for t in range(T) if t != 2]
    assert torch.equal(ids[others], ids_ref[others])
    torch.testing.assert_close(w[others], w_ref[others], equal_nan=True)
    assert bool(w[2, :2].isnan().all()) and bool(w[5, 0].isnan())
    torch.testing.assert_close(w[2, 2:], w_ref[2, 2:])


def test_fused_routing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="E <= 256"):
        mt.fused_topk_routing(torch.randn(2, 257), top_k=1, scoring="softmax")
    with pytest.raises(ValueError, match="top_k must be in"):
        mt.fused_topk_routing(torch.randn(2, 16), top_k=9, scoring="softmax")
    with pytest.raises(ValueError, match="scoring must be one of"):
        mt.fused_topk_routing(torch.randn(2, 16), top_k=2, scoring="cosine")
    with pytest.raises(ValueError, match="num_groups must be a positive divisor"):
        mt.fused_topk_routing(torch.randn(2, 16), top_k=2, scoring="sigmoid", num_groups=3)
    with pytest.raises(ValueError, match="topk_groups=1 must be in"):
        mt.fused_topk_routing(torch.randn(2, 16), top_k=4, scoring="sigmoid", num_groups=8, topk_groups=1)
    with pytest.raises(TypeError, match="floating point"):
        mt.fused_topk_routing(torch.zeros(2, 16, dtype=torch.long), top_k=2, scoring="softmax")


# ------------------------------------------------------------------------------------------
# grouped GEMM and fused FFN


@pytest.mark.parametrize("E,R,D,F,empty", [(1, 5, 4, 8, 0), (4, 33, 8, 12, 1), (8, 101, 16, 40, 3), (6, 0, 4, 4, 6)])
def test_grouped_mm_matches_loop(gen, E, R, D, F, empty):
    counts = random_counts(gen, E, R, empty) if R else torch.zeros(E, dtype=torch.long)
    offs = torch.cumsum(counts, 0)
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w_EFD = torch.randn(E, F, D, generator=gen, requires_grad=True)
    w = w_EFD.transpose(1, 2)  # a strided view, read without a copy
    y = mt.grouped_mm_triton(x, w, offs)
    if R == 0:
        assert y.shape == (0, F)
        return
    y_ref = grouped_mm_loop(x, w, offs)
    assert_kernel_close(y, y_ref, torch.float32, "y")
    g = torch.randn(R, F, generator=gen)
    got = torch.autograd.grad(y, (x, w_EFD), g)
    ref = torch.autograd.grad(y_ref, (x, w_EFD), g)
    assert_kernel_close(got[0], ref[0], torch.float32, "grad x")
    assert_kernel_close(got[1], ref[1], torch.float32, "grad w")
    assert torch.all(got[1][counts == 0] == 0)  # empty groups: exactly zero


@settings(max_examples=15)
@given(
    E=st.integers(1, 9), R=st.integers(1, 70), D=st.integers(1, 40), F=st.integers(1, 40),
    empty=st.integers(0, 8), seed=st.integers(0, 2**31 - 1),
)
def test_grouped_mm_random_shapes(E, R, D, F, empty, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = random_counts(gen, E, R, min(empty, E - 1))
    offs = torch.cumsum(counts, 0)
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w = torch.randn(E, D, F, generator=gen, requires_grad=True)
    y, y_ref = mt.grouped_mm_triton(x, w, offs), grouped_mm_loop(x, w, offs)
    assert_kernel_close(y, y_ref, torch.float32, "y")
    g = torch.randn(R, F, generator=gen)
    for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(y_ref, (x, w), g)):
        assert_kernel_close(a, b, torch.float32, "grad")


@pytest.mark.parametrize("E,empty", [(64, 50), (256, 240)])
def test_grouped_mm_many_experts_mostly_empty(gen, E, empty):
    """E up to 256 (BLOCK_E = 512 with the tail group), most groups empty, runs of empty groups
    at the start and end; tiny D/F keep the interpreter fast."""
    R, D, F = 45, 8, 12
    counts = random_counts(gen, E, R, empty)
    counts[:3] = 0
    counts[-3:] = 0
    counts[E // 2] += R - int(counts.sum())
    offs = torch.cumsum(counts, 0)
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w = torch.randn(E, D, F, generator=gen, requires_grad=True)
    y, y_ref = mt.grouped_mm_triton(x, w, offs), grouped_mm_loop(x, w, offs)
    assert_kernel_close(y, y_ref, torch.float32, "y")
    g = torch.randn(R, F, generator=gen)
    got, ref = torch.autograd.grad(y, (x, w), g), torch.autograd.grad(y_ref, (x, w), g)
    assert_kernel_close(got[0], ref[0], torch.float32, "grad x")
    assert_kernel_close(got[1], ref[1], torch.float32, "grad w")
    assert torch.all(got[1][counts == 0] == 0)


def test_row_tiles_bound_covers_every_schedule(gen):
    """``row_tiles_bound`` (the grid's row tiles, known without the counts) is at least the row
    tiles of the schedule the kernel derives from the counts, for random, concentrated and
    spread-out counts; and a decode step's few rows over many experts launch few row tiles."""
    from moeflow.kernels.triton.grouped_gemm_launch import _schedule, row_tiles_bound

    cases = [(8, 128, 16), (128, 128, 16), (1, 256, 16), (45, 64, 16), (300, 8, 128), (129, 4, 128), (17, 300, 16)]
    for R, E, bm in cases:
        draws = [random_counts(gen, E, R, int(torch.randint(0, E, (1,), generator=gen))) for _ in range(20)]
        spread = torch.zeros(E, dtype=torch.long)
        spread[: min(E, R)] = 1
        spread[0] += R - int(spread.sum())
        lumped = torch.zeros(E, dtype=torch.long)
        lumped[E // 2] = R
        for counts in (*draws, spread, lumped):
            tile_end = _schedule(torch.cumsum(counts, 0), bm, R)[3]
            assert int(tile_end[-1]) <= row_tiles_bound(R, E, bm), (R, E, bm, counts.tolist())
    assert row_tiles_bound(8, 128, 16) == 9  # (was ceil(R / BLOCK_M) + E + 1 = 130)


def test_few_row_calls_take_the_few_row_tiles_on_a_gpu():
    """The tile sizes by call size (no kernel runs: the device is only named)."""
    from moeflow.kernels.triton.grouped_gemm_launch import FEW_ROWS, _config

    cuda = torch.device("cuda")
    few, many = _config(torch.bfloat16, cuda, True, FEW_ROWS), _config(torch.bfloat16, cuda, True, FEW_ROWS + 1)
    assert few["BLOCK_M"] == 16 and many["BLOCK_M"] == 128
    assert _config(torch.float32, cuda, True, 8)["BLOCK_M"] == 64  # fp32 keeps its IEEE tiles
    assert _config(torch.bfloat16, torch.device("cpu"), True, 8) == _config(torch.bfloat16, torch.device("cpu"), True, 10**6)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_ffn_decode_rows_over_many_experts(gen, activation):
    """A decode step's shape: 2 tokens x top-4 = 8 rows over 64 experts (most empty, an expert
    with two rows): outputs and every gradient against the loop reference."""
    E, D, H, T, K = 64, 16, 12, 2, 4
    ids = distinct_ids(gen, T, E, K)
    ids[1, 0] = ids[0, 0]  # two tokens share an expert
    ids[1, 1:] = torch.where(ids[1, 1:] == ids[0, 0], (ids[0, 0] + 1) % E, ids[1, 1:])
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    R = int(counts.sum())
    gated = activation in GATED
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w_in = torch.randn(E, D, 2 * H if gated else H, generator=gen, requires_grad=True)
    w_out = torch.randn(E, H, D, generator=gen, requires_grad=True)
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation=activation)
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="loop")
    assert_kernel_close(y, y_ref, torch.float32, "y")
    g = torch.randn(R, D, generator=gen)
    got = torch.autograd.grad(y, (x, w_in, w_out), g)
    ref = torch.autograd.grad(y_ref, (x, w_in, w_out), g)
    for name, a, b in zip(("x", "w_in", "w_out"), got, ref):
        assert_kernel_close(a, b, torch.float32, f"grad {name}")
    assert torch.all(got[1][counts == 0] == 0) and torch.all(got[2][counts == 0] == 0)


def test_grouped_mm_offsets_not_ending_at_r_raise_on_host():
    """Host offsets are checked like the reference (grouped_mm_loop raises ValueError)."""
    x, w = torch.randn(10, 4), torch.randn(3, 4, 5)
    for offs in ([2, 5, 8], [2, 5, 12], [5, 2, 10], [-1, 5, 10]):
        offs = torch.tensor(offs)
        with pytest.raises(ValueError, match="offs_E"):
            mt.grouped_mm_triton(x, w, offs)
    with pytest.raises(ValueError, match="offs_E"):
        grouped_mm_loop(x, w, torch.tensor([2, 5, 8]))
    with pytest.raises(ValueError, match="offs_E|counts_E"):
        mt.grouped_ffn_triton(x, torch.tensor([2, 3, 3]), torch.randn(3, 4, 6), torch.randn(3, 6, 4), activation="gelu")
    with pytest.raises(ValueError, match="counts_E"):
        mt.grouped_ffn_triton(x, torch.tensor([12, -2, 0]), torch.randn(3, 4, 6), torch.randn(3, 6, 4), activation="gelu")


def _dirty_empty(monkeypatch):
    """Make torch.empty return NaN-filled memory, so rows a kernel never writes show up."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("end_shift", [-7, 9])
def test_grouped_mm_device_offsets_are_clamped_and_tail_zeroed(gen, monkeypatch, end_shift):
    """What the kernels do with offsets they cannot check (GPU offsets: the custom op is called
    directly): offs_E[-1] > R cuts the groups at R (no access past R); offs_E[-1] < R leaves the
    rows after the last offset to no group, and they come out as exact zeros, gradients too."""
    _dirty_empty(monkeypatch)
    E, R, D, F = 4, 37, 8, 12
    counts = torch.tensor([10, 0, 12, 15 + end_shift])
    offs = torch.cumsum(counts, 0)
    end = min(int(offs[-1]), R)
    offs_ok = offs.clamp(max=R)  # what the groups mean once cut at R
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w = torch.randn(E, D, F, generator=gen, requires_grad=True)
    y = torch.ops.moeflow.grouped_mm(x, w, offs)
    y_ref = grouped_mm_loop(x[:end], w, offs_ok)
    assert_kernel_close(y[:end], y_ref, torch.float32, "y")
    assert torch.equal(y[end:], torch.zeros(R - end, F))
    g = torch.randn(R, F, generator=gen)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), g[:end])
    assert_kernel_close(gx, gx_ref, torch.float32, "grad x")  # the reference's x[end:] gets zeros
    assert torch.equal(gx[end:], torch.zeros(R - end, D))
    assert_kernel_close(gw, gw_ref, torch.float32, "grad w")
    # the fused FFN: the tail rows of y, h and a are zeros as well
    w_in, w_out = torch.randn(E, D, 2 * F, generator=gen), torch.randn(E, F, D, generator=gen)
    y2, h2, a2 = torch.ops.moeflow.grouped_ffn(x.detach(), w_in, w_out, offs, "swiglu")
    y2_ref = grouped_ffn(x.detach()[:end], offs_ok.diff(prepend=offs_ok.new_zeros(1)), w_in, w_out, activation="swiglu", backend="loop")
    assert_kernel_close(y2[:end], y2_ref, torch.float32, "ffn y")
    for t in (y2, h2, a2):
        assert torch.equal(t[end:], torch.zeros_like(t[end:]))


def test_dact_fake_dtype_follows_the_gradient():
    """The fake kernel of the fused activation backward allocates like the real one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = (torch.randn(6, 4, dtype=torch.float16), torch.randn(2, 3, 4, dtype=torch.float16),
            torch.tensor([2, 6]), torch.randn(6, 3), "gelu")
    real = torch.ops.moeflow.grouped_mm_dact(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.moeflow.grouped_mm_dact(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.dtype == real.dtype == torch.float16 and fake.shape == real.shape


@pytest.mark.parametrize("case", ["plain", "b_in", "b_out", "callable", "recompute"])
def test_grouped_ffn_takes_the_fused_kernel_only_where_it_applies(gen, case, monkeypatch):
    """``grouped_ffn(backend="triton")`` runs the whole FFN in ``grouped_ffn_triton`` only without
    biases and with a named activation (with recompute, inside ``torch.utils.checkpoint``);
    otherwise the Triton grouped GEMM with the rest in torch. The result is the loop's."""
    fused = []
    real = grouped_gemm.grouped_ffn_triton  # (grouped_ffn imports it from there when it runs)
    monkeypatch.setattr(grouped_gemm, "grouped_ffn_triton", lambda *a, **k: (fused.append(1), real(*a, **k))[1])
    E, D, H = 3, 16, 8
    counts = torch.tensor([5, 0, 4])
    x, w_in, w_out = torch.randn(9, D, generator=gen), torch.randn(E, D, 2 * H, generator=gen), torch.randn(E, H, D, generator=gen)
    b_in = torch.randn(E, 2 * H, generator=gen) if case == "b_in" else None
    b_out = torch.randn(E, D, generator=gen) if case == "b_out" else None
    act = (lambda h: torch.nn.functional.silu(h[:, :H]) * h[:, H:]) if case == "callable" else "swiglu"
    kw = dict(activation=act, recompute=case == "recompute")
    with torch.no_grad():
        got = grouped_ffn(x, counts, w_in, w_out, b_in, b_out, backend="triton", **kw)
        want = grouped_ffn(x, counts, w_in, w_out, b_in, b_out, backend="loop", **kw)
    assert_kernel_close(got, want, torch.float32, "y")
    assert fused == ([1] if case in ("plain", "recompute") else [])


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_grouped_ffn_matches_reference(gen, activation):
    E, D, H = 5, 24, 20
    counts = torch.tensor([7, 0, 19, 1, 10])
    R = int(counts.sum())
    gated = activation in GATED
    x = torch.randn(R, D, generator=gen, requires_grad=True)
    w_in = torch.randn(E, D, 2 * H if gated else H, generator=gen, requires_grad=True)
    w_out = torch.randn(E, H, D, generator=gen, requires_grad=True)
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation=activation)
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="loop")
    assert_kernel_close(y, y_ref, torch.float32, "y")
    g = torch.randn(R, D, generator=gen)
    got = torch.autograd.grad(y, (x, w_in, w_out), g)
    ref = torch.autograd.grad(y_ref, (x, w_in, w_out), g)
    for name, a, b in zip(("x", "w_in", "w_out"), got, ref):
        assert_kernel_close(a, b, torch.float32, f"grad {name}")
    assert torch.all(got[1][1] == 0) and torch.all(got[2][1] == 0)  # the empty expert


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_ffn_without_grad_skips_h(gen, activation):
    """No gradient wanted: the epilogue does not write h (returned empty); y is unchanged."""
    counts = torch.tensor([4, 0, 9])
    gated = activation == "swiglu"
    x = torch.randn(13, 8, generator=gen)
    w_in, w_out = torch.randn(3, 8, 12 if gated else 6, generator=gen), torch.randn(3, 6, 8, generator=gen)
    offs = torch.cumsum(counts, 0)
    y1, h1, a1 = torch.ops.moeflow.grouped_ffn(x, w_in, w_out, offs, activation, True)
    y0, h0, a0 = torch.ops.moeflow.grouped_ffn(x, w_in, w_out, offs, activation, False)
    assert h1.shape == (13, w_in.shape[2]) and h0.shape == (0, w_in.shape[2])
    assert torch.equal(y0, y1) and torch.equal(a0, a1)
    with torch.no_grad():
        y = mt.grouped_ffn_triton(x, counts, w_in.requires_grad_(True), w_out, activation=activation)
    assert torch.equal(y, y1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_ffn_16bit(gen, dtype):
    counts = torch.tensor([3, 0, 14])
    x = torch.randn(17, 16, generator=gen).to(dtype).requires_grad_(True)
    w_in = (torch.randn(3, 16, 24, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    w_out = (torch.randn(3, 12, 16, generator=gen) * 0.3).to(dtype).requires_grad_(True)
    y = mt.grouped_ffn_triton(x, counts, w_in, w_out, activation="swiglu")
    # the reference at the same precision (its h is rounded to 16 bits before the gate, the
    # kernel's is not), judged with the 16-bit tolerance
    y_ref = grouped_ffn(x, counts, w_in, w_out, activation="swiglu", backend="loop")
    assert y.dtype == dtype
    assert_kernel_close(y, y_ref, dtype, "y")
    g = torch.randn(17, 16, generator=gen).to(dtype)
    for a, b in zip(torch.autograd.grad(y, (x, w_in, w_out), g), torch.autograd.grad(y_ref, (x, w_in, w_out), g)):
        assert_kernel_close(a, b, dtype, "grad")


def test_grouped_rejects_bad_arguments():
    x = torch.randn(4, 8)
    counts = torch.tensor([1, 3])
    w_in, w_out = torch.randn(2, 8, 6), torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="activation must be one of"):
        mt.grouped_ffn_triton(x, counts, w_in, w_out, activation="tanh")
    with pytest.raises(ValueError, match="shapes do not chain"):
        mt.grouped_ffn_triton(x, counts, w_in, w_out, activation="gelu")
    with pytest.raises(TypeError, match="w_EDF dtype"):
        mt.grouped_mm_triton(x, w_in.double(), torch.cumsum(counts, 0))
    with pytest.raises(ValueError, match=r"w_EDF must be \[E=2"):
        mt.grouped_mm_triton(x, torch.randn(3, 8, 6), torch.cumsum(counts, 0))


# ------------------------------------------------------------------------------------------
# the experts backend end to end, and torch.compile


@pytest.mark.parametrize("cf", [0.0, -0.5])
def test_moe_layer_with_triton_experts_matches_loop(gen, cf):
    results = []
    x = torch.randn(29, 24, generator=gen)
    for backend in ("loop", "triton"):
        torch.manual_seed(7)
        layer = moeflow.MoE(dim=24, hidden=20, num_experts=6, top_k=2, capacity_factor=cf, experts=ExpertsConfig(backend=backend))
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in layer.parameters()]))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    assert_kernel_close(y1, y0, torch.float32, "y")
    assert_kernel_close(gx1, gx0, torch.float32, "grad x")
    for a, b in zip(gp1, gp0):
        assert_kernel_close(a, b, torch.float32, "grad param")


def test_pipeline_compiles_fullgraph(gen):
    """Routing -> slots -> permute -> fused FFN -> unpermute traced by torch.compile without a
    graph break; outputs and gradients equal eager."""
    T, E, K, D, H = 11, 4, 2, 16, 8

    def moe(x, w_router, w_in, w_out):
        weights, ids, scores = mt.fused_topk_routing(x @ w_router, top_k=K, scoring="softmax", normalize_topk=True)
        pos, counts, _ = mt.assign_positions(ids, E, choice_major=False)
        row_A = (torch.cumsum(counts, 0) - counts)[ids.reshape(-1)] + pos
        assign_M = torch.empty_like(row_A).scatter_(0, row_A, torch.arange(T * K))
        x_MD = permute_rows(x, assign_M // K, None, row_A.view(T, K), None)
        y_MD = mt.grouped_ffn_triton(x_MD, counts, w_in, w_out, activation="swiglu")
        return unpermute_rows(y_MD, row_A.view(T, K), None, weights, assign_M, None) + scores.sum()

    params = [
        torch.randn(T, D, generator=gen, requires_grad=True),
        torch.randn(D, E, generator=gen, requires_grad=True),
        torch.randn(E, D, 2 * H, generator=gen, requires_grad=True),
        torch.randn(E, H, D, generator=gen, requires_grad=True),
    ]
    torch._dynamo.reset()
    eager = moe(*params)
    compiled = torch.compile(moe, fullgraph=True, backend="aot_eager")(*params)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled.square().sum(), params), torch.autograd.grad(eager.square().sum(), params)):
        torch.testing.assert_close(a, b)


def test_grouped_experts_triton_compiles_fullgraph(gen):
    experts = GroupedExperts(num_experts=3, dim=16, hidden=8, config=ExpertsConfig(backend="triton", activation="geglu"))
    counts = torch.tensor([5, 0, 6])
    x = torch.randn(11, 16, generator=gen)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(experts, fullgraph=True, backend="aot_eager")(x, counts), experts(x, counts))


# ------------------------------------------------------------------------------------------
# the benchmark script's smoke mode


def test_bench_script_tiny_cpu_smoke():
    spec = importlib.util.spec_from_file_location("gpu_kernels_bench", REPO / "bench" / "gpu_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(bench)  # type: ignore[union-attr]
    finally:
        del sys.modules[spec.name]
    rows = bench.main(["--device", "cpu", "--tiny"])
    assert rows and all(r["ms"] > 0 for r in rows)
