"""The dispatcher protocol, the one seam between the layer and parallelism
(``moeflow.dispatch.protocol``): what the layer reads of a dispatcher, the layout it declares,
what it refuses, and that the pre-release names of moved modules and classes are gone (no
version was released with them)."""

from __future__ import annotations

import importlib
import re
import sys
import warnings

import pytest

import moeflow
from moeflow.dispatch import LocalDispatcher
from moeflow.types import ExpertLayout

from helpers import make_layer

pytestmark = pytest.mark.reference


class _DispatchCombineOnly:
    """A dispatcher written to the protocol before ``run``: ``dispatch`` and ``combine`` only."""

    def dispatch(self, x_TD, routing, *, capacity_factor):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")

    def combine(self, expert_out, plan):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")


def test_local_dispatcher_declares_the_protocol():
    disp = LocalDispatcher(num_experts=5)
    assert isinstance(disp, moeflow.Dispatcher) and disp.collective is False
    assert disp.layout == ExpertLayout.whole(5) and disp.layout.offset == 0


def test_something_else_as_dispatcher_is_a_type_error():
    """Only a ``Dispatcher`` is taken: anything else, the older ``dispatch``/``combine`` pair
    included (no release ever took it) and either half of it, is the same ``TypeError`` naming
    the argument and the type, with no warning first."""
    class OnlyDispatch:
        def dispatch(self, x_TD, routing, *, capacity_factor):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

    class OnlyCombine:
        def combine(self, expert_out, plan):  # type: ignore[no-untyped-def]
            raise AssertionError("never called")

    for other in (object(), _DispatchCombineOnly(), OnlyDispatch(), OnlyCombine()):
        message = (f"dispatcher must implement moeflow.Dispatcher (run, collective, layout, num_experts), "
                   f"got {type(other).__name__}")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
                moeflow.MoE(dim=8, hidden=8, num_experts=4, dispatcher=other)
    # a dispatcher that implements the protocol is taken as it is
    local = LocalDispatcher(num_experts=4)
    assert moeflow.MoE(dim=8, hidden=8, num_experts=4, dispatcher=local).dispatcher is local


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
