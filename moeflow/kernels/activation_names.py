"""The expert activations by name: the one vocabulary of moeflow (``ExpertsConfig.activation``,
the torch references, the Triton kernels' codes, ``moeflow bench --activation``).

    Activation   the names, as a ``typing.Literal`` (configs validate against it)
    ACTIVATIONS  the same names as a tuple (derived from ``Activation``)
    GATED        the gated kinds: ``act(gate) * up`` over the two halves of ``w_in``'s columns
    ELEMENTWISE  the elementwise function each kind applies (to the gate half when gated)

A leaf module that imports nothing of moeflow: ``moeflow.kernels.activation`` (the public home of
these names, which re-exports them) loads the Triton kernels, and those read the names too, so
defining them beside the ops would make an import circle.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["Activation", "ACTIVATIONS", "GATED", "ELEMENTWISE"]

Activation = Literal["swiglu", "geglu", "relu", "gelu", "silu"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)
GATED: frozenset[str] = frozenset({"swiglu", "geglu"})
ELEMENTWISE: dict[str, str] = {"swiglu": "silu", "geglu": "gelu", "relu": "relu", "gelu": "gelu", "silu": "silu"}
