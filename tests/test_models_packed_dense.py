"""The dense products of the CPU's compiled decode over packed weights
(``moeflow.models.packed_dense``): a ``PackedCPULinear`` equals the linear it stands in for (its
readable reference, ``F.linear``, in fp64) on fresh random inputs with and without a bias, at
every row count up to ``MAX_DENSE_ROWS`` and under ``torch.compile`` (one opaque op); it hands
the linear every call the kernel is not for, gradients included; it repacks into the same memory
after a change; ``HeadProduct`` packs an fp32 head (the same bits on every call) and keeps the
``[D, V]`` copy for other dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moeflow.models.packed_dense as packed_dense
import moeflow.kernels.packed_cpu as packed_cpu
from moeflow.models.packed_dense import MAX_DENSE_ROWS, HeadProduct, PackedCPULinear, packable_linear

needs_compiler = pytest.mark.skipif(packed_cpu._compiler() is None, reason="no C++ compiler on the PATH")


def _linear(seed: int, K: int = 24, N: int = 37, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(K, N, bias=bias)
    with torch.no_grad():
        for p in linear.parameters():
            p.normal_(0, 0.5)  # (the bias too: never zeros)
    return linear


def _reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    b = None if linear.bias is None else linear.bias.double()
    return F.linear(x.double(), linear.weight.double(), b)


@pytest.mark.unit
def test_packable_linear_is_the_one_rule():
    """A plain fp32 CPU ``nn.Linear`` (with or without bias): yes; another dtype, a subclass,
    another module: no; a stand-in refuses what is not packable, by name."""
    assert packable_linear(_linear(0)) and packable_linear(_linear(0, bias=False))
    assert not packable_linear(_linear(0).double()) and not packable_linear(_linear(0).to(torch.bfloat16))

    class Scaled(torch.nn.Linear):
        pass

    assert not packable_linear(Scaled(4, 4)) and not packable_linear(torch.nn.Conv1d(4, 4, 1))
    with pytest.raises(ValueError, match="packable_linear"):
        PackedCPULinear(_linear(0).double())


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 24), (3, 1, 24), (2, 5, 24), (MAX_DENSE_ROWS, 24)])
def test_stand_in_equals_the_linear(bias, shape, monkeypatch):
    """No-grad calls of up to ``MAX_DENSE_ROWS`` rows run the kernel (once) and equal
    ``F.linear`` in fp64 up to fp32 rounding, any leading shape, a partial last strip (37
    columns); the stand-in holds no parameter of its own and reads the linear's ``weight``."""
    linear = _linear(len(shape) + shape[0], bias=bias)
    stand_in = PackedCPULinear(linear)
    assert list(stand_in.parameters()) == [] and stand_in.state_dict() == {}
    assert stand_in.weight is linear.weight and stand_in.bias is linear.bias
    calls = []
    real = packed_dense.packed_grouped_mm
    monkeypatch.setattr(packed_dense, "packed_grouped_mm", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0]))
    with torch.no_grad():
        y = stand_in(x)
    assert y.shape == (*shape[:-1], 37) and len(calls) == 1
    torch.testing.assert_close(y.double(), _reference(x, linear), rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.reference
def test_stand_in_sends_the_linear_what_the_kernel_is_not_for(monkeypatch):
    """More than ``MAX_DENSE_ROWS`` rows, grad mode (the linear's gradients, exactly), autocast
    and an fp64 input go to the linear itself, unchanged."""
    linear = _linear(1)
    stand_in = PackedCPULinear(linear)
    monkeypatch.setattr(packed_dense, "packed_grouped_mm", lambda *a: pytest.fail("the kernel ran"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        many = torch.randn(MAX_DENSE_ROWS + 1, 24, generator=gen)
        assert torch.equal(stand_in(many), linear(many))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.randn(3, 24, generator=gen)
            assert torch.equal(stand_in(x), linear(x))
    x = torch.randn(4, 24, generator=gen, requires_grad=True)
    grads = []
    for module in (linear, stand_in):
        linear.zero_grad()
        x.grad = None
        y = module(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(3)))
        grads.append((y.detach(), x.grad.clone(), linear.weight.grad.clone(), linear.bias.grad.clone()))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@needs_compiler
@pytest.mark.reference
def test_stand_in_repacks_into_the_same_memory_and_compiles_as_one_op():
    """``repack`` after an in-place change and a ``.data`` write (no version moves) packs the new
    weights into the buffers of before and the output follows; under ``torch.compile(fullgraph)``
    the product is the ``moeflow::packed_linear`` op and equals the eager one."""
    linear = _linear(4)
    stand_in = PackedCPULinear(linear)
    packed, bias = stand_in.packed, stand_in.bias_copy
    x = torch.randn(6, 24, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        linear.weight.data.mul_(-1.0)
        linear.bias.add_(0.25)
        stand_in.repack(linear)
        assert stand_in.packed is packed and stand_in.bias_copy is bias
        torch.testing.assert_close(stand_in(x).double(), _reference(x, linear), rtol=1e-5, atol=1e-5)
        graph_ops = []

        def backend(gm, inputs):  # type: ignore[no-untyped-def]
            graph_ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm

        compiled = torch.compile(stand_in, fullgraph=True, backend=backend)
        assert torch.equal(compiled(x), stand_in(x))
    assert any("packed_linear" in op for op in graph_ops)


@needs_compiler
@pytest.mark.reference
@pytest.mark.parametrize("rows", [1, 5, 16])
def test_the_head_product_packs_an_fp32_head(rows):
    """An fp32 head is packed (no ``[D, V]`` copy) and its logits equal ``F.linear`` in fp64 up to
    fp32 rounding, the same bits on every call; ``end`` drops the pack; a call outside
    ``begin``/``end`` is an error."""
    gen = torch.Generator().manual_seed(rows)
    w_VD = torch.randn(70, 24, generator=gen)
    h_BD = torch.randn(rows, 24, generator=gen)
    head = HeadProduct()
    head.begin(w_VD)
    assert head.packed is not None and head.weight_DV is None
    out = head(h_BD)
    torch.testing.assert_close(out.double(), h_BD.double() @ w_VD.double().t(), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(head(h_BD), out) for _ in range(3))
    head.end()
    assert head.packed is None
    with pytest.raises(RuntimeError, match="begin comes first"):
        head(h_BD)
