"""FP8 expert GEMMs (``moeflow.kernels.fp8``, ``moeflow.experts.fp8``, ``moeflow.experts.fp8_weights``)
against readable references on fresh random inputs.

On CPU: the quantisation rule, the Triton kernels under the interpreter (the same codes as the
reference, bit for bit), the padded-group layout, the FP8 FFN's emulated path (``fp8_gemm=
"reference"``) outputs and all gradients against an independent per-expert reference built from
``quantize_reference``, the layer with ``ExpertsConfig(fp8="rowwise")``, the config's errors and
the error on a device without FP8; FP8 weight-only experts against their dequantised weights.
``@pytest.mark.gpu``: the CUDA fast path (``torch._scaled_grouped_mm``, compiled Triton) against
the reference path on the same device.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import copy  # noqa: E402

import pytest  # noqa: E402

import moeflow  # noqa: E402
from moeflow import ExpertsConfig  # noqa: E402
from moeflow.experts.ffn import GroupedExperts, grouped_ffn  # noqa: E402
from moeflow.experts.fp8 import fp8_grouped_ffn, pad_groups  # noqa: E402
from moeflow.experts.fp8_weights import (FP8WeightExperts, fp8_weight_grouped_mm,  # noqa: E402
                                         fp8_weight_grouped_mm_reference, quantize_experts_fp8)
from moeflow.kernels.activation import activate_reference as activate  # noqa: E402
from moeflow.kernels.fp8 import (E4M3_MAX, dequantize, fp8_supported, quantize_columns_t,  # noqa: E402
                                 quantize_reference, quantize_rows, scaled_grouped_mm, scaled_grouped_mm_reference)
from moeflow.kernels.triton import interpreter_active  # noqa: E402

from helpers import needs_cuda, random_counts  # noqa: E402

pytestmark = pytest.mark.reference

interpreted = pytest.mark.skipif(not interpreter_active(), reason="the Triton interpreter is off (CUDA present): "
                                 "the gpu tests below run the kernels compiled")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ----------------------------------------------------------------------------- quantisation rule


def test_rowwise_scale_is_the_row_amax_over_448_and_the_amax_maps_to_448():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 40, generator=gen) * torch.logspace(-3, 3, 9).unsqueeze(1)
    q, s = quantize_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (9,)
    torch.testing.assert_close(s, x.abs().amax(1) / E4M3_MAX, rtol=0, atol=0)
    assert torch.equal(q.float().abs().amax(1), torch.full((9,), E4M3_MAX))


def test_round_trip_error_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 256, generator=gen) * 5
    q, s = quantize_reference(x)
    err = (dequantize(q, s) - x).abs()
    # normal range: 3 mantissa bits, so at most 2^-4 of |x|; below 2^-6 * scale, half the 2^-9 step
    bound = torch.maximum(x.abs() * 2.0**-4, s.unsqueeze(1) * 2.0**-10) * (1 + 1e-6)
    assert bool((err <= bound).all())
    assert 0.005 < rel(dequantize(q, s), x) < 0.05  # it does quantise (not exact), and not grossly


def test_block_scales_per_128_elements_are_finer_than_the_row_scale():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 384, generator=gen)
    x[:, 128:256] *= 100  # one loud block per row
    qb, sb = quantize_reference(x, block=128)
    qr, sr = quantize_reference(x)
    assert sb.shape == (4, 3)
    torch.testing.assert_close(sb, x.view(4, 3, 128).abs().amax(-1) / E4M3_MAX, rtol=0, atol=0)
    assert bool((sb <= sr.unsqueeze(1)).all())
    quiet = [slice(0, 128), slice(256, 384)]
    eb = sum(rel(dequantize(qb, sb, block=128)[:, c], x[:, c]) for c in quiet)
    er = sum(rel(dequantize(qr, sr)[:, c], x[:, c]) for c in quiet)
    assert eb < er  # the quiet blocks keep their precision only with their own scale
    q1, s1 = quantize_reference(x[:, :128], block=128)
    assert torch.equal(q1.float(), quantize_reference(x[:, :128])[0].float())
    with pytest.raises(ValueError, match="block=100"):
        quantize_reference(x, block=100)


@interpreted
@pytest.mark.parametrize("shape,dtype", [((7, 37), torch.float32), ((5, 3000), torch.float32), ((6, 48), torch.bfloat16)])
def test_triton_row_quantiser_gives_the_reference_codes(shape, dtype):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
    x[0] *= torch.logspace(-7, 0, shape[1]).to(dtype)  # subnormal codes too
    x[1] = 0  # an all-zero row
    from moeflow.kernels.triton.fp8 import quantize_rows_triton

    q, s = quantize_rows_triton(x)
    qr, sr = quantize_reference(x)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)
    wide = torch.randn(shape[0], shape[1] + 5, generator=gen).to(dtype)[:, 2:shape[1] + 2]  # a row stride > N
    assert torch.equal(quantize_rows_triton(wide)[0].view(torch.uint8), quantize_reference(wide)[0].view(torch.uint8))


@interpreted
@pytest.mark.parametrize("shape", [(37, 45), (3, 70, 130), (200, 16)])
def test_triton_column_quantiser_gives_the_reference_codes_transposed(shape):
    from moeflow.kernels.triton.fp8 import quantize_columns_t_triton

    gen = torch.Generator().manual_seed(15)
    x = torch.randn(*shape, generator=gen) * 3
    x[..., 0] = 0  # an all-zero column
    x[..., 1] *= torch.logspace(-7, 0, shape[-2])
    q, s = quantize_columns_t_triton(x)
    qr, sr = quantize_reference(x.transpose(-2, -1))
    assert q.is_contiguous() and q.shape == (*shape[:-2], shape[-1], shape[-2])
    assert torch.equal(q.view(torch.uint8), qr.contiguous().view(torch.uint8)) and torch.equal(s, sr)


# ----------------------------------------------------------------------------- grouped products


def test_scaled_grouped_mm_reference_equals_dequantised_products_in_both_forms():
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([5, 0, 11])
    offs = torch.cumsum(counts, 0).to(torch.int32)
    a, sa = quantize_reference(torch.randn(16, 32, generator=gen))
    b, sb = quantize_reference(torch.randn(3, 24, 32, generator=gen))  # [G, N, K]: per output column
    out = scaled_grouped_mm_reference(a, b.transpose(-2, -1), sa, sb, offs)
    a32, b32 = dequantize(a, sa), dequantize(b, sb)
    expect = torch.cat([a32[:5] @ b32[0].t(), a32[5:5] @ b32[1].t(), a32[5:] @ b32[2].t()])
    torch.testing.assert_close(out, expect)
    # K grouped (weight gradient): [M, Ktot] x [Ktot, N] -> [G, M, N], scales group-major
    at, sat = quantize_reference(torch.randn(3, 8, 16, generator=gen))  # per group: [M, K_g] rows
    bt, sbt = quantize_reference(torch.randn(3, 6, 16, generator=gen))  # per group: [N, K_g] rows
    offs_k = torch.tensor([16, 32, 48], dtype=torch.int32)
    out2 = scaled_grouped_mm_reference(torch.cat(list(at), 1), torch.cat(list(bt), 1).t(), sat.flatten(), sbt.flatten(),
                                       offs_k)
    expect2 = torch.stack([dequantize(at[g], sat[g]) @ dequantize(bt[g], sbt[g]).t() for g in range(3)])
    torch.testing.assert_close(out2, expect2)


def test_pad_groups_places_each_expert_in_an_aligned_group_of_its_own():
    gen = torch.Generator().manual_seed(6)
    for counts in (random_counts(gen, 6, 77, 2), torch.tensor([0, 0, 33]), torch.tensor([16, 1, 0, 40])):
        rows = int(counts.sum())
        dest, offs, total = pad_groups(counts, rows)
        assert total % 16 == 0 and int(offs[-1]) == total and offs.dtype == torch.int32
        sizes = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
        assert bool((sizes % 16 == 0).all()) and bool((sizes >= 16).all()) and bool((sizes >= counts).all())
        assert len(set(dest.tolist())) == rows and int(dest.max()) < total
        starts = offs.long() - sizes
        r = 0
        for e, c in enumerate(counts.tolist()):  # expert e's rows, in order, from its group's start
            assert dest[r:r + c].tolist() == list(range(int(starts[e]), int(starts[e]) + c))
            r += c


# ----------------------------------------------------------------------------- the FP8 FFN


def _deq_rows(t: torch.Tensor) -> torch.Tensor:
    return dequantize(*quantize_reference(t))


def _deq_cols(t: torch.Tensor) -> torch.Tensor:
    return _deq_rows(t.transpose(-2, -1)).transpose(-2, -1)


def ffn_fp8_reference(x, counts, w_in, w_out, dy, activation):
    """The six products of ``moeflow.experts.fp8``'s docstring, one expert at a time, unpadded."""
    ends = torch.cumsum(counts, 0).tolist()
    spans = list(zip([0] + ends[:-1], ends))
    xd, wi_f, wo_f = _deq_rows(x), _deq_cols(w_in), _deq_cols(w_out)
    h = torch.cat([xd[s:t] @ wi_f[e] for e, (s, t) in enumerate(spans)])
    a = activate(h, activation)
    ad = _deq_rows(a)
    y = torch.cat([ad[s:t] @ wo_f[e] for e, (s, t) in enumerate(spans)])
    dyd, wo_b, wi_b = _deq_rows(dy), _deq_rows(w_out), _deq_rows(w_in)
    da = torch.cat([dyd[s:t] @ wo_b[e].t() for e, (s, t) in enumerate(spans)])
    hh = h.detach().requires_grad_()
    dh = torch.autograd.grad(activate(hh, activation), hh, da)[0]
    dhd = _deq_rows(dh)
    dx = torch.cat([dhd[s:t] @ wi_b[e].t() for e, (s, t) in enumerate(spans)])
    a_c, dy_c, x_c, dh_c = _deq_cols(a), _deq_cols(dy), _deq_cols(x), _deq_cols(dh)
    dwo = torch.stack([a_c[s:t].t() @ dy_c[s:t] for s, t in spans])
    dwi = torch.stack([x_c[s:t].t() @ dh_c[s:t] for s, t in spans])
    return y, dx, dwi, dwo


@pytest.mark.parametrize("activation,counts", [("swiglu", [10, 0, 23, 17]), ("gelu", [1, 40, 2]),
                                                 ("swiglu_oai", [33, 31])])
def test_fp8_ffn_outputs_and_gradients_match_the_per_expert_reference(activation, counts):
    gen = torch.Generator().manual_seed(7)
    counts = torch.tensor(counts)
    n_e, dim, hidden = len(counts), 32, 48
    width = 2 * hidden if activation in ("swiglu", "swiglu_oai") else hidden
    x = torch.randn(int(counts.sum()), dim, generator=gen).requires_grad_()
    w_in = (torch.randn(n_e, dim, width, generator=gen) * 0.2).requires_grad_()
    w_out = (torch.randn(n_e, hidden, dim, generator=gen) * 0.2).requires_grad_()
    dy = torch.randn(x.shape[0], dim, generator=gen)
    y = fp8_grouped_ffn(x, counts, w_in, w_out, activation=activation, gemm="reference")
    got = (y, *torch.autograd.grad(y, (x, w_in, w_out), dy))
    want = ffn_fp8_reference(x.detach(), counts, w_in.detach(), w_out.detach(), dy, activation)
    names = ("y", "dx", "dw_in", "dw_out")
    for name, g, w in zip(names, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert rel(g, w) < 1e-4, f"{name}: {rel(g, w):.2e} from the reference"
    # and the whole is the fp32 FFN up to e4m3's rounding (a few percent, never exact)
    y32 = grouped_ffn(x, counts, w_in, w_out, activation=activation, backend="loop")
    full = (y32, *torch.autograd.grad(y32, (x, w_in, w_out), dy))
    for name, g, f in zip(names, got, full):
        assert 1e-3 < rel(g, f) < 0.12, f"{name}: {rel(g, f):.2e} from fp32"


def test_layer_with_fp8_experts_trains_close_to_fp32_dropless_and_with_capacity():
    gen = torch.Generator().manual_seed(8)
    for cf in (0.0, 1.5):
        torch.manual_seed(9)
        base = moeflow.MoE(dim=32, hidden=32, num_experts=4, top_k=2, capacity_factor=cf)
        torch.manual_seed(9)
        fp8 = moeflow.MoE(dim=32, hidden=32, num_experts=4, top_k=2, capacity_factor=cf,
                          experts=ExpertsConfig(fp8="rowwise", fp8_gemm="reference"))
        assert torch.equal(base.experts.w_in, fp8.experts.w_in)
        x = torch.randn(40, 32, generator=gen)
        outs = []
        for layer in (base, fp8):
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
            grads = torch.autograd.grad(y.square().sum(), [layer.experts.w_in, layer.experts.w_out])
            outs.append((y, *grads))
        for a, b in zip(outs[1], outs[0]):
            assert 1e-3 < rel(a, b) < 0.12


def test_fp8_config_values_are_validated_with_the_field_and_value():
    assert ExpertsConfig(fp8="rowwise").fp8 == "rowwise"
    with pytest.raises(ValueError, match="fp8 must be one of.*'block128'"):
        ExpertsConfig(fp8="block128")
    with pytest.raises(ValueError, match="bias=False"):
        ExpertsConfig(fp8="rowwise", bias=True)
    with pytest.raises(ValueError, match="recompute"):
        ExpertsConfig(fp8="rowwise", recompute=True)
    with pytest.raises(ValueError, match="fp8_gemm must be one of.*'fast'"):
        ExpertsConfig(fp8="rowwise", fp8_gemm="fast")
    with pytest.raises(ValueError, match="fp8_gemm='reference' applies with fp8"):
        ExpertsConfig(fp8_gemm="reference")
    with pytest.raises(ValueError, match="dim a multiple of 16.*got 24"):
        GroupedExperts(num_experts=2, dim=24, hidden=32, config=ExpertsConfig(fp8="rowwise"))
    with pytest.raises(ValueError, match="hidden a multiple of 16.*got 40"):
        GroupedExperts(num_experts=2, dim=32, hidden=40, config=ExpertsConfig(fp8="rowwise"))


def test_fp8_on_a_device_without_fp8_fails_clearly_at_the_first_forward():
    layer = moeflow.MoE(dim=32, hidden=32, num_experts=4, top_k=2, capacity_factor=0.0,
                        experts=ExpertsConfig(fp8="rowwise"))  # building it on CPU is fine: modules move
    assert fp8_supported("cpu")[0] is False
    with pytest.raises(RuntimeError, match=r"fp8='rowwise'.*FP8 device.*cpu.*fp8_gemm='reference'"):
        layer(torch.randn(8, 32))
    a, s = quantize_reference(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="scaled_grouped_mm: fp8 needs an FP8 device"):
        scaled_grouped_mm(a, a.view(1, 16, 32).transpose(-2, -1), s, s.view(1, 16), torch.tensor([16], dtype=torch.int32))


def test_a_cuda_device_older_than_ada_has_no_fp8(monkeypatch):
    import moeflow.kernels.fp8 as fp8_kernels

    monkeypatch.setattr(fp8_kernels, "cuda_capability", lambda device: (8, 0))  # an A100
    ok, why = fp8_supported("cuda")
    assert not ok and "compute capability 8.0" in why and "8.9" in why
    with pytest.raises(RuntimeError, match=r"fp8='rowwise'.*capability 8\.0"):
        fp8_kernels.check_fp8_device("cuda", "ExpertsConfig(fp8='rowwise')")
    monkeypatch.setattr(fp8_kernels, "cuda_capability", lambda device: (9, 0))  # an H100
    assert fp8_supported("cuda") == (True, "")
    monkeypatch.delattr(torch, "_scaled_grouped_mm")  # a torch without the grouped FP8 GEMM
    assert not fp8_supported("cuda")[0] and "_scaled_grouped_mm" in fp8_supported("cuda")[1]


# ----------------------------------------------------------------------------- weight-only FP8


def _experts(gen, bias=False):
    torch.manual_seed(int(torch.randint(0, 2**30, (1,), generator=gen)))
    return GroupedExperts(num_experts=3, dim=32, hidden=48, config=ExpertsConfig(init_std=0.2, bias=bias))


def test_weight_only_experts_compute_with_their_dequantised_weights():
    gen = torch.Generator().manual_seed(10)
    experts = _experts(gen)
    q = FP8WeightExperts(experts, kernel="reference")
    w_in, w_out = q.dequantized()
    assert q.w_in_q.dtype == torch.float8_e4m3fn and q.w_in_scale.shape == (3, 96)
    torch.testing.assert_close(q.w_in_scale, experts.w_in.detach().abs().amax(1) / E4M3_MAX, rtol=0, atol=0)
    assert 1e-3 < rel(w_in, experts.w_in) < 0.05  # stored in e4m3: close, not equal
    counts = torch.tensor([4, 0, 9])
    x = torch.randn(13, 32, generator=gen)
    want = grouped_ffn(x, counts, w_in, w_out, activation="swiglu", backend="loop")
    torch.testing.assert_close(q(x, counts), want, rtol=1e-5, atol=1e-6)
    xc = torch.randn(3, 5, 32, generator=gen)  # the [E, C, D] layout: E groups of C rows
    torch.testing.assert_close(q(xc, counts), want_c := q(xc.flatten(0, 1), torch.full((3,), 5)).view(3, 5, 32))
    assert want_c.shape == xc.shape
    q.to(torch.float64)  # a dtype cast keeps the codes and fp32 scales
    assert q.w_in_q.dtype == torch.float8_e4m3fn and q.w_in_scale.dtype == torch.float32
    with pytest.raises(ValueError, match="bias=False"):
        FP8WeightExperts(_experts(gen, bias=True))


def test_quantize_experts_fp8_replaces_the_experts_of_a_layer():
    torch.manual_seed(11)
    layer = moeflow.MoE(dim=32, hidden=32, num_experts=4, top_k=2, capacity_factor=0.0)
    ref = copy.deepcopy(layer)
    assert quantize_experts_fp8(layer, kernel="reference") == 1
    assert isinstance(layer.experts, FP8WeightExperts)
    w_in, w_out = layer.experts.dequantized()
    with torch.no_grad():
        ref.experts.w_in.copy_(w_in)
        ref.experts.w_out.copy_(w_out)
    x = torch.randn(20, 32)
    with torch.no_grad():
        got, want = layer(x), ref(x)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_weight_only_model_logits_equal_the_dequantised_weights_model_and_it_generates():
    from moeflow.models import MoEGPT, generate, gpt_config

    torch.manual_seed(16)
    model = MoEGPT(gpt_config("tiny", vocab_size=256, n_layers=2))
    ref = copy.deepcopy(model)
    assert quantize_experts_fp8(model) == 2
    with torch.no_grad():
        for q, r in zip([m for m in model.modules() if isinstance(m, FP8WeightExperts)],
                        [m for m in ref.modules() if isinstance(m, GroupedExperts)]):
            w_in, w_out = q.dequantized()
            r.w_in.copy_(w_in)
            r.w_out.copy_(w_out)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        got, want = model(idx), ref(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    out = generate(model, idx[:, :4], max_new_tokens=3, temperature=0.0)  # decoding runs on the e4m3 experts
    assert [len(t) for t in out.tokens] == [3, 3]


@interpreted
def test_triton_weight_only_product_matches_the_reference():
    gen = torch.Generator().manual_seed(12)
    w_q, scale = quantize_reference(torch.randn(3, 80, 40, generator=gen))  # [E, N, K] rows -> columns of [E, K, N]
    w_q, scale = w_q.transpose(-2, -1).contiguous(), scale
    counts = torch.tensor([3, 0, 20])
    x = torch.randn(23, 40, generator=gen)
    offs = torch.cumsum(counts, 0)
    got = fp8_weight_grouped_mm(x, w_q, scale, offs, kernel="triton")
    want = fp8_weight_grouped_mm_reference(x, w_q, scale, offs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- on a GPU


def _fp8_gpu():
    return torch.cuda.is_available() and fp8_supported("cuda")[0]


needs_fp8 = pytest.mark.skipif(not _fp8_gpu(), reason="needs a CUDA device with FP8 (capability 8.9+) and "
                               "torch._scaled_grouped_mm")


@pytest.mark.gpu
@needs_cuda
@needs_fp8
def test_gpu_fp8_ffn_fast_path_matches_the_reference_path():
    gen = torch.Generator(device="cuda").manual_seed(13)
    counts = torch.tensor([300, 0, 17, 700, 5], device="cuda")
    n_e, dim, hidden = 5, 256, 512
    x = torch.randn(int(counts.sum()), dim, device="cuda", generator=gen).bfloat16().requires_grad_()
    w_in = (torch.randn(n_e, dim, 2 * hidden, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    w_out = (torch.randn(n_e, hidden, dim, device="cuda", generator=gen) * 0.05).bfloat16().requires_grad_()
    dy = torch.randn(x.shape[0], dim, device="cuda", generator=gen).bfloat16()
    results = []
    for gemm in ("scaled_grouped_mm", "reference"):
        y = fp8_grouped_ffn(x, counts, w_in, w_out, activation="swiglu", gemm=gemm)
        results.append((y, *torch.autograd.grad(y, (x, w_in, w_out), dy)))
    for name, fast, ref in zip(("y", "dx", "dw_in", "dw_out"), *results):
        assert fast.dtype == ref.dtype and rel(fast, ref) < 2e-2, f"{name}: {rel(fast, ref):.2e}"


@pytest.mark.gpu
@needs_cuda
@needs_fp8
def test_gpu_layer_with_fp8_experts_is_close_to_bf16_dropless_and_with_capacity():
    for cf in (0.0, 1.25):
        torch.manual_seed(18)
        base = moeflow.MoE(dim=256, hidden=512, num_experts=8, top_k=2, capacity_factor=cf, device="cuda",
                           dtype=torch.bfloat16)
        fp8 = moeflow.MoE(dim=256, hidden=512, num_experts=8, top_k=2, capacity_factor=cf, device="cuda",
                          dtype=torch.bfloat16, experts=ExpertsConfig(fp8="rowwise"))
        fp8.load_state_dict(base.state_dict())
        x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
        outs = []
        for layer in (base, fp8):
            xg = x.clone().requires_grad_()
            y = layer(xg)
            outs.append((y, *torch.autograd.grad(y.float().square().sum(), [xg, layer.experts.w_in, layer.experts.w_out])))
        for name, f, b in zip(("y", "dx", "dw_in", "dw_out"), outs[1], outs[0]):
            assert f.dtype == b.dtype and 1e-3 < rel(f, b) < 0.12, f"cf={cf} {name}: {rel(f, b):.3e}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_triton_fp8_kernels_match_their_references():
    gen = torch.Generator(device="cuda").manual_seed(14)
    x = (torch.randn(1000, 4100, device="cuda", generator=gen) * 3).bfloat16()
    q, s = quantize_rows(x)
    qr, sr = quantize_reference(x)
    assert torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.view(torch.uint8))
    for t in (x, x.view(10, 100, 4100), x.t()):  # columns: 2-D, 3-D, and a transposed view (rows then)
        q, s = quantize_columns_t(t)
        qr, sr = quantize_reference(t.transpose(-2, -1))
        assert q.is_contiguous() and torch.equal(s, sr) and torch.equal(q.view(torch.uint8), qr.contiguous().view(torch.uint8))
    if torch.cuda.get_device_capability() >= (8, 9):
        w_q, scale = quantize_reference(torch.randn(4, 512, 256, device="cuda", generator=gen))
        w_q = w_q.transpose(-2, -1).contiguous()
        counts = torch.tensor([5, 0, 3, 8], device="cuda")
        xs = torch.randn(16, 256, device="cuda", generator=gen).bfloat16()
        got = fp8_weight_grouped_mm(xs, w_q, scale, torch.cumsum(counts, 0), kernel="triton")
        want = fp8_weight_grouped_mm_reference(xs, w_q, scale, torch.cumsum(counts, 0))
        assert rel(got, want) < 1e-2
