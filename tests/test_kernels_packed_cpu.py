"""The CPU's few-row grouped product over packed weights (``moeflow.kernels.packed_cpu``): equal
to the reference ``grouped_mm_loop`` on fresh random inputs (odd sizes, partial strips, empty
experts, rows past the counts, one and two threads, strided weights); found by the experts'
no-grad products only inside ``packs_in_use`` and only for the weights as they were packed;
never on a path that records gradients; and the compiled decoder's ``ExpertPacks`` pack each
layer once and again only after a change."""

from __future__ import annotations

import pytest
import torch

import moeflow.experts.lean as lean
import moeflow.kernels.packed_cpu as packed_cpu
from moeflow.experts.ffn import grouped_ffn
from moeflow.kernels.grouped_mm import grouped_mm_loop
from moeflow.kernels.packed_cpu import (MAX_ROWS_PER_EXPERT, STRIP, PackedExperts, pack_weight, packed_grouped_mm,
                                        packs_for, packs_in_use)
from moeflow.models.compiled_decode import ExpertPacks

from helpers import random_counts, small_gpt

# only a missing compiler skips: where one is, a kernel that does not build fails these tests
needs_compiler = pytest.mark.skipif(packed_cpu._compiler() is None, reason="no C++ compiler on the PATH")


def _case(seed: int, E: int, K: int, N: int, R: int, empty: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(R, K, generator=gen), torch.randn(E, K, N, generator=gen),
            random_counts(gen, E, R, empty) if R else torch.zeros(E, dtype=torch.long))


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("E, K, N, R, empty", [
    (8, 64, 256, 16, 0),  # a decode step's shape: ~2 rows per expert, whole strips
    (3, 17, 37, 11, 1),  # odd K, a partial last strip, an empty expert
    (2, 5, 9, 20, 0),    # one partial strip only; 10 rows per expert: register blocks of 6 and 4
    (1, 33, 16, 7, 0),   # one expert
    (4, 8, 48, 3, 2),    # fewer rows than experts
])
@pytest.mark.parametrize("threads", [1, 2])
def test_packed_product_equals_the_reference(E, K, N, R, empty, threads):
    x_RK, w_EKN, counts_E = _case(E * 1000 + K * 10 + N + R, E, K, N, R, empty)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y_RN = packed_grouped_mm(x_RK, pack_weight(w_EKN), counts_E, N)
    finally:
        torch.set_num_threads(before)
    ref_RN = grouped_mm_loop(x_RK.double(), w_EKN.double(), counts_E.cumsum(0))
    assert y_RN.shape == (R, N) and y_RN.dtype == torch.float32
    torch.testing.assert_close(y_RN.double(), ref_RN, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.reference
def test_packed_product_of_strided_weights_int32_counts_and_rows_past_the_counts():
    """A weight given as the transpose of an ``[E, N, K]`` tensor packs the same; int32 counts
    work; rows past ``counts.sum()`` come out as zeros (never uninitialised memory); no rows and
    no columns give empty outputs."""
    gen = torch.Generator().manual_seed(3)
    w_ENK = torch.randn(3, 40, 24, generator=gen)
    x_RK = torch.randn(9, 24, generator=gen)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    y = packed_grouped_mm(x_RK, pack_weight(w_ENK.transpose(1, 2)), counts, 40)
    ref = grouped_mm_loop(x_RK[:6], w_ENK.transpose(1, 2), counts.long().cumsum(0))
    torch.testing.assert_close(y[:6], ref[:6], rtol=1e-5, atol=1e-5)
    assert torch.equal(y[6:], torch.zeros(3, 40))
    assert packed_grouped_mm(x_RK[:0], pack_weight(w_ENK.transpose(1, 2)), counts * 0, 40).shape == (0, 40)


@pytest.mark.unit
def test_pack_layout_and_bad_input():
    """``pack_weight`` puts column ``16 s + j`` of row ``k`` at ``[e, s, k, j]`` (zeros past N);
    bad weights, packs, counts and column counts are refused by name."""
    w = torch.arange(2 * 3 * 20, dtype=torch.float32).reshape(2, 3, 20)
    p = pack_weight(w)
    assert p.shape == (2, 2, 3, STRIP) and p.is_contiguous()
    assert p[1, 1, 2, 3] == w[1, 2, 16 + 3] and p[0, 0, 1, 15] == w[0, 1, 15]
    assert torch.equal(p[:, 1, :, 4:], torch.zeros(2, 3, 12))
    assert pack_weight(w * 2, out=p) is p and p[1, 1, 2, 3] == 2 * w[1, 2, 16 + 3]
    with pytest.raises(ValueError, match="w_EKN"):
        pack_weight(w.double())
    with pytest.raises(ValueError, match="w_EKN"):
        pack_weight(w[0])
    with pytest.raises(ValueError, match="out"):
        pack_weight(w, out=torch.empty(2, 2, 3, 8))
    x = torch.randn(4, 3)
    counts = torch.tensor([1, 3])
    with pytest.raises(ValueError, match="x_RK"):
        packed_grouped_mm(x.double(), p, counts, 20)
    with pytest.raises(ValueError, match="w_ESKP"):
        packed_grouped_mm(torch.randn(4, 5), p, counts, 20)
    with pytest.raises(ValueError, match="w_ESKP"):  # (a pointer the kernel must never be given)
        packed_grouped_mm(x, p.to("meta"), counts, 20)
    with pytest.raises(ValueError, match="n must"):
        packed_grouped_mm(x, p, counts, 33)
    with pytest.raises(ValueError, match="n must"):
        packed_grouped_mm(x, p, counts, 16)
    with pytest.raises(ValueError, match="counts_E"):
        packed_grouped_mm(x, p, counts.float(), 20)
    with pytest.raises(ValueError, match="counts_E"):
        packed_grouped_mm(x, p, torch.tensor([4]), 20)


def _weights(seed: int = 0, E: int = 4, D: int = 16, H: int = 24):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(E, D, 2 * H, generator=gen) * 0.2, torch.randn(E, H, D, generator=gen) * 0.2


@pytest.mark.unit
def test_packs_are_found_only_inside_the_block_for_the_weights_as_packed():
    """``packs_for``: None outside ``packs_in_use``, for other weights, for more than
    ``MAX_ROWS_PER_EXPERT`` rows per expert, for a view with other strides, and once a weight
    changed in place after packing (its version moved); the block restores what was there before."""
    w_in, w_out = _weights()
    packs = PackedExperts.of(w_in, w_out)
    assert packs_for(w_in, w_out, 8) is None
    with packs_in_use([packs]):
        found = packs_for(w_in, w_out, 8)
        assert found is not None and found[0] is packs.packed_in and found[1] is packs.packed_out
        assert packs_for(w_in, w_out, MAX_ROWS_PER_EXPERT * 4) is not None
        assert packs_for(w_in, w_out, MAX_ROWS_PER_EXPERT * 4 + 1) is None
        other_in, other_out = _weights(1)
        assert packs_for(other_in, w_out, 8) is None and packs_for(other_in, other_out, 8) is None
        assert packs_for(w_in.as_strided(w_in.shape, (1, 4 * 48, 4)), w_out, 8) is None
        with packs_in_use([]):
            assert packs_for(w_in, w_out, 8) is None
        assert packs_for(w_in, w_out, 8) is not None
        w_out.mul_(1.0)  # an in-place change: the pack no longer matches
        assert packs_for(w_in, w_out, 8) is None
    assert packs_for(w_in, w_out, 8) is None
    stale = PackedExperts.of(w_in, w_out)
    w_in.add_(1.0)  # changed after packing, before the block: refused too
    with packs_in_use([stale]):
        assert packs_for(w_in, w_out, 8) is None


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_no_grad_ffn_runs_the_packed_kernel_inside_the_block_and_equals_the_lean_path(activation, monkeypatch):
    """Inside ``packs_in_use`` the experts' no-grad FFN goes through ``packed_grouped_mm`` (twice:
    both products) and equals the same FFN outside the block up to rounding; a call that
    records gradients takes the lean autograd path there, with the same gradients as outside."""
    gen = torch.Generator().manual_seed(5)
    E, D, H = 4, 16, 24
    w_in = torch.randn(E, D, 2 * H if activation == "swiglu" else H, generator=gen) * 0.2
    w_out = torch.randn(E, H, D, generator=gen) * 0.2
    x = torch.randn(10, D, generator=gen)
    counts = random_counts(gen, E, 10, 1)
    calls = []
    real = lean.packed_grouped_mm
    monkeypatch.setattr(lean, "packed_grouped_mm", lambda *a: calls.append(a[1].shape) or real(*a))
    with torch.no_grad():
        outside = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="grouped_mm")
        assert calls == []
        with packs_in_use([PackedExperts.of(w_in, w_out)]):
            inside = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="grouped_mm")
    assert len(calls) == 2
    torch.testing.assert_close(inside, outside, rtol=1e-5, atol=1e-6)

    grads = []
    for packed in (False, True):
        wi, wo, xr = (t.clone().requires_grad_() for t in (w_in, w_out, x))
        with packs_in_use([PackedExperts.of(wi, wo)] if packed else []):
            y = grouped_ffn(xr, counts, wi, wo, activation=activation, backend="grouped_mm")
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(9)))
        grads.append((y.detach(), xr.grad, wi.grad, wo.grad))
    assert len(calls) == 2  # the gradient-recording calls never reached the kernel
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_compiler
@pytest.mark.reference
def test_expert_packs_repack_every_generation_into_the_same_memory(monkeypatch):
    """``ExpertPacks.refresh`` packs every MoE layer's experts from the weights as they are, each
    time, into the packs it made before: after a write through ``.data`` (no version moves) and an
    in-place change the packs equal the new weights; a replaced parameter of the same shape
    reuses the memory; a layer cast to bf16 is dropped; inference tensors (no version counter)
    pack and are found; ``clear`` drops every pack."""
    torch.manual_seed(0)
    model = small_gpt(n_layers=4)  # MoE on blocks 1 and 3
    layers = [m.experts for m in model.modules() if hasattr(m, "experts")]
    packs = ExpertPacks()
    packs.refresh(model)
    assert sorted(packs.packs) == [0, 1]
    first = packs.packs[1].packed_in
    with torch.no_grad():
        layers[1].w_in.data.mul_(-1.0)  # an EMA-style write: the version does not move
        layers[1].w_out.add_(0.5)
    packs.refresh(model)
    assert packs.packs[1].packed_in is first
    assert torch.equal(packs.packs[1].packed_in, pack_weight(layers[1].w_in.detach()))
    assert torch.equal(packs.packs[1].packed_out, pack_weight(layers[1].w_out.detach()))
    layers[1].w_in = torch.nn.Parameter(layers[1].w_in.detach().clone())
    packs.refresh(model)
    assert packs.packs[1].packed_in is first and packs.packs[1].matches(layers[1].w_in, layers[1].w_out)
    layers[0].to(torch.bfloat16)
    packs.refresh(model)
    assert sorted(packs.packs) == [1]
    packs.clear()
    assert packs.packs == {}

    with torch.inference_mode():
        frozen = small_gpt(n_layers=2)
        packs.refresh(frozen)
        experts = [m.experts for m in frozen.modules() if hasattr(m, "experts")][0]
        with packs.in_use():
            assert packs_for(experts.w_in, experts.w_out, 4) is not None


@needs_compiler
@pytest.mark.e2e
def test_expert_products_bench_reports_both_candidates_on_the_same_outputs(tmp_path, capsys):
    """A tiny run of bench/expert_products.py: a row per batch size with both candidates' times,
    the weights read, and outputs that agree; bad flags are refused by name."""
    import json

    from bench.expert_products import main as bench_main

    out = tmp_path / "products.json"
    threads = torch.get_num_threads()
    assert bench_main(["--dim", "16", "--hidden", "24", "--experts", "4", "--layers", "2", "--batch-sizes", "1,3",
                       "--repeats", "2", "--threads", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["results"]] == [1, 3] and report["threads"] == 1
    for r in report["results"]:
        assert sum(r["counts"]) == r["rows"] == 2 * r["batch"]
        assert r["grouped_mm_us"] > 0 and r["packed_us"] > 0 and r["max_abs_diff"] < 1e-5 and r["packed_kernel_ran"]
        assert r["weights_read_MiB"] == sum(c > 0 for c in r["counts"]) * (16 * 48 + 24 * 16) * 4 / 2**20
    assert "ratio" in capsys.readouterr().out and torch.get_num_threads() == threads  # restored
    with pytest.raises(SystemExit, match="--top-k"):
        bench_main(["--experts", "2", "--top-k", "3", "--json", str(out)])
    with pytest.raises(SystemExit, match="--batch-sizes"):
        bench_main(["--batch-sizes", "0", "--json", str(out)])


@pytest.mark.unit
@pytest.mark.skipif(not hasattr(__import__("os"), "getuid"), reason="POSIX permissions")
def test_kernel_cache_must_be_this_users_alone(tmp_path, monkeypatch):
    """The built library is loaded from the cache: a directory others may write is refused."""
    cache = tmp_path / "kernels"
    monkeypatch.setattr(packed_cpu, "KERNEL_CACHE", cache)
    packed_cpu._check_cache_dir()
    assert cache.is_dir() and cache.stat().st_mode & 0o777 == 0o700
    cache.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by nobody else"):
        packed_cpu._check_cache_dir()


@pytest.mark.unit
def test_a_compiler_that_fails_is_an_error_naming_it_and_a_warning_for_the_decoder(tmp_path, monkeypatch):
    """``_library`` raises with the compiler's own message when every flag set fails;
    ``packed_cpu_available`` turns that into one ``RuntimeWarning`` and False (the decoder then
    multiplies the weights themselves), never a crash in the middle of a generation."""
    broken = tmp_path / "broken-c++"
    broken.write_text("#!/bin/sh\necho 'no such luck' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setattr(packed_cpu, "KERNEL_CACHE", tmp_path / "kernels")
    monkeypatch.setattr(packed_cpu, "_compiler", lambda: str(broken))
    packed_cpu._library.cache_clear()
    packed_cpu.packed_cpu_available.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no such luck"):
            packed_cpu._library()
        with pytest.warns(RuntimeWarning, match="(?s)did not build.*no such luck"):
            assert packed_cpu.packed_cpu_available() is False
        assert list((tmp_path / "kernels").iterdir()) == []  # no half-written library left behind
    finally:
        monkeypatch.undo()
        packed_cpu._library.cache_clear()
        packed_cpu.packed_cpu_available.cache_clear()
