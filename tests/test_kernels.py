"""The torch kernels (``moeflow.kernels``: grouped GEMM backends, row gathers, the permute and
unpermute ops, id counts) against their references: outputs and gradients, odd shapes, empty
groups. The Triton kernels: ``test_kernels_triton.py``."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

from moeflow.kernels import (
    GROUPED_MM_BACKENDS,
    gather_rows,
    gather_rows_reference,
    grouped_mm,
    grouped_mm_loop,
    native_grouped_mm_supported,
    resolve_grouped_mm_backend,
)
from moeflow import DispatchConfig
from moeflow.dispatch import LocalDispatcher
from moeflow.kernels.activation import ACTIVATIONS, GATED, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from moeflow.kernels.counts import count_ids
from moeflow.kernels.grouped_mm import grouped_mm_native
from moeflow.kernels.permute import permute_rows, unpermute_rows, unpermute_rows_reference
from moeflow.types import RoutingResult

from helpers import assert_close_rel, random_counts

pytestmark = pytest.mark.reference


@pytest.mark.parametrize("E,R,D,F,empty", [(1, 5, 4, 8, 0), (4, 33, 8, 12, 1), (8, 101, 16, 20, 3), (6, 0, 4, 4, 6)])
@pytest.mark.parametrize("dtype", [torch.float32])
def test_grouped_mm_native_matches_loop(gen, E, R, D, F, empty, dtype):
    if not native_grouped_mm_supported(torch.device("cpu"), dtype):
        pytest.skip("F.grouped_mm not available here")
    counts = random_counts(gen, E, R, empty) if R else torch.zeros(E, dtype=torch.long)
    offs = torch.cumsum(counts, 0)
    x = torch.randn(R, D, generator=gen, dtype=dtype, requires_grad=True)
    w = torch.randn(E, D, F, generator=gen, dtype=dtype, requires_grad=True)
    g = torch.randn(R, F, generator=gen, dtype=dtype)
    y_ref = grouped_mm_loop(x, w, offs) if R else x.new_zeros(0, F)
    y = GROUPED_MM_BACKENDS["grouped_mm"](x, w, offs)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    if R == 0:
        return
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, w), g)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)
    # empty groups get exactly zero weight gradient
    assert torch.all(gw[counts == 0] == 0)


@pytest.mark.parametrize("layout", ["EDF", "EFD view", "EDF slice"])
def test_grouped_mm_native_backward_in_each_weight_layout_and_with_one_side_frozen(gen, layout):
    """The native backward against the loop for weights stored [E, D, F], for the transposed view
    of an [E, F, D] tensor (a Hugging Face ``gate_up_proj``) and for a slice of a wider tensor; with only x
    or only w requiring a gradient (frozen experts, frozen inputs) the other one is None. The
    weight gradient leaves the backward in the transposed layout exactly for the transposed view
    (it then reaches that parameter without a transposing copy), contiguous otherwise."""
    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("F.grouped_mm not available here")
    E, R, D, F = 3, 17, 8, 12
    offs = torch.cumsum(random_counts(gen, E, R, 1), 0)
    x = torch.randn(R, D, generator=gen)
    w = {"EDF": lambda: torch.randn(E, D, F, generator=gen),
         "EFD view": lambda: torch.randn(E, F, D, generator=gen).transpose(1, 2),
         "EDF slice": lambda: torch.randn(E, D, F + 4, generator=gen)[:, :, :F]}[layout]()
    g = torch.randn(R, F, generator=gen)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    gx_ref, gw_ref = torch.autograd.grad(grouped_mm_loop(x_ref, w_ref, offs), (x_ref, w_ref), g)
    for needs in ((True, True), (True, False), (False, True)):
        xi, wi = x.clone().requires_grad_(needs[0]), w.detach().requires_grad_(needs[1])
        y = GROUPED_MM_BACKENDS["grouped_mm"](xi, wi, offs)
        got = iter(torch.autograd.grad(y, [t for t, n in zip((xi, wi), needs) if n], g))
        if needs[0]:
            torch.testing.assert_close(next(got), gx_ref, rtol=1e-5, atol=1e-5)
        if needs[1]:
            gw = next(got)
            torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)
            assert gw.transpose(1, 2).is_contiguous() if layout == "EFD view" else gw.is_contiguous(), gw.stride()
        xi.grad = wi.grad = None
        y = GROUPED_MM_BACKENDS["grouped_mm"](xi, wi, offs)
        y.backward(g)  # through backward(): the gradient that is not needed is None, not anything else
        assert (xi.grad is None) == (not needs[0]) and (wi.grad is None) == (not needs[1])


def test_grouped_mm_native_accepts_expanded_gradient(gen):
    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("F.grouped_mm not available here")
    x = torch.randn(10, 4, generator=gen, requires_grad=True)
    w = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    GROUPED_MM_BACKENDS["grouped_mm"](x, w, torch.tensor([4, 10])).sum().backward()  # stride-0 grad
    torch.testing.assert_close(x.grad[:4], w.detach()[0].sum(1).expand(4, 4))


@pytest.mark.parametrize("layout", ["EDF", "EFD view"])
def test_grouped_mm_native_compiles_in_fp32(gen, layout):
    """torch's fake ``grouped_mm`` takes bf16 only, so a traced fp32 call failed (the biased
    experts of a compiled CPU decode step, gpt-oss's): under ``torch.compile`` it is the opaque
    ``moeflow::native_grouped_mm``, forward and both backward products (traced by AOT autograd), equal
    to eager."""
    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("F.grouped_mm not available here")
    E, R, D, F = 3, 13, 8, 12
    offs = torch.cumsum(random_counts(gen, E, R, 1), 0)
    x = torch.randn(R, D, generator=gen)
    w = torch.randn(E, D, F, generator=gen) if layout == "EDF" else torch.randn(E, F, D, generator=gen).transpose(1, 2)
    g = torch.randn(R, F, generator=gen)
    results = []
    for fn in (grouped_mm_native, torch.compile(grouped_mm_native, fullgraph=True, backend="aot_eager")):
        xi, wi = x.clone().requires_grad_(), w.detach().requires_grad_()
        y = fn(xi, wi, offs)
        y.backward(g)
        results.append((y.detach(), xi.grad, wi.grad))
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_grouped_mm_loop_rejects_padding_rows():
    with pytest.raises(ValueError, match="offs_E"):
        grouped_mm_loop(torch.randn(5, 2), torch.randn(2, 2, 3), torch.tensor([1, 4]))


def test_backend_resolution():
    assert resolve_grouped_mm_backend("auto", torch.device("cpu"), torch.float64) == "loop"  # no fp64 grouped_mm
    assert resolve_grouped_mm_backend("loop", torch.device("cpu"), torch.float32) == "loop"
    with pytest.raises(ValueError, match="backend"):
        resolve_grouped_mm_backend("nope", torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="float64"):
        resolve_grouped_mm_backend("grouped_mm", torch.device("cpu"), torch.float64)
    # F.grouped_mm needs 16-byte row strides: 3 fp32 features are not enough
    assert resolve_grouped_mm_backend("auto", torch.device("cpu"), torch.float32, (3, 8)) == "loop"
    with pytest.raises(ValueError, match="16 bytes"):
        resolve_grouped_mm_backend("grouped_mm", torch.device("cpu"), torch.float32, (3, 8))
    x = torch.randn(3, 2, dtype=torch.float64)
    w = torch.randn(1, 2, 2, dtype=torch.float64)
    torch.testing.assert_close(grouped_mm(x, w, torch.tensor([3])), x @ w[0])
    # "auto" checks the weights' own sizes: 3 fp32 inputs or 3 fp32 outputs per row (12 bytes)
    # take the loop, whatever E (4 experts: 16 bytes, which must not be taken for a feature size)
    for D, F in ((3, 8), (8, 3)):
        x, w, offs = torch.randn(6, D), torch.randn(4, D, F), torch.tensor([1, 3, 3, 6])
        torch.testing.assert_close(grouped_mm(x, w, offs), grouped_mm_loop(x, w, offs), rtol=1e-6, atol=1e-6)


def _one_to_k_mapping(gen: torch.Generator, N: int, K: int, M: int, keep: float):
    """A random partial one-to-K mapping between N*K source slots and M output rows."""
    A = N * K
    n_map = min(A, M)
    slots = torch.randperm(A, generator=gen)[:n_map]
    rows = torch.randperm(M, generator=gen)[:n_map]
    kept = torch.rand(n_map, generator=gen) < keep
    slots, rows = slots[kept], rows[kept]
    index_M = torch.randint(0, max(N, 1), (M,), generator=gen)  # arbitrary where invalid
    valid_M = torch.zeros(M, dtype=torch.bool)
    index_M[rows] = torch.div(slots, K, rounding_mode="floor")
    valid_M[rows] = True
    rev_A = torch.randint(0, max(M, 1), (A,), generator=gen)
    rev_valid_A = torch.zeros(A, dtype=torch.bool)
    rev_A[slots] = rows
    rev_valid_A[slots] = True
    return index_M, valid_M, rev_A.view(N, K), rev_valid_A.view(N, K)


@pytest.mark.parametrize("N,K,M,keep", [(7, 1, 7, 1.0), (13, 2, 30, 0.7), (9, 3, 20, 0.5), (5, 4, 3, 1.0), (1, 1, 1, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gather_rows_matches_reference(gen, N, K, M, keep, dtype):
    index_M, valid_M, rev_NK, rev_valid_NK = _one_to_k_mapping(gen, N, K, M, keep)
    src = torch.randn(N, 6, generator=gen).to(dtype).requires_grad_(True)
    g = torch.randn(M, 6, generator=gen).to(dtype)
    out = gather_rows(src, index_M, valid_M, rev_NK, rev_valid_NK)
    ref = gather_rows_reference(src, index_M, valid_M, rev_NK, rev_valid_NK)
    assert torch.equal(out, ref)  # a gather is exact
    (gs,) = torch.autograd.grad(out, src, g)
    (gs_ref,) = torch.autograd.grad(ref, src, g)
    tol = {torch.float64: 0, torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(gs, gs_ref, rtol=tol, atol=tol)


def test_gather_rows_masks_non_finite_sources(gen):
    """Invalid rows are exactly zero even if the row they point at holds NaN/Inf."""
    src = torch.randn(3, 4, generator=gen)
    src[0] = float("nan")
    out = gather_rows(src, torch.tensor([0, 1]), torch.tensor([False, True]), torch.tensor([[0], [1], [0]]),
                      torch.tensor([[False], [True], [False]]))
    assert torch.equal(out[0], torch.zeros(4))
    assert torch.equal(out[1], src[1])


@pytest.mark.parametrize("capability, native, expected", [
    ((9, 0), True, "grouped_mm"),   # Hopper: torch's grouped GEMM (measured faster than the Triton FFN)
    ((10, 0), True, "grouped_mm"),  # Blackwell
    ((9, 0), False, "triton"),      # where torch's grouped GEMM does not run: Triton
    ((8, 0), True, "triton"),       # Ampere: Triton (torch's grouped GEMM targets Hopper and later)
])
def test_auto_on_cuda_follows_the_gpu(monkeypatch, capability, native, expected):
    """The decision on a CUDA machine (pretended: no tensor is created), per compute
    capability and whether ``F.grouped_mm`` runs there; the capability is read from the device
    named, or from the current one for a bare ``cuda``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    registry = importlib.import_module("moeflow.kernels.grouped_mm")  # the module, not the function
    monkeypatch.setattr(registry, "native_grouped_mm_supported", lambda *args: native)
    asked: list[object] = []
    monkeypatch.setattr(registry, "_cuda_capability", lambda index: asked.append(index) or capability)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for dtype in (torch.bfloat16, torch.float16):
        assert registry.auto_grouped_mm_backend(torch.device("cuda"), dtype, capability=capability) == expected
        assert resolve_grouped_mm_backend("auto", torch.device("cuda:1"), dtype) == expected
        assert resolve_grouped_mm_backend("auto", torch.device("cuda"), dtype) == expected
        assert asked[-2:] == [1, 3], asked
    # fp32 stays on the torch path unless asked for (the kernels' fp32 path is exact, not fast)
    assert resolve_grouped_mm_backend("auto", torch.device("cuda"), torch.float32) == ("grouped_mm" if native else "loop")
    assert resolve_grouped_mm_backend("triton", torch.device("cuda"), torch.float32) == "triton"
    with pytest.raises(ValueError, match="backend='triton'.*float64"):
        resolve_grouped_mm_backend("triton", torch.device("cuda"), torch.float64)


def test_native_probe_runs_on_the_device_asked_about(monkeypatch):
    """``native_grouped_mm_supported`` probes the device type it is asked about (a CUDA answer
    must come from a CUDA probe, not the CPU's), and a feature size whose rows are not 16-byte
    aligned is refused before any probe."""
    registry = importlib.import_module("moeflow.kernels.grouped_mm")
    asked: list[object] = []
    monkeypatch.setattr(registry, "_probe", lambda device_type, dtype: asked.append((device_type, dtype)) or True)
    assert registry.native_grouped_mm_supported(torch.device("cuda", 1), torch.bfloat16, (16, 32))
    assert registry.native_grouped_mm_supported("cpu", torch.float32)
    assert not registry.native_grouped_mm_supported("cuda", torch.bfloat16, (16, 12))
    assert asked == [("cuda", torch.bfloat16), ("cpu", torch.float32)]


def _activation_input(gen: torch.Generator, activation: str, dtype: torch.dtype, N: int = 37, H: int = 24):
    """``h [N, F]`` spread over about [-20, 20] (beyond swiglu_oai's clamps at +-7), with gate
    and up values exactly at the clamps and at 0 in row 0."""
    F_ = 2 * H if activation in GATED else H
    h = torch.randn(N, F_, generator=gen, dtype=torch.float64) * 6
    h[0, :3] = torch.tensor([SWIGLU_OAI_LIMIT, -SWIGLU_OAI_LIMIT, 0.0])
    h[0, F_ - 3 :] = torch.tensor([SWIGLU_OAI_LIMIT, -SWIGLU_OAI_LIMIT, 0.0])
    return h.to(dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_activation_ops_equal_plain_autograd_bit_for_bit(gen, activation, dtype):
    """``activate`` (the op), ``activate_reference`` without autograd (its in-place branch) and
    the in-place backward (the op and the reference) give plain autograd's values through
    ``activate_reference``, bit for bit (they run the kernels autograd runs, in its order)."""
    from moeflow.kernels.activation import activate, activate_backward_, activate_backward_reference_, activate_reference

    h = _activation_input(gen, activation, dtype).requires_grad_()
    a = activate_reference(h, activation)
    da = torch.randn(a.shape, generator=gen, dtype=torch.float64).to(dtype)
    (dh,) = torch.autograd.grad(a, h, da)
    with torch.no_grad():
        assert torch.equal(activate_reference(h.detach().clone(), activation), a)
        assert torch.equal(activate(h.detach(), activation), a)
    for backward in (activate_backward_reference_, activate_backward_):
        got = h.detach().clone()
        assert backward(got, da.clone(), activation) is got
        assert torch.equal(got, dh), backward.__name__


def test_swiglu_oai_values_and_gradients_beyond_the_clamps(gen):
    """gpt-oss's clamped SwiGLU by its formula: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``
    with ``g = min(gate, 7)``; the gradient is zero for a gate above 7 and an up value outside
    [-7, 7], and passes at the limits themselves (``torch.clamp``'s backward); the lean backward
    agrees."""
    from moeflow.kernels.activation import activate_backward_, activate_reference

    assert (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT) == (1.702, 7.0)  # gpt-oss's published constants
    gate = torch.tensor([-20.0, -7.0, -1.5, 0.25, 3.0, 7.0, 7.5, 30.0], dtype=torch.float64)
    up = torch.tensor([-30.0, -7.5, -7.0, -0.25, 0.5, 7.0, 8.0, 2.0], dtype=torch.float64)
    h = torch.cat([gate, up]).view(1, -1).requires_grad_()
    a = activate_reference(h, "swiglu_oai")
    g = gate.clamp(max=7.0)
    want = (up.clamp(-7.0, 7.0) + 1) * g * torch.sigmoid(1.702 * g)
    torch.testing.assert_close(a.view(-1), want, rtol=1e-15, atol=0)
    da = torch.rand(1, 8, generator=gen, dtype=torch.float64) + 0.5
    (dh,) = torch.autograd.grad(a, h, da)
    d_gate, d_up = dh.view(2, 8)
    assert torch.equal(d_gate == 0, gate > 7.0)
    assert torch.equal(d_up == 0, (up < -7.0) | (up > 7.0))
    s = torch.sigmoid(1.702 * gate)
    want_gate = torch.where(gate <= 7.0, da.view(-1) * (up.clamp(-7.0, 7.0) + 1) * (s + 1.702 * gate * s * (1 - s)), 0)
    torch.testing.assert_close(d_gate, want_gate, rtol=1e-13, atol=0)
    lean = activate_backward_(h.detach().clone(), da.clone(), "swiglu_oai")
    assert torch.equal(lean, dh)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activate_into_a_slice_equals_the_plain_ops(gen, activation):
    """``activate_into`` / ``activate_backward_into`` (the pipelined experts write every chunk's
    activation and its gradient into rows of one buffer): bit-equal to ``activate`` and the
    in-place ``activate_backward_``, ``h`` and the buffer's other rows untouched."""
    from moeflow.kernels.activation import activate, activate_backward_, activate_backward_into, activate_into

    N, C = 7, 5
    width = 2 * C if activation in GATED else C
    h = torch.randn(N, width, generator=gen, dtype=torch.float64) * 4
    da = torch.randn(N, C, generator=gen, dtype=torch.float64)
    h_before = h.clone()
    a_buf = torch.full((N + 3, C), 3.0, dtype=torch.float64)
    activate_into(h, activation, a_buf[1 : 1 + N])
    assert torch.equal(a_buf[1 : 1 + N], activate(h, activation)) and torch.equal(h, h_before)
    dh_buf = torch.full((N + 3, width), 3.0, dtype=torch.float64)
    activate_backward_into(h, da, activation, dh_buf[1 : 1 + N])
    assert torch.equal(dh_buf[1 : 1 + N], activate_backward_(h.clone(), da.clone(), activation))
    assert torch.equal(h, h_before)
    for buf in (a_buf, dh_buf):
        assert (buf[0] == 3).all() and (buf[1 + N :] == 3).all()


def test_activate_backward_refuses_bad_operands():
    """The in-place activation backward refuses what it cannot overwrite row by row: a 3-D h
    beside a 2-D da, rows that differ, and either operand not contiguous (each on its own)."""
    from moeflow.kernels.activation import activate_backward_

    h, da = torch.randn(4, 8), torch.randn(4, 4)
    for bad_h, bad_da, match in (
        (torch.randn(4, 2, 8), da, "2-D"),
        (h, torch.randn(4, 2, 4), "2-D"),
        (h, torch.randn(3, 4), "same rows"),
        (torch.randn(8, 4).t(), da, "contiguous"),
        (h, torch.randn(4, 4).t(), "contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            activate_backward_(bad_h, bad_da, "swiglu")


def test_permute_rows_backward_with_no_rows_kept_and_any_value_in_unused_rev_entries(gen):
    """``rev_TK`` entries that ``rev_valid_TK`` marks unused may hold any value (negative, past
    the last row): the weighted backward still gives the reference gradients. With no row kept
    at all (M = 0) every token's gradient is zero and the weights' gradient is empty."""
    T, D, K = 5, 4, 2
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    index_M = torch.tensor([0, 2, 2, 4])
    rev_TK = torch.tensor([[0, -7], [99, -1], [1, 2], [1000, 5], [3, -3]])
    rev_valid_TK = torch.tensor([[True, False], [False, False], [True, True], [False, False], [True, False]])
    w = torch.rand(4, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, D, generator=gen, dtype=torch.float64)
    gx, gw = torch.autograd.grad(permute_rows(x, index_M, None, rev_TK, rev_valid_TK, weights_M=w), (x, w), g)
    gx_ref, gw_ref = torch.autograd.grad(w[:, None] * x[index_M], (x, w), g)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-12, atol=1e-12)
    empty = torch.zeros(0, dtype=torch.long)
    w0 = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    y = permute_rows(x, empty, None, torch.full((T, K), 3), torch.zeros(T, K, dtype=torch.bool), weights_M=w0)
    gx, gw = torch.autograd.grad(y.sum() + 0 * x.sum(), (x, w0), allow_unused=True)
    assert y.shape == (0, D) and torch.equal(gx, torch.zeros_like(x)) and (gw is None or gw.shape == (0,))


@pytest.mark.parametrize("N,J,D,M", [(5, 2, 1, 4), (5, 2, 3, 0), (0, 2, 3, 4), (5, 0, 3, 4), (5, 2, 0, 4)])
def test_gather_dot_on_edge_sizes(gen, N, J, D, M):
    """``gather_dot`` against its definition at one feature (D = 1), with nothing to gather from
    (M = 0: every entry invalid), and with no rows, no entries per row or no features."""
    from moeflow.kernels.permute import gather_dot

    a = torch.randn(N, D, generator=gen, dtype=torch.float64)
    b = torch.randn(M, D, generator=gen, dtype=torch.float64)
    index = torch.randint(0, max(M, 1), (N, J), generator=gen) + (7 if M == 0 else 0)
    valid = torch.rand(N, J, generator=gen) < (0.7 if M else 0.0)
    expected = torch.zeros(N, J, dtype=torch.float64)
    for n in range(N):
        for j in range(J):
            if valid[n, j]:
                expected[n, j] = a[n] @ b[index[n, j]]
    out = gather_dot(a, b, index, valid, a)
    assert out.shape == (N, J) and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_gather_dot_answers_in_the_dtype_of_like_and_permute_saves_x_only_for_weights(gen):
    """``gather_dot`` accumulates in fp32 but answers in ``like``'s dtype (bf16 here); and
    ``permute_rows`` keeps ``x`` for backward only when there are weights to differentiate (the
    unweighted backward needs the indices alone)."""
    from moeflow.kernels.permute import gather_dot

    a, b = torch.randn(3, 8, generator=gen).bfloat16(), torch.randn(4, 8, generator=gen).bfloat16()
    out = gather_dot(a, b, torch.tensor([[0], [3], [1]]), None, a)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (a.float() * b.float()[[0, 3, 1]]).sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        permute_rows(x, torch.tensor([0, 1, 3]), None, torch.tensor([[0], [1], [0], [2]]),
                     torch.tensor([[True], [True], [False], [True]]))
    assert all(t.shape != x.shape for t in saved), [tuple(t.shape) for t in saved]
    # unpermute_rows likewise keeps the expert rows y only for the weight gradient
    y = torch.randn(4, 16, generator=gen, requires_grad=True)
    for weights, keeps_y in ((None, False), (torch.rand(2, 2, generator=gen, requires_grad=True), True)):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            unpermute_rows(y, torch.tensor([[0, 1], [2, 3]]), None, weights, torch.tensor([0, 1, 2, 3]), None)
        assert any(t.shape == y.shape for t in saved) == keeps_y, [tuple(t.shape) for t in saved]


def test_gather_reduce_answers_in_the_input_dtype_and_keeps_its_index_rules(gen):
    """``gather_reduce`` in bf16 and fp16 sums (and weights) in fp32, rounds once and answers in
    the input dtype: one entry per row with a weight, three with and without, eight at D = 1024.
    An invalid entry may hold any index, also when the rows have no features (D = 0) or there is
    one row to gather from; without a valid mask every index must name a row: a stray one fails
    instead of reading a clamped row."""
    from moeflow.kernels.permute import gather_reduce

    M, N, D = 5, 4, 6
    for dtype in (torch.bfloat16, torch.float16):
        src = torch.randn(M, D, generator=gen).to(dtype)
        index = torch.randint(0, M, (N, 3), generator=gen)
        w = torch.rand(N, 3, generator=gen).to(dtype)
        for J, weights in ((3, None), (3, w), (1, w[:, :1])):
            rows = src.float()[index[:, :J]]  # [N, J, D]
            want = (rows if weights is None else rows * weights.float().unsqueeze(-1)).sum(1)
            got = gather_reduce(src, index[:, :J].contiguous(), None, None if weights is None else weights.contiguous())
            assert got.dtype == dtype, (dtype, J, weights is None)
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # rounded once: fp16's own bmm gives other roundings at these sizes on the CPUs we test on
    src, index = torch.randn(64, 1024, generator=gen).half(), torch.randint(0, 64, (16, 8), generator=gen)
    w = torch.rand(16, 8, generator=gen).half()
    want = torch.bmm(w.float().unsqueeze(1), src.float()[index]).squeeze(1).half()
    assert torch.equal(gather_reduce(src, index, None, w), want)
    valid = torch.tensor([[True, False], [False, True]])
    stray = torch.tensor([[0, 7], [-3, 2]])
    out = gather_reduce(torch.randn(3, 0, generator=gen), stray, valid, None)
    assert out.shape == (2, 0)
    src = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(gather_reduce(src, stray, valid, None), src[[0, 2]], rtol=0, atol=0)
    torch.testing.assert_close(gather_reduce(src[:1], torch.tensor([[0, 5]]), valid[:1], None), src[:1], rtol=0, atol=0)
    with pytest.raises((IndexError, RuntimeError)):
        gather_reduce(src, torch.tensor([[0, 3]]), None, None)


def test_count_ids_matches_bincount():
    ids = torch.randint(0, 7, (50, 3))
    assert torch.equal(count_ids(ids, 7), torch.bincount(ids.reshape(-1), minlength=7))
    assert torch.equal(count_ids(torch.zeros(0, 2, dtype=torch.long), 3), torch.zeros(3, dtype=torch.long))


def test_count_ids_keeps_the_ids_device_and_counts_in_int64():
    """The counts live on the ids' device whatever the default device is (``meta`` here: a
    tensor made without naming its device would land there), and are int64 for int64 ids."""
    ids = torch.randint(0, 5, (40, 2))
    with torch.device("meta"):
        counts = count_ids(ids, 5)
    assert counts.device == ids.device and counts.dtype == torch.long
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=5))


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def assert_kernel_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """``assert_close_rel`` at ``dtype``'s tolerance, relative to the largest reference magnitude."""
    assert_close_rel(actual, expected, TOL[dtype], what, floor=1e-6, same_dtype=False)


# ------------------------------------------------------------------------------------------
# permute / unpermute (moeflow.kernels.permute: the differentiable ops, the torch path off CUDA)


def _plan(gen, T, E, K, cf, dtype):
    """A real dispatch plan (from ``LocalDispatcher``) for random routing."""
    skip = 1 if E > K + 1 else 0
    scores = torch.rand(T, E, generator=gen)
    if skip:
        scores[:, E - skip :] = -1  # an empty expert
    ids_TK = scores.topk(K, dim=1).indices
    weights_TK = torch.rand(T, K, generator=gen, dtype=dtype) + 0.1
    dummy = torch.zeros(T, E, dtype=dtype)
    routing = RoutingResult(weights_TK=weights_TK, ids_TK=ids_TK, logits_TE=dummy, scores_TE=dummy)
    x_TD = torch.randn(T, 5, generator=gen, dtype=dtype)
    _, plan = LocalDispatcher(num_experts=E, config=DispatchConfig(drop_policy="position")).dispatch(
        x_TD, routing, capacity_factor=cf
    )
    return plan


PLAN_CASES = {  # T, E, K, cf, D
    "dropless-K1": (37, 5, 1, 0.0, 20),
    "dropless-K8": (29, 16, 8, 0.0, 33),
    "capacity-drops": (31, 6, 2, 0.7, 17),
    "capped": (23, 8, 3, -0.6, 130),
}
PERMUTE_PARAMS = [pytest.param(*case, torch.float32, id=f"{name}-fp32") for name, case in PLAN_CASES.items()] + [
    pytest.param(*PLAN_CASES[name], torch.float64, id=f"{name}-fp64") for name in ("dropless-K8", "capacity-drops")
] + [
    pytest.param(*PLAN_CASES["capped"], dtype, id=f"capped-{str(dtype)[6:]}") for dtype in (torch.bfloat16, torch.float16)
]


@pytest.mark.parametrize("T,E,K,cf,D,dtype", PERMUTE_PARAMS)
def test_permute_unpermute_match_reference(gen, T, E, K, cf, D, dtype):
    plan = _plan(gen, T, E, K, cf, dtype)
    M = plan.assign_M.shape[0]
    index_M = torch.div(plan.assign_M, K, rounding_mode="floor")
    row_TK = plan.row_A.view(T, K)
    kept_TK = None if plan.kept_A is None else plan.kept_A.view(T, K)
    args = (index_M, plan.row_valid_M, row_TK, kept_TK)

    x_TD = torch.randn(T, D, generator=gen, dtype=dtype, requires_grad=True)
    x_MD = permute_rows(x_TD, *args)
    x_MD_ref = gather_rows_reference(x_TD, *args)
    torch.testing.assert_close(x_MD, x_MD_ref, rtol=0, atol=0)  # a copy: exact
    g_MD = torch.randn(M, D, generator=gen, dtype=dtype)
    (gx,) = torch.autograd.grad(x_MD, x_TD, g_MD)
    (gx_ref,) = torch.autograd.grad(x_MD_ref, x_TD, g_MD)
    assert_kernel_close(gx, gx_ref, dtype, "permute grad x")

    # weighted (weight_at="dispatch"): every row scaled by its assignment's router weight
    w_M = (torch.rand(M, generator=gen, dtype=torch.float32) + 0.5).to(dtype).requires_grad_(True)
    xw_MD = permute_rows(x_TD, *args, weights_M=w_M)
    xw_MD_ref = gather_rows_reference(x_TD, *args) * w_M.unsqueeze(1)
    assert_kernel_close(xw_MD, xw_MD_ref, dtype, "weighted permute")
    got = torch.autograd.grad(xw_MD, (x_TD, w_M), g_MD)
    ref = torch.autograd.grad(xw_MD_ref, (x_TD, w_M), g_MD)
    assert_kernel_close(got[0], ref[0], dtype, "weighted permute grad x")
    assert_kernel_close(got[1], ref[1], dtype, "weighted permute grad weights")

    y_MD = torch.randn(M, D, generator=gen, dtype=dtype, requires_grad=True)
    w_TK = plan.weights_TK.detach().clone().requires_grad_(True)
    uargs = (row_TK, kept_TK, w_TK, plan.assign_M, plan.row_valid_M)
    y_TD = unpermute_rows(y_MD, *uargs)
    y_TD_ref = unpermute_rows_reference(y_MD, *uargs)
    assert_kernel_close(y_TD, y_TD_ref, dtype, "unpermute")
    g_TD = torch.randn(T, D, generator=gen, dtype=dtype)
    got = torch.autograd.grad(y_TD, (y_MD, w_TK), g_TD)
    ref = torch.autograd.grad(y_TD_ref, (y_MD, w_TK), g_TD)
    assert_kernel_close(got[0], ref[0], dtype, "unpermute grad y")
    assert_kernel_close(got[1], ref[1], dtype, "unpermute grad weights")
    # without weights (weights applied at dispatch): a plain sum
    y_sum = unpermute_rows(y_MD, row_TK, kept_TK, None, plan.assign_M, plan.row_valid_M)
    assert_kernel_close(y_sum, unpermute_rows_reference(y_MD, row_TK, kept_TK, None, plan.assign_M, plan.row_valid_M), dtype, "sum")


def _moeflow_ops(fn) -> list[str]:  # type: ignore[no-untyped-def]
    """The ``moeflow::`` custom ops the profiler sees while ``fn()`` runs, nested calls included
    (a custom op whose body calls another op shows both), in call order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("moeflow::")]


@pytest.mark.parametrize("weighted", [False, True])
def test_permute_and_unpermute_are_one_op_per_call(gen, weighted):
    """Each forward call of ``permute_rows``, ``gather_rows`` and ``unpermute_rows`` is its own
    op and nothing else (it used to run a ``moeflow::gather_reduce`` inside, a second op per
    call); each backward is one gather-reduce for the rows and one gather-dot per weight
    gradient. On fresh random rows with drops, fp64: the outputs and gradients equal the
    references'."""
    plan = _plan(gen, 19, 6, 2, 0.7, torch.float64)
    T, K, M, D = 19, 2, plan.assign_M.shape[0], 7
    args = (torch.div(plan.assign_M, K, rounding_mode="floor"), plan.row_valid_M, plan.row_A.view(T, K),
            plan.kept_A.view(T, K))
    x = torch.randn(T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w_M = (torch.rand(M, generator=gen, dtype=torch.float64) + 0.5).requires_grad_(True) if weighted else None
    out: list[torch.Tensor] = []
    assert _moeflow_ops(lambda: out.append(permute_rows(x, *args, weights_M=w_M))) == ["moeflow::permute_rows"]
    g = torch.randn(M, D, generator=gen, dtype=torch.float64)
    inputs = (x,) if w_M is None else (x, w_M)
    grads: list[tuple[torch.Tensor, ...]] = []
    bwd = _moeflow_ops(lambda: grads.append(torch.autograd.grad(out[0], inputs, g)))
    assert bwd == ["moeflow::gather_reduce"] + ["moeflow::gather_dot"] * weighted, bwd
    ref = gather_rows_reference(x, *args) * (1 if w_M is None else w_M.unsqueeze(1))
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[0], torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if not weighted:
        assert _moeflow_ops(lambda: gather_rows(x, *args)) == ["moeflow::permute_rows"]

    y = torch.randn(M, D, generator=gen, dtype=torch.float64, requires_grad=True)
    w_TK = plan.weights_TK.detach().clone().requires_grad_(True) if weighted else None
    uargs = (plan.row_A.view(T, K), plan.kept_A.view(T, K), w_TK, plan.assign_M, plan.row_valid_M)
    out.clear()
    assert _moeflow_ops(lambda: out.append(unpermute_rows(y, *uargs))) == ["moeflow::unpermute_rows"]
    g = torch.randn(T, D, generator=gen, dtype=torch.float64)
    inputs = (y,) if w_TK is None else (y, w_TK)
    grads.clear()
    bwd = _moeflow_ops(lambda: grads.append(torch.autograd.grad(out[0], inputs, g)))
    assert bwd == ["moeflow::gather_reduce"] + ["moeflow::gather_dot"] * weighted, bwd
    ref = unpermute_rows_reference(y, *uargs)
    torch.testing.assert_close(out[0], ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[0], torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


_I4 = torch.arange(4)
_BAD_ROWS = [  # (function, arguments, error, the message's start: the function, the argument, the rule)
    ("permute", (torch.randn(4), _I4, None, _I4.view(4, 1), None), ValueError, "permute_rows: x_TD must be a 2-D tensor"),
    ("permute", (torch.ones(4, 3, dtype=torch.long), _I4, None, _I4.view(4, 1), None), TypeError,
     "permute_rows: x_TD must be floating point"),
    ("permute", (torch.randn(4, 3), _I4.view(2, 2), None, _I4.view(4, 1), None), ValueError, "permute_rows: index_M must be 1-D"),
    ("permute", (torch.randn(4, 3), _I4.float(), None, _I4.view(4, 1), None), TypeError,
     "permute_rows: index_M must be int32 or int64"),
    ("permute", (torch.randn(4, 3), _I4, None, _I4[:2].view(2, 1), None), ValueError, "permute_rows: rev_TK has 2 rows, x_TD has 4"),
    ("permute", (torch.randn(4, 3), _I4, None, _I4, None), ValueError, "permute_rows: rev_TK must be 2-D"),
    ("permute", (torch.randn(4, 3), _I4, None, _I4.view(4, 1).float(), None), TypeError,
     "permute_rows: rev_TK must be int32 or int64"),
    ("permute", (torch.randn(4, 3), _I4, None, _I4.view(4, 1), None, torch.rand(3)), ValueError,
     "permute_rows: weights_M shape"),
    ("unpermute", (torch.randn(4), _I4.view(2, 2), None, None, _I4, None), ValueError,
     "unpermute_rows: y_MD must be a 2-D tensor"),
    ("unpermute", (torch.ones(4, 3, dtype=torch.long), _I4.view(2, 2), None, None, _I4, None), TypeError,
     "unpermute_rows: y_MD must be floating point"),
    ("unpermute", (torch.randn(4, 3), _I4, None, None, _I4, None), ValueError, "unpermute_rows: row_TK must be 2-D"),
    ("unpermute", (torch.randn(4, 3), _I4.view(2, 2).float(), None, None, _I4, None), TypeError,
     "unpermute_rows: row_TK must be int32 or int64"),
    ("unpermute", (torch.randn(4, 3), _I4.view(2, 2), None, None, _I4.view(4, 1), None), ValueError,
     "unpermute_rows: assign_M must be 1-D"),
    ("unpermute", (torch.randn(4, 3), _I4.view(2, 2), None, None, _I4.float(), None), TypeError,
     "unpermute_rows: assign_M must be int32 or int64"),
    ("unpermute", (torch.randn(4, 3), _I4.view(2, 2), None, None, _I4[:3], None), ValueError,
     "unpermute_rows: assign_M has 3 entries, y_MD has 4 rows"),
    ("unpermute", (torch.randn(4, 3), _I4.view(2, 2), None, torch.rand(4, 1), _I4, None), ValueError,
     "unpermute_rows: weights_TK shape (4, 1) != row_TK shape (2, 2)"),
]


@pytest.mark.parametrize("case", range(len(_BAD_ROWS)))
def test_permute_and_unpermute_name_the_bad_argument(case):
    """Each check of the two row kernels' arguments, one at a time: the error names the
    function, the argument and the rule (the message's start, matched literally)."""
    fn, args, error, message = _BAD_ROWS[case]
    with pytest.raises(error, match="^" + re.escape(message)):
        (permute_rows if fn == "permute" else unpermute_rows)(*args)


def test_the_triton_kernels_import_nothing_from_the_ops_above_them():
    """``moeflow.kernels.triton`` sits below the ops that run its kernels (``kernels/permute.py``
    reaches the launchers through the package's lazy names): no module of it imports a
    ``moeflow`` module outside the package, at module level or inside a function, so the
    imports point one way and no circle can form."""
    import ast
    from pathlib import Path

    import moeflow.kernels.triton as triton_package

    for path in sorted(Path(triton_package.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            outside = [n for n in names if n.startswith("moeflow") and not n.startswith("moeflow.kernels.triton")]
            assert not outside, f"{path.name}:{node.lineno} imports {outside}"
