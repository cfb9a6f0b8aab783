"""``bench.stage_profile``: one profiled forward+backward of a CPU layer split by stage.

Every stage gets time (the slot assignment has no backward: integer ops), backward ops land in
the stage of the forward op that created their autograd node, the rows add up to the total, the
labels come off again afterwards, and the profiled call computes what an unprofiled one does."""

from __future__ import annotations

import pytest
import torch

import moeflow
import moeflow.dispatch.local as local
import moeflow.experts.lean as lean
import moeflow.layer.router as router_mod
from bench.stage_profile import STAGES, format_stage_table, profile_stages, stage_ranges

pytestmark = pytest.mark.reference

BACKWARD = "autograd::engine::evaluate_function: "


def _layer(cf: float = 0.0) -> moeflow.MoE:
    torch.manual_seed(0)
    return moeflow.MoE(dim=16, hidden=32, num_experts=8, top_k=2, capacity_factor=cf)


@pytest.mark.parametrize("cf", [0.0, 1.25])
def test_every_stage_has_time_and_the_rows_add_up(cf):
    layer = _layer(cf)
    x = torch.randn(96, 16, requires_grad=True)
    result = profile_stages(layer, x, keep_events=True, steps=2)
    rows = {r["stage"]: r for r in result["rows"]}
    assert list(rows) == [*STAGES, "other"] and result["unit"] == "cpu"
    for stage in STAGES:
        assert rows[stage]["fwd_ms"] > 0, stage
        if stage != "slots":  # integer ops: no backward
            assert rows[stage]["bwd_ms"] > 0, stage
    assert rows["slots"]["bwd_ms"] == 0
    total = result["total_ms"]
    assert sum(r["ms"] for r in result["rows"]) == pytest.approx(total)
    assert sum(r["share"] for r in result["rows"]) == pytest.approx(1.0)
    assert sum(e["us"] for e in result["events"]) / 1e3 == pytest.approx(total)
    assert "combine" in format_stage_table(result)


def test_backward_ops_land_in_their_forward_stage():
    layer = _layer()
    x = torch.randn(64, 16, requires_grad=True)
    events = profile_stages(layer, x, keep_events=True)["events"]
    nodes: dict[str, set[tuple[str, str]]] = {}
    for e in events:
        if e["name"].startswith(BACKWARD):
            nodes.setdefault(e["name"][len(BACKWARD):], set()).add((e["stage"], e["phase"]))
    # the router's linear and scoring, the experts' two GEMM nodes, the permute (dispatch) and the
    # weighted unpermute (combine)
    assert nodes["MmBackward0"] == {("router", "bwd")}
    assert nodes["SoftmaxBackward0"] == {("router", "bwd")}
    assert nodes["_FirstGEMMBackward"] == {("gemm", "bwd")}
    assert nodes["_ActSecondGEMMBackward"] == {("gemm", "bwd")}
    assert nodes["GeneratedBackwardFor_moeflow_permute_rows_defaultBackward"] == {("dispatch", "bwd")}
    assert nodes["GeneratedBackwardFor_moeflow_unpermute_rows_defaultBackward"] == {("combine", "bwd")}
    assert ("losses", "bwd") in nodes["MulBackward0"]
    # ops inside a node's backward: the activation's backward (a labelled helper) is activation,
    # the GEMMs there are the node's stage
    bwd_ops = {(e["name"], e["stage"]) for e in events if e["phase"] == "bwd" and not e["name"].startswith(BACKWARD)}
    assert ("moeflow::activate_backward_", "activation") in bwd_ops
    assert ("aten::silu_backward", "activation") in bwd_ops  # (its torch implementation, on CPU)
    assert ("aten::_grouped_mm", "gemm") in bwd_ops or ("aten::mm", "gemm") in bwd_ops
    # nothing of the forward is taken for backward, and vice versa
    fwd_ops = {e["name"] for e in events if e["phase"] == "fwd"}
    assert not any(name.startswith(BACKWARD) for name in fwd_ops)


def test_labels_come_off_and_the_result_is_unchanged():
    originals = (local.assign_slots, lean._activate, lean._act_backward_, router_mod.load_balance_loss)
    layer = _layer()
    x = torch.randn(48, 16, requires_grad=True)
    g = torch.randn(48, 16)
    ref = torch.autograd.grad(layer(x), [x, *layer.parameters()], g)
    with stage_ranges(layer):
        assert local.assign_slots is not originals[0] and "dispatch" in vars(layer.dispatcher)
        labelled = torch.autograd.grad(layer(x), [x, *layer.parameters()], g)
    assert all(torch.equal(a, b) for a, b in zip(ref, labelled))
    assert (local.assign_slots, lean._activate, lean._act_backward_, router_mod.load_balance_loss) == originals
    assert "dispatch" not in vars(layer.dispatcher) and "combine" not in vars(layer.dispatcher)
    assert not layer.router._forward_pre_hooks and not layer.experts._forward_hooks
    # and after a whole profiled call too
    profile_stages(layer, x)
    assert local.assign_slots is originals[0] and not layer.experts._forward_pre_hooks
    again = torch.autograd.grad(layer(x), [x, *layer.parameters()], g)
    assert all(torch.equal(a, b) for a, b in zip(ref, again))
