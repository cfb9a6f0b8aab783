"""The dispatcher protocol, the one seam between the layer and parallelism
(``moeflow.dispatch.protocol``): what the layer reads of a dispatcher, the layout it declares,
and the names that moved with the seam (they keep working for one release, with a warning)."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
import torch

import moeflow
from moeflow.dispatch import LocalDispatcher
from moeflow.dispatch.protocol import DispatchCombineAdapter
from moeflow.types import ExpertLayout

from helpers import make_layer, rand

pytestmark = pytest.mark.reference


class _DispatchCombineOnly:
    """A user dispatcher written to the protocol before ``run``."""

    def __init__(self, num_experts: int) -> None:
        self.inner = LocalDispatcher(num_experts=num_experts)
        self.calls = 0

    def dispatch(self, x_TD, routing, *, capacity_factor):  # type: ignore[no-untyped-def]
        self.calls += 1
        return self.inner.dispatch(x_TD, routing, capacity_factor=capacity_factor)

    def combine(self, expert_out, plan):  # type: ignore[no-untyped-def]
        return self.inner.combine(expert_out, plan)


def test_local_dispatcher_declares_the_protocol():
    disp = LocalDispatcher(num_experts=5)
    assert isinstance(disp, moeflow.Dispatcher) and disp.collective is False
    assert disp.layout == ExpertLayout.whole(5) and disp.layout.offset == 0


@pytest.mark.parametrize("cf", [1.0, 0.0, -0.5])
def test_dispatch_combine_only_dispatcher_is_adapted_with_a_warning(gen, cf):
    ref = make_layer(gen, capacity_factor=cf)
    old = _DispatchCombineOnly(ref.config.num_experts)
    with pytest.warns(DeprecationWarning, match="dispatch/combine only"):
        layer = moeflow.MoE(config=ref.config, dispatcher=old, dtype=torch.float64)
    layer.load_state_dict(ref.state_dict())
    layer.eval()
    assert isinstance(layer.dispatcher, DispatchCombineAdapter)
    x = rand(gen, 11, ref.config.dim)
    assert torch.equal(layer(x), ref(x)) and old.calls == 1
    assert layer.expert_range() == (0, ref.config.num_experts)


def test_something_else_as_dispatcher_is_a_type_error():
    with pytest.raises(TypeError, match="dispatcher must implement moeflow.Dispatcher"):
        moeflow.MoE(dim=8, hidden=8, num_experts=4, dispatcher=object())

    class OnlyDispatch:
        def dispatch(self, x_TD, routing, *, capacity_factor):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

    class OnlyCombine:
        def combine(self, expert_out, plan):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

    for half in (OnlyDispatch(), OnlyCombine()):  # half of the old pair is neither protocol
        with pytest.raises(TypeError, match=f"got {type(half).__name__}"):
            moeflow.MoE(dim=8, hidden=8, num_experts=4, dispatcher=half)


def test_the_adapter_declares_what_the_old_dispatcher_did_and_the_warning_says_what_to_do():
    old = _DispatchCombineOnly(4)
    with pytest.warns(DeprecationWarning) as record:
        layer = moeflow.MoE(dim=8, hidden=8, num_experts=4, dispatcher=old)
    (message,) = [str(r.message) for r in record if issubclass(r.category, DeprecationWarning)]
    assert message == ("_DispatchCombineOnly implements dispatch/combine only; the Dispatcher protocol is now "
                       "run(x_TD, routing, experts, *, capacity_factor, overlap_degree, parallel) plus collective "
                       "and layout (moeflow.dispatch.protocol). It is adapted for one release.")
    adapter = layer.dispatcher
    assert isinstance(adapter, DispatchCombineAdapter)
    assert adapter.num_experts == 4 and adapter.collective is False and adapter.layout == ExpertLayout.whole(4)
    old.collective = True  # an old dispatcher that said it was a collective stays one
    assert DispatchCombineAdapter(old, 4).collective is True


def test_expert_layout_reads_slots_and_refuses_mismatched_lengths():
    block = ExpertLayout(num_experts=8, slot_experts=(4, 5), slot_primary=(True, True))
    assert block.offset == 4 and block.slot_parts == (0, 0)
    replicas = ExpertLayout(num_experts=8, slot_experts=(0, 3, 6), slot_primary=(True, False, True))
    assert replicas.offset is None
    sliced = ExpertLayout(num_experts=2, slot_experts=(0, 1), slot_primary=(False, False), hidden_shards=2,
                          slot_parts=(1, 1))
    assert sliced.offset is None
    with pytest.raises(ValueError, match="differ in length"):
        ExpertLayout(num_experts=8, slot_experts=(0, 1), slot_primary=(True,))


def test_the_layer_reads_the_layout_of_its_dispatcher(gen):
    layer = make_layer(gen, num_experts=6)
    assert layer.expert_slots() == (list(range(6)), [True] * 6)
    assert layer.hidden_shards() == (1, [0] * 6) and layer.expert_range() == (0, 6)


def _fresh_import(name: str) -> object:
    sys.modules.pop(name, None)
    return importlib.import_module(name)


@pytest.mark.parametrize("module", ["moeflow.storage.train", "moeflow.storage.bench", "moeflow.models.hf"])
def test_pre_release_module_aliases_are_gone(module):
    """No version was released before these modules moved: no alias keeps the old path."""
    with pytest.raises(ModuleNotFoundError):
        _fresh_import(module)


def test_pre_release_parallel_names_are_gone():
    import moeflow.parallel as par

    for name in ("AllToAllDispatcher", "AllToAllPlan", "NoSuchName"):
        with pytest.raises(AttributeError):
            getattr(par, name)
    assert issubclass(par.ExchangePlan, moeflow.DispatchPlan)
