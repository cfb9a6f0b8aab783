"""The memory-traffic count (``bench.traffic``): what one op moves, the attribution of
ops to stages and phases, and the layer's count against the compulsory traffic (the guard that
keeps the fused row and activation ops on the path: a layer going back to unfused ops fails)."""

from __future__ import annotations

import pytest
import torch

from bench.traffic import SHAPES, TrafficShape, compulsory, count_traffic, distinct_bytes, op_bytes, traffic_report

aten = torch.ops.aten


@pytest.mark.unit
def test_distinct_bytes_counts_a_broadcast_source_once():
    x = torch.randn(3, 4)
    assert distinct_bytes(x) == 48
    assert distinct_bytes(x[:, :1].expand(3, 100)) == 12
    assert distinct_bytes(torch.empty(0, 5)) == 0


@pytest.mark.unit
def test_op_bytes_rules():
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    out = torch.add(x, y)
    assert op_bytes(aten.add.Tensor, (x, y), {}, out) == (256, 128)
    # a view moves nothing
    assert op_bytes(aten.view.default, (x, [32]), {}, x.view(32)) == (0, 0)
    # a gather reads the rows it picks (and the index), not its whole source
    idx = torch.tensor([1, 1, 5])
    picked = x.index_select(0, idx)
    assert op_bytes(aten.index_select.default, (x, 0, idx), {}, picked) == (3 * 16 + 24, 3 * 16)
    # in place: the destination is read and written once
    assert op_bytes(aten.mul_.Tensor, (x, y), {}, x) == (256, 128)
    # a scatter-add writes (and reads) the rows it places
    dest, src, index = torch.zeros(8, 4), torch.randn(2, 4), torch.tensor([0, 3])
    read, written = op_bytes(aten.index_add_.default, (dest, 0, index, src), {}, dest)
    assert (read, written) == (2 * 32 + 16, 32)
    # empty allocates, writes nothing
    assert op_bytes(aten.empty.memory_format, ([4, 4],), {}, torch.empty(4, 4)) == (0, 0)


@pytest.mark.reference
def test_ops_land_in_their_stage_and_phase():
    """A small layer: the permute is dispatch (forward) and its backward dispatch (backward);
    the fused activation is activation in both phases; the unpermute is combine."""
    layer = TrafficShape("t", T=64, D=16, H=24, E=4, K=2)
    from bench.traffic import _layer

    moe = _layer(layer, torch.float32, 0.0)
    counted = count_traffic(moe, torch.randn(64, 16, requires_grad=True))
    ops = {(stage, phase, op) for stage, phase, op in counted["ops"]}
    assert ("dispatch", "fwd", "permute_rows") in ops and ("dispatch", "bwd", "gather_reduce") in ops
    assert ("activation", "fwd", "activate") in ops and ("activation", "bwd", "activate_backward_") in ops
    assert ("combine", "fwd", "unpermute_rows") in ops and ("combine", "bwd", "gather_dot") in ops
    assert sum(counted["gemm"]) > 0  # the expert GEMMs, counted apart


@pytest.mark.reference
@pytest.mark.parametrize("cf", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_layer_moves_at_most_1_5x_the_compulsory_traffic(name, cf):
    """fp32 at a small T (the passes do not depend on T): issue 30's bound."""
    base = SHAPES[name]
    shape = TrafficShape(name, T=64, D=base.D // 4, H=base.H // 4, E=base.E, K=base.K)
    report = traffic_report(shape, torch.float32, cf)
    assert report["ratio"] <= 1.5, report


@pytest.mark.unit
def test_compulsory_scales_with_the_rows():
    shape = SHAPES["mixtral"]
    a = compulsory(shape, rows=shape.T * shape.K, itemsize=4, router_itemsize=4)
    b = compulsory(shape, rows=shape.T * shape.K // 2, itemsize=4, router_itemsize=4)
    assert b[("activation", "fwd")] * 2 == a[("activation", "fwd")]
    assert a[("losses", "fwd")] == b[("losses", "fwd")]
