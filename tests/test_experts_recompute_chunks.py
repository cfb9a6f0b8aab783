"""Expert recompute over expert chunks (``moeflow.experts.lean._RecomputeFFN``): the gradients do
not depend on the chunking (bit for bit in fp64, against the default path), the chunks partition
the experts and rows, the peak memory falls with the chunk size, and the private copy of the
input rows that backward overwrites with ``dx`` keeps a second backward loud."""

from __future__ import annotations

import zlib

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moeflow.bench.memory import peak_memory_bytes
from moeflow.experts.lean import (
    _expert_chunks,
    ffn_reference,
    lean_ffn,
)
from moeflow.kernels.activation import ACTIVATIONS

from helpers import ffn_operands

pytestmark = pytest.mark.reference


def _operands(gen, gemm, activation, dtype):
    """Every expert 1+ rows but expert 2 (an empty group inside a chunk); int32 offsets for
    ``grouped_mm``."""
    x, w_in, w_out, offs = ffn_operands(gen, gemm, activation, dtype, E=6, C=9, min_rows=1, empty=2)
    return x, w_in, w_out, offs.to(torch.int32) if gemm == "grouped_mm" else offs


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gemm", ["bmm", "loop"])
def test_chunked_recompute_equals_the_default_path_bit_for_bit_fp64(activation, gemm):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{activation}-{gemm}".encode()))
    x, w_in, w_out, offs = _operands(gen, gemm, activation, torch.float64)
    x_before = x.detach().clone()
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y0 = lean_ffn(x, w_in, w_out, offs, activation=activation, gemm=gemm)
    want = torch.autograd.grad(y0, [x, w_in, w_out], grad)
    for chunks in (1, 2, 4, 6, 50):
        y = lean_ffn(x, w_in, w_out, offs, activation=activation, gemm=gemm, recompute=True, chunks=chunks)
        got = torch.autograd.grad(y, [x, w_in, w_out], grad)
        assert torch.equal(y, y0), chunks
        for name, g, w in zip(("x", "w_in", "w_out"), got, want):
            assert torch.equal(g, w), (chunks, name)
    assert torch.equal(x.detach(), x_before)  # the caller's rows are never overwritten


@pytest.mark.parametrize("activation", ["swiglu", "relu"])
def test_chunked_recompute_grouped_mm_matches_reference(activation):
    gen = torch.Generator().manual_seed(11)
    x, w_in, w_out, offs = _operands(gen, "grouped_mm", activation, torch.float32)
    x_before = x.detach().clone()
    grad = torch.randn(x.shape, generator=gen)
    y_ref = ffn_reference(x, w_in, w_out, offs.long(), activation=activation)
    want = torch.autograd.grad(y_ref, [x, w_in, w_out], grad)
    y = lean_ffn(x, w_in, w_out, offs, activation=activation, gemm="grouped_mm", recompute=True, chunks=3)
    got = torch.autograd.grad(y, [x, w_in, w_out], grad)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert torch.equal(x.detach(), x_before)


def test_only_the_weights_or_only_the_input_get_gradients():
    gen = torch.Generator().manual_seed(5)
    x, w_in, w_out, _ = _operands(gen, "bmm", "swiglu", torch.float64)
    grad = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y0 = lean_ffn(x, w_in, w_out, None, activation="swiglu", gemm="bmm")
    gx, gw_out = torch.autograd.grad(y0, [x, w_out], grad)
    y = lean_ffn(x.detach(), w_in.detach(), w_out, None, activation="swiglu", gemm="bmm", recompute=True, chunks=3)
    (got_w_out,) = torch.autograd.grad(y, [w_out], grad)
    assert torch.equal(got_w_out, gw_out)
    x_before = x.detach().clone()
    y = lean_ffn(x, w_in.detach(), w_out.detach(), None, activation="swiglu", gemm="bmm", recompute=True, chunks=3)
    (got_x,) = torch.autograd.grad(y, [x], grad)
    assert torch.equal(got_x, gx)
    assert torch.equal(x.detach(), x_before)  # dx went over the private copy, not over x


@pytest.mark.parametrize("frozen", ["x", "w_in", "w_out"])
def test_the_two_node_backward_skips_the_work_a_frozen_operand_needs(frozen, monkeypatch):
    """Without recompute (two autograd nodes): a frozen ``x`` costs no ``dx`` GEMM, a frozen
    ``w_out`` no ``act(h)`` recompute in backward; the others still get the reference's
    gradients (``x`` with ``w_in`` frozen too: its gradient must not hang on ``w_in``'s flag)."""
    import moeflow.experts.lean as lean

    x, w_in, w_out, _ = ffn_operands(torch.Generator().manual_seed(7), "bmm", "swiglu", torch.float64, E=3, C=4)
    ops = {"x": x, "w_in": w_in, "w_out": w_out}
    ops[frozen] = ops[frozen].detach()
    if frozen == "w_out":
        ops["w_in"] = ops["w_in"].detach()  # x alone needs its gradient
    y = lean_ffn(ops["x"], ops["w_in"], ops["w_out"], None, activation="swiglu", gemm="bmm")
    calls = {"_mm": 0, "_activate": 0}
    for name in calls:
        real = getattr(lean, name)
        monkeypatch.setattr(lean, name, lambda *a, _r=real, _n=name: (calls.__setitem__(_n, calls[_n] + 1), _r(*a))[1])
    trained = [k for k, t in ops.items() if t.requires_grad]
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    got = torch.autograd.grad(y, [ops[k] for k in trained], dy)
    ref = ffn_reference(ops["x"], ops["w_in"], ops["w_out"], None, activation="swiglu")
    want = torch.autograd.grad(ref, [ops[k] for k in trained], dy)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    if frozen == "x":
        assert calls["_mm"] == 1  # da only: no dx = dh W_in^T
    if frozen == "w_out":
        assert calls["_activate"] == 0


@pytest.mark.parametrize("gemm", ["bmm", "loop"])
@pytest.mark.parametrize("frozen", ["w_in", "w_out"])
def test_a_frozen_weight_gets_no_gradient_buffer(gemm, frozen):
    """The recompute backward allocates a weight's gradient only when the weight needs one: with
    one weight frozen its peak stays below the other's gradient plus half the frozen weight's
    bytes (weights much larger than the activations here)."""
    from moeflow.bench.memory import LiveTensorBytes

    x, w_in, w_out, offs = ffn_operands(torch.Generator().manual_seed(6), gemm, "swiglu", torch.float64,
                                        E=8, C=3, D=64, H=64)
    weights = {"w_in": w_in, "w_out": w_out}
    weights[frozen] = weights[frozen].detach()
    (trained,) = [w for w in weights.values() if w.requires_grad]
    y = lean_ffn(x, weights["w_in"], weights["w_out"], offs, activation="swiglu", gemm=gemm, recompute=True)
    with LiveTensorBytes() as mem:
        torch.autograd.grad(y, [x, trained], torch.ones_like(y))
    frozen_bytes = weights[frozen].numel() * weights[frozen].element_size()
    assert mem.peak < trained.numel() * trained.element_size() + frozen_bytes // 2, mem.peak


def test_the_layer_picks_its_chunks_from_the_width_of_h_and_copies_x_only_for_dx():
    """Through ``lean_ffn`` (the Function's ctx is ``y.grad_fn``): with ``chunks`` None the
    count follows the bytes of ``h`` (``[rows, F]``: 2 MiB here, two chunks; ``D`` in place of
    ``F`` would make one), and the rows backward overwrites with ``dx`` are a private contiguous
    copy when ``x`` needs a gradient, ``x`` itself (no copy) when it does not; the caller's
    ``x`` is never written."""
    gen = torch.Generator().manual_seed(13)
    E, D, H, R = 4, 64, 128, 2048  # F = 2H = 256: h is R * F * 4 bytes = 2 MiB
    offs = torch.tensor([512, 1024, 1536, 2048])
    x = torch.randn(D, R, generator=gen).t().requires_grad_()  # not contiguous
    w_in, w_out = torch.randn(E, D, 2 * H, generator=gen), torch.randn(E, H, D, generator=gen).requires_grad_()
    x_before = x.detach().clone()
    y = lean_ffn(x, w_in, w_out, offs, activation="swiglu", gemm="loop", recompute=True)
    assert len(y.grad_fn.bounds) == 2
    rows = y.grad_fn.saved_tensors[0]
    assert rows.is_contiguous() and rows.data_ptr() != x.data_ptr()
    y.backward(torch.randn(y.shape, generator=gen))
    assert torch.equal(x.detach(), x_before)
    x_frozen = x.detach()
    y = lean_ffn(x_frozen, w_in, w_out, offs, activation="swiglu", gemm="loop", recompute=True)
    assert y.grad_fn.saved_tensors[0].data_ptr() == x_frozen.data_ptr()


@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=12), chunks=st.integers(1, 15))
def test_expert_chunks_partition_experts_and_rows(counts, chunks):
    offs = torch.tensor(counts).cumsum(0)
    x = torch.empty(int(offs[-1]), 4)
    bounds = _expert_chunks(x, offs, len(counts), 8, "loop", chunks)
    assert 1 <= len(bounds) <= min(chunks, len(counts))
    ends = [0] + offs.tolist()
    assert bounds[0][:3:2] == (0, 0) and bounds[-1][1] == len(counts)
    for (e0, e1, r0, r1), nxt in zip(bounds, bounds[1:] + [None]):
        assert e0 < e1 and (r0, r1) == (ends[e0], ends[e1])
        if nxt is not None:
            assert nxt[0] == e1
    E = len(counts)
    padded = _expert_chunks(torch.empty(E, 5, 4), None, E, 8, "bmm", chunks)
    assert len(padded) == min(chunks, E)  # equal rows per expert: every chunk gets experts
    assert [(r0, r1) for _, _, r0, r1 in padded] == [(5 * e0, 5 * e1) for e0, e1, _, _ in padded]
    assert padded[0][0] == 0 and padded[-1][1] == E and all(a[1] == b[0] for a, b in itertools.pairwise(padded))
    sizes = [e1 - e0 for e0, e1, _, _ in padded]
    assert max(sizes) - min(sizes) <= 1


def test_chunk_count_follows_the_size_of_h():
    E, D, F = 16, 4, 4096  # h: rows * 4096 fp32 = 16 KiB per row
    assert len(_expert_chunks(torch.empty(E, 2, D), None, E, F, "bmm", None)) == 1  # 512 KiB
    assert len(_expert_chunks(torch.empty(E, 16, D), None, E, F, "bmm", None)) == 4  # 4 MiB: 1 MiB each
    assert len(_expert_chunks(torch.empty(E, 512, D), None, E, F, "bmm", None)) == 8  # 128 MiB: 16 MiB each
    assert len(_expert_chunks(torch.empty(E, 2048, D), None, E, F, "bmm", None)) == 16  # 512 MiB: one expert each


def test_recompute_peak_falls_with_the_chunk_size():
    """fp32, E=8: the default path's peak holds the whole h (4 MiB); recompute in one chunk
    holds it in backward too (with, by design, its copy of the rows and dW_in allocated before
    the chunks); in 8 chunks only one expert's h and temporaries at a time, and dx is written
    over the saved copy of the rows (no [rows, D] gradient allocated)."""
    torch.manual_seed(0)
    E, C, D, H = 8, 256, 64, 256
    w_in = torch.randn(E, D, 2 * H).requires_grad_()
    w_out = torch.randn(E, H, D).requires_grad_()
    x, grad = torch.randn(E, C, D), torch.randn(E, C, D)

    def peak(**kw):
        def once():
            lean_ffn(x.detach().requires_grad_(), w_in, w_out, None, activation="swiglu", gemm="bmm", **kw).backward(grad)
        w_in.grad = w_out.grad = None
        return peak_memory_bytes(once, torch.device("cpu"))

    row = 4 * E * C  # bytes of one fp32 column over all rows
    grads, h, x_bytes = 4 * 3 * E * D * H, row * 2 * H, row * D
    default, one, eight = peak(), peak(recompute=True, chunks=1), peak(recompute=True, chunks=8)
    assert eight < one <= default + x_bytes + 4 * E * D * 2 * H
    # gradients + the rows' copy (then dx) + the output + one expert's h, act(gate), a or da
    assert eight <= grads + 2 * x_bytes + (h + 2 * row * H) // E
    assert default >= grads + h + 2 * x_bytes


def test_second_backward_through_chunked_recompute_fails_loudly():
    w_in = torch.randn(4, 8, 16, requires_grad=True)
    w_out = torch.randn(4, 8, 8, requires_grad=True)
    x = torch.randn(4, 3, 8, requires_grad=True)
    y = lean_ffn(x, w_in, w_out, None, activation="swiglu", gemm="bmm", recompute=True, chunks=2).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("chunks", [0, -1, 1.5, True])
def test_chunks_validate(chunks):
    with pytest.raises(ValueError, match="chunks"):
        lean_ffn(torch.randn(2, 3, 4), torch.randn(2, 4, 8), torch.randn(2, 4, 4), None, activation="swiglu",
                 gemm="bmm", recompute=True, chunks=chunks)


@pytest.mark.parametrize("gemm", ["loop", "grouped_mm"])
def test_chunked_recompute_with_transposed_weight_views(gemm):
    """Hugging Face layouts: ``w_in``/``w_out`` are transposes of ``[E, F, D]``/``[E, D, H]``
    parameters; the chunked gradients land in those strides and match the reference."""
    gen = torch.Generator().manual_seed(21)
    dtype = torch.float64 if gemm == "loop" else torch.float32
    E, D, H = 5, 8, 12
    w_in_base = torch.randn(E, 2 * H, D, generator=gen, dtype=dtype).requires_grad_()
    w_out_base = torch.randn(E, D, H, generator=gen, dtype=dtype).requires_grad_()
    counts = torch.tensor([3, 0, 7, 4, 6])
    offs = counts.cumsum(0)
    x = torch.randn(int(offs[-1]), D, generator=gen, dtype=dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=gen, dtype=dtype)
    leaves = [x, w_in_base, w_out_base]
    w_in, w_out = w_in_base.transpose(1, 2), w_out_base.transpose(1, 2)
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, offs, activation="swiglu"), leaves, grad)
    lean_offs = offs.to(torch.int32) if gemm == "grouped_mm" else offs
    y = lean_ffn(x, w_in, w_out, lean_offs, activation="swiglu", gemm=gemm, recompute=True, chunks=2)
    got = torch.autograd.grad(y, leaves, grad)
    tol = 1e-11 if dtype == torch.float64 else 1e-4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_recompute_chunks_is_a_config_setting_that_does_not_change_the_gradients(monkeypatch) -> None:
    """``ExpertsConfig(recompute_chunks=n)`` reaches the lean FFN in both layouts: one chunk and
    the automatic count give the same output and gradients (fp64, bit for bit); a count without
    recompute, or below 1, is refused naming the field."""
    import dataclasses

    from moeflow.config import ExpertsConfig
    from moeflow.experts import GroupedExperts

    with pytest.raises(ValueError, match="recompute_chunks=2 applies with recompute=True"):
        ExpertsConfig(recompute_chunks=2)
    with pytest.raises(ValueError, match="recompute_chunks must be >= 1, got 0"):
        ExpertsConfig(recompute=True, recompute_chunks=0)
    with pytest.raises(TypeError, match="recompute_chunks must be an int or None, got True"):
        ExpertsConfig(recompute=True, recompute_chunks=True)
    gen = torch.Generator().manual_seed(5)
    auto = GroupedExperts(num_experts=6, dim=8, hidden=12, config=ExpertsConfig(recompute=True, backend="loop"),
                          dtype=torch.float64)
    one = GroupedExperts(num_experts=6, dim=8, hidden=12, dtype=torch.float64,
                         config=dataclasses.replace(auto.config, recompute_chunks=1))
    one.load_state_dict(auto.state_dict())
    counts = torch.tensor([3, 0, 5, 2, 7, 1])
    import moeflow.experts.ffn as ffn

    seen: list = []

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.get("chunks"))
        return lean_ffn(*args, **kw)

    monkeypatch.setattr(ffn, "lean_ffn", spy)
    for x in (torch.randn(6, 4, 8, generator=gen, dtype=torch.float64), torch.randn(18, 8, generator=gen, dtype=torch.float64)):
        grads = []
        for module in (auto, one):
            xi = x.clone().requires_grad_()
            y = module(xi, counts if x.dim() == 2 else torch.full((6,), 4))
            y.backward(torch.ones_like(y))
            grads.append((y.detach(), xi.grad, *(p.grad.clone() for p in module.parameters())))
            module.zero_grad(set_to_none=True)
        for a, b in zip(*grads, strict=True):
            assert torch.equal(a, b)
    assert seen == [None, 1, None, 1]  # both layouts pass the setting on


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
def test_chunks_of_experts_without_rows_compute_nothing_and_get_zero_gradients(gemm, monkeypatch) -> None:
    """All rows on expert 0 and 8 chunks: the later chunks own no rows; they run no GEMM (a
    0-row grouped GEMM is avoidable work and not every backend takes one) and their experts'
    weight gradients are zeros, as in the reference (fp64; fp32 for grouped_mm)."""
    gen = torch.Generator().manual_seed(11)
    dt, tol = (torch.float32, 1e-5) if gemm == "grouped_mm" else (torch.float64, 1e-12)  # grouped_mm: no fp64
    E, D, H = 8, 8, 8
    counts = torch.zeros(E, dtype=torch.long)
    counts[0] = 10
    offs = counts.cumsum(0)
    offs = offs.to(torch.int32) if gemm == "grouped_mm" else offs
    x = torch.randn(10, D, generator=gen, dtype=dt, requires_grad=True)
    w_in = torch.randn(E, D, 2 * H, generator=gen, dtype=dt, requires_grad=True)
    w_out = torch.randn(E, H, D, generator=gen, dtype=dt, requires_grad=True)
    from moeflow.experts.lean import _expert_chunks

    assert any(r0 == r1 for _, _, r0, r1 in _expert_chunks(x, offs, E, 2 * H, gemm, 8))
    import moeflow.experts.lean as lean

    def no_empty(gemm_, a, *rest):  # type: ignore[no-untyped-def]
        assert a.shape[0] > 0, "a GEMM over 0 rows"
        return mm(gemm_, a, *rest)

    mm = lean._mm
    monkeypatch.setattr(lean, "_mm", no_empty)
    y = lean_ffn(x, w_in, w_out, offs, activation="swiglu", gemm=gemm, recompute=True, chunks=8)
    dy = torch.randn(y.shape, generator=gen, dtype=dt)
    got = torch.autograd.grad(y, (x, w_in, w_out), dy)
    ref_y = ffn_reference(x, w_in, w_out, offs.long(), activation="swiglu")
    want = torch.autograd.grad(ref_y, (x, w_in, w_out), dy)
    torch.testing.assert_close(y, ref_y, rtol=tol, atol=tol)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    assert torch.equal(got[1][1:], torch.zeros_like(got[1][1:])) and torch.equal(got[2][1:], torch.zeros_like(got[2][1:]))


@pytest.mark.parametrize("gemm", ["grouped_mm", "loop"])
def test_chunks_without_rows_leave_an_existing_grad_and_a_frozen_weight_alone(gemm) -> None:
    """Experts 1.. own no rows (chunks of their own). A later micro-batch adds into ``.grad``: their
    part of it stays as the earlier micro-batches left it (not zeroed); and with ``w_in`` frozen
    its gradient is not made at all (``w_out``'s is the reference's)."""
    gen = torch.Generator().manual_seed(12)
    dt, tol = (torch.float32, 1e-5) if gemm == "grouped_mm" else (torch.float64, 1e-12)
    E, D, H = 4, 8, 8
    offs = torch.tensor([10, 10, 10, 10])
    offs = offs.to(torch.int32) if gemm == "grouped_mm" else offs
    x = torch.randn(10, D, generator=gen, dtype=dt)
    w_in = torch.randn(E, D, 2 * H, generator=gen, dtype=dt, requires_grad=True)
    w_out = torch.randn(E, H, D, generator=gen, dtype=dt, requires_grad=True)
    before = [torch.randn(w.shape, generator=gen, dtype=dt) for w in (w_in, w_out)]
    w_in.grad, w_out.grad = before[0].clone(), before[1].clone()  # as earlier micro-batches left them
    dy = torch.randn(10, D, generator=gen, dtype=dt)
    lean_ffn(x, w_in, w_out, offs, activation="swiglu", gemm=gemm, recompute=True, chunks=E).backward(dy)
    want = torch.autograd.grad(ffn_reference(x, w_in, w_out, offs.long(), activation="swiglu"), (w_in, w_out), dy)
    for w, b, g in zip((w_in, w_out), before, want):
        torch.testing.assert_close(w.grad, b + g, rtol=tol, atol=tol)
        assert torch.equal(w.grad[1:], b[1:])
    frozen = w_in.detach()
    y = lean_ffn(x, frozen, w_out, offs, activation="swiglu", gemm=gemm, recompute=True, chunks=E)
    (got,) = torch.autograd.grad(y, [w_out], dy)
    torch.testing.assert_close(got, want[1], rtol=tol, atol=tol)


def test_turning_recompute_off_drops_the_chunk_count() -> None:
    """``recompute_chunks`` applies with recompute only: switching recompute off on a module
    (the ``recompute`` setter) or a layer (``MoE(expert_recompute=False)``) drops it instead of
    raising; switching it back on keeps a count that was set."""
    import dataclasses

    from moeflow import MoE, MoEConfig
    from moeflow.config import ExpertsConfig
    from moeflow.experts import GroupedExperts

    experts = GroupedExperts(num_experts=4, dim=8, hidden=8, config=ExpertsConfig(recompute=True, recompute_chunks=2))
    experts.recompute = True
    assert experts.config.recompute_chunks == 2
    experts.recompute = False
    assert (experts.config.recompute, experts.config.recompute_chunks) == (False, None)
    cfg = MoEConfig(dim=8, hidden=8, num_experts=4, top_k=2)
    cfg = dataclasses.replace(cfg, experts=ExpertsConfig(recompute=True, recompute_chunks=3))
    assert MoE(config=cfg, expert_recompute=False).config.experts.recompute_chunks is None
    assert MoE(config=cfg, expert_recompute=True).config.experts.recompute_chunks == 3
