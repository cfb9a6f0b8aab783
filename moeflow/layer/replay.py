"""Router replay: record the experts every MoE layer chose, and make a later forward use them.

Reinforcement-learning fine-tuning computes the policy update with a second forward over the
rollout's tokens; if routing changed in between (other weights, noise, a different batch
composition under capacity), the update optimises a different network than the one that
produced the samples. Replay pins the choice of experts to the recorded one while everything
else is recomputed: the router's weights for the replayed experts come from the current logits
(so the router still gets gradients). Everything that counts assignments (the count term of the
load-balance loss, the ``load`` loss without noise, ``router.load_counts`` for the aux-loss-free
bias, ``layer.last_counts_E``) counts the replayed choice; the probability terms and the z-loss
use the current logits.

    with moeflow.record_routing(model) as tape:
        rollout = model(x)
    tape.save("routing.safetensors")            # optional
    with moeflow.replay_routing(model, tape):
        logits = model(x)                       # same experts per token as the rollout

A tape holds, per MoE layer (by module name), the ``ids_TK`` of each call in call order; a
replayed layer takes its calls in the same order. With expert parallelism each rank records and
replays its own tokens. Replay validates every call (shape, range: one host sync per call).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from moeflow.layer.moe import MoE
from moeflow.layer.tape import RoutingTape, TapeBinding

__all__ = ["RoutingTape", "record_routing", "replay_routing"]


def _moe_layers_named(model: nn.Module) -> list[tuple[str, MoE]]:
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError(f"model contains no moeflow.MoE layer: {type(model).__name__}")
    return layers


@contextlib.contextmanager
def _attach(model: nn.Module, mode: str, tape: RoutingTape) -> Iterator[RoutingTape]:
    layers = _moe_layers_named(model)
    busy = [name for name, m in layers if m._routing_tape is not None]
    if busy:
        raise RuntimeError(f"MoE layers {busy[:3]} are already recording or replaying; nest no tapes")
    for name, m in layers:
        m._routing_tape = TapeBinding(mode, name, tape)  # type: ignore[arg-type]
    try:
        yield tape
    finally:
        for _, m in layers:
            m._routing_tape = None


def record_routing(model: nn.Module, tape: RoutingTape | None = None):  # type: ignore[no-untyped-def]
    """Context manager: every call of every MoE layer of ``model`` appends its chosen experts
    to ``tape`` (a new ``RoutingTape`` by default), which it yields."""
    return _attach(model, "record", tape if tape is not None else RoutingTape())


def replay_routing(model: nn.Module, tape: RoutingTape):  # type: ignore[no-untyped-def]
    """Context manager: every call of every MoE layer of ``model`` uses the next recorded
    choice of experts from ``tape`` (starting from its first call)."""
    if not isinstance(tape, RoutingTape):
        raise TypeError(f"tape must be a RoutingTape, got {type(tape).__name__}")
    tape.rewind()
    return _attach(model, "replay", tape)
