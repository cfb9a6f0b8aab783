"""The torch kernels (``moeflow.kernels``: grouped GEMM backends, row gathers, id counts) against
their references: outputs and gradients, odd shapes, empty groups. The Triton kernels:
``test_kernels_triton.py``."""

from __future__ import annotations

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
from moeflow.kernels.counts import count_ids

from helpers import random_counts

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


def test_grouped_mm_native_accepts_expanded_gradient(gen):
    if not native_grouped_mm_supported(torch.device("cpu"), torch.float32):
        pytest.skip("F.grouped_mm not available here")
    x = torch.randn(10, 4, generator=gen, requires_grad=True)
    w = torch.randn(2, 4, 8, generator=gen, requires_grad=True)
    GROUPED_MM_BACKENDS["grouped_mm"](x, w, torch.tensor([4, 10])).sum().backward()  # stride-0 grad
    torch.testing.assert_close(x.grad[:4], w.detach()[0].sum(1).expand(4, 4))


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


def test_count_ids_matches_bincount():
    ids = torch.randint(0, 7, (50, 3))
    assert torch.equal(count_ids(ids, 7), torch.bincount(ids.reshape(-1), minlength=7))
    assert torch.equal(count_ids(torch.zeros(0, 2, dtype=torch.long), 3), torch.zeros(3, dtype=torch.long))
