"""The lean expert FFN (``moeflow.experts.lean``) and expert recompute: outputs and every
gradient against the plain-autograd reference (fp64), recompute bit-identical to the default
path, the memory it saves, and the keywords that switch it on."""

from __future__ import annotations

import zlib

import pytest
import torch

import moeflow
from bench.activation import saved_bytes
from moeflow.bench.memory import peak_memory_bytes
from moeflow.config import ExpertsConfig
from moeflow.experts import GroupedExperts
from moeflow.experts.lean import LEAN_GEMMS, ffn_reference, lean_ffn
from moeflow.kernels.activation import ACTIVATIONS

from helpers import ffn_operands

pytestmark = pytest.mark.reference


def _operands(gen, gemm, activation, dtype):
    return ffn_operands(gen, gemm, activation, dtype, E=5, C=7)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("gemm", ["bmm", "loop", "grouped_mm"])
@pytest.mark.parametrize("recompute", [False, True])
def test_lean_ffn_matches_reference(activation, gemm, recompute):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{activation}-{gemm}-{recompute}".encode()))
    dtype = torch.float32 if gemm == "grouped_mm" else torch.float64  # F.grouped_mm: no fp64 on CPU
    tol = 1e-4 if dtype == torch.float32 else 1e-11
    x, w_in, w_out, offs = _operands(gen, gemm, activation, dtype)
    grad = torch.randn(*x.shape[:-1], x.shape[-1], generator=gen, dtype=dtype)
    lean_offs = offs.to(torch.int32) if gemm == "grouped_mm" else offs
    y = lean_ffn(x, w_in, w_out, lean_offs, activation=activation, gemm=gemm, recompute=recompute)
    got = torch.autograd.grad(y, [x, w_in, w_out], grad)
    y_ref = ffn_reference(x, w_in, w_out, offs, activation=activation)
    want = torch.autograd.grad(y_ref, [x, w_in, w_out], grad)
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    for name, g, w in zip(("x", "w_in", "w_out"), got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("gemm", LEAN_GEMMS)
@pytest.mark.parametrize("recompute", [False, True])
def test_each_lean_gemm_runs_its_own_kernel(gemm, recompute, monkeypatch):
    """``gemm`` picks the products' kernel in forward and backward: ``bmm`` runs ``torch.bmm``,
    ``grouped_mm`` the native ``F.grouped_mm`` and ``loop`` the reference loop, and none of
    them another's (the loop gives the native kernel's results, only many times slower: a
    fallback to it passes every comparison)."""
    import moeflow.experts.lean as lean

    calls = {"bmm": 0, "grouped_mm": 0, "loop": 0}

    def counted(kind, fn):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[kind] += 1
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "bmm", counted("bmm", torch.bmm))
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counted("grouped_mm", torch.nn.functional.grouped_mm))
    monkeypatch.setattr(lean, "grouped_mm_loop", counted("loop", lean.grouped_mm_loop))
    gen = torch.Generator().manual_seed(zlib.crc32(f"kernel-{gemm}-{recompute}".encode()))
    x, w_in, w_out, offs = _operands(gen, gemm, "swiglu", torch.float32)
    lean_offs = offs.to(torch.int32) if gemm == "grouped_mm" else offs
    y = lean_ffn(x, w_in, w_out, lean_offs, activation="swiglu", gemm=gemm, recompute=recompute)
    forward = dict(calls)
    torch.autograd.grad(y, [x, w_in, w_out], torch.randn(y.shape, generator=gen))
    assert forward[gemm] >= (1 if recompute else 2) and calls[gemm] > forward[gemm], (forward, calls)
    assert all(n == 0 for kind, n in calls.items() if kind != gemm), calls


@pytest.mark.parametrize("capacity_factor", [1.0, 0.0])
@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_recompute_gives_the_same_gradients_bit_for_bit(capacity_factor, activation):
    gen = torch.Generator().manual_seed(7)
    kw = dict(dim=16, hidden=24, num_experts=4, top_k=2, capacity_factor=capacity_factor,
              experts=ExpertsConfig(activation=activation, backend="loop"))
    base = moeflow.MoE(**kw, dtype=torch.float64)
    lean = moeflow.MoE(**kw, expert_recompute=True, dtype=torch.float64)
    lean.load_state_dict(base.state_dict())
    with torch.no_grad():
        for p in base.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
        lean.load_state_dict(base.state_dict())
    x = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    grad = torch.randn(50, 16, generator=gen, dtype=torch.float64)
    results = []
    for layer in (base, lean):
        xx = x.clone().requires_grad_()
        y = layer(xx)
        y.backward(grad)
        results.append((y.detach(), xx.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y0, gx0, gp0), (y1, gx1, gp1) = results
    assert lean.experts.recompute and not base.experts.recompute
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    for name in gp0:
        assert torch.equal(gp0[name], gp1[name]), name


def test_experts_with_bias_recompute_through_checkpoint():
    gen = torch.Generator().manual_seed(3)
    cfg = ExpertsConfig(activation="swiglu", bias=True, backend="loop")
    plain = GroupedExperts(num_experts=3, dim=8, hidden=12, config=cfg, dtype=torch.float64)
    again = GroupedExperts(num_experts=3, dim=8, hidden=12, config=cfg, recompute=True, dtype=torch.float64)
    with torch.no_grad():
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
    again.load_state_dict(plain.state_dict())
    for x in (torch.randn(3, 5, 8, generator=gen, dtype=torch.float64),
              torch.randn(9, 8, generator=gen, dtype=torch.float64)):
        counts = torch.tensor([5, 5, 5]) if x.dim() == 3 else torch.tensor([4, 0, 5])
        grads = []
        for m in (plain, again):
            m.zero_grad()
            xx = x.clone().requires_grad_()
            m(xx, counts).pow(2).sum().backward()
            grads.append([xx.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_second_backward_through_lean_experts_fails_loudly():
    experts = GroupedExperts(num_experts=2, dim=8, hidden=8)
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = experts(x, torch.tensor([3, 3])).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_recompute_and_lean_save_less_memory():
    """fp32 experts: the lean default's fwd+bwd peak (gradients included) below plain autograd's;
    recompute's, at this size one expert chunk, no higher than the default's plus what recompute
    holds by design (its private copy of the rows, overwritten with dx, and dW_in allocated
    before its chunks: it saves memory at sizes with several chunks); what is saved for
    backward: x and h by default, x alone with recompute."""
    torch.manual_seed(0)
    E, C, D, H = 4, 256, 64, 128
    experts = GroupedExperts(num_experts=E, dim=D, hidden=H)
    x = torch.randn(E, C, D)
    grad = torch.randn(E, C, D)
    counts = torch.full((E,), C)

    def run(fn):
        def once():
            xx = x.clone().requires_grad_()
            fn(xx).backward(grad)
        experts.zero_grad(set_to_none=True)
        return peak_memory_bytes(once, torch.device("cpu"))

    plain = run(lambda xx: torch.bmm(moeflow.experts.activate(torch.bmm(xx, experts.w_in), "swiglu"), experts.w_out))
    default = run(lambda xx: experts(xx, counts))
    experts.recompute = True
    recompute = run(lambda xx: experts(xx, counts))
    assert default < 0.9 * plain
    assert recompute <= default + x.nbytes + experts.w_in.nbytes
    saved = {}
    for flag in (False, True):
        experts.recompute = flag
        saved[flag] = saved_bytes(lambda: experts(x.clone().requires_grad_(), counts), list(experts.parameters()))
    row = 4 * E * C  # bytes of one fp32 feature column over every row
    assert saved[False] == row * (D + 2 * H)  # x (the input rows) and h
    assert saved[True] == row * D


def test_recompute_keywords_validate():
    with pytest.raises(TypeError, match="recompute"):
        ExpertsConfig(recompute="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expert_recompute"):
        moeflow.MoE(dim=8, hidden=8, num_experts=2, expert_recompute=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="experts_module"):
        moeflow.MoE(dim=8, hidden=8, num_experts=2, expert_recompute=True,
                    experts_module=GroupedExperts(num_experts=2, dim=8, hidden=8))
    layer = moeflow.MoE(dim=8, hidden=8, num_experts=2, expert_recompute=True)
    assert layer.config.experts.recompute and layer.experts.recompute
    assert layer.experts.shard(0, 1).recompute
    with pytest.raises(ValueError, match="gemm"):
        lean_ffn(torch.randn(2, 3, 4), torch.randn(2, 4, 8), torch.randn(2, 4, 4), None, activation="swiglu", gemm="x")
