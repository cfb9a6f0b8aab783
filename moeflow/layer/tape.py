"""The data of router replay (``moeflow.layer.replay``): a ``RoutingTape`` holds, per MoE layer
(by module name), the ``ids_TK`` of each call in call order; a ``TapeBinding`` attaches a tape
to one layer while recording or replaying."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

__all__ = ["RoutingTape", "TapeBinding"]


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


@dataclass(frozen=True)
class TapeBinding:
    """A tape attached to one MoE layer (``layer._routing_tape``) while a ``record_routing`` or
    ``replay_routing`` block is active: the layer asks it for forced ids before routing and
    hands it the chosen ids after."""

    mode: Literal["record", "replay"]
    layer: str
    tape: RoutingTape

    def forced_ids(self) -> torch.Tensor | None:
        """The recorded ``ids_TK`` this call must use (replay), else None."""
        return self.tape.next(self.layer) if self.mode == "replay" else None

    def chosen(self, ids_TK: torch.Tensor) -> None:
        """Record the call's choice (record mode)."""
        if self.mode == "record":
            self.tape.record(self.layer, ids_TK)
