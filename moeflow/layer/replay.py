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
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

__all__ = ["RoutingTape", "record_routing", "replay_routing"]


class RoutingTape:
    """Recorded expert choices: ``calls[layer_name] = [ids_TK of call 0, call 1, ...]`` (int64, CPU)."""

    def __init__(self, calls: dict[str, list[torch.Tensor]] | None = None) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {k: list(v) for k, v in (calls or {}).items()}
        self._cursor: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"RoutingTape({len(self.calls)} layers, {sum(map(len, self.calls.values()))} calls)"

    def record(self, layer: str, ids_TK: torch.Tensor) -> None:
        self.calls.setdefault(layer, []).append(ids_TK.detach().to("cpu", torch.int64).clone())

    def next(self, layer: str) -> torch.Tensor:
        """The next recorded call of ``layer`` (ValueError when the tape has no more for it)."""
        recorded = self.calls.get(layer)
        if recorded is None:
            raise ValueError(f"the routing tape has no calls for MoE layer {layer!r}; recorded: {sorted(self.calls)}")
        i = self._cursor.get(layer, 0)
        if i >= len(recorded):
            raise ValueError(f"MoE layer {layer!r} is called more often than recorded ({len(recorded)} calls)")
        self._cursor[layer] = i + 1
        return recorded[i]

    def rewind(self) -> None:
        self._cursor.clear()

    def save(self, path: str | os.PathLike) -> Path:
        """Write the tape as safetensors (``<layer>#<call>`` keys)."""
        from safetensors.torch import save_file

        tensors = {f"{name}#{i}": ids.contiguous() for name, calls in self.calls.items() for i, ids in enumerate(calls)}
        save_file(tensors, str(path), metadata={"format": "moeflow-routing-tape/1"})
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingTape":
        from safetensors import safe_open

        calls: dict[str, dict[int, torch.Tensor]] = {}
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != "moeflow-routing-tape/1":
                raise ValueError(f"{path}: not a moeflow routing tape")
            for key in f.keys():
                name, _, i = key.rpartition("#")
                calls.setdefault(name, {})[int(i)] = f.get_tensor(key)
        return cls({name: [c[i] for i in sorted(c)] for name, c in calls.items()})


def _moe_layers_named(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from moeflow.layer.moe import MoE

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
        m._routing_tape = (mode, name, tape)
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
