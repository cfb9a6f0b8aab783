"""``tutel.impls`` stand-in: ``moe_layer``, ``fast_dispatch`` and ``losses``."""

from moeflow.compat.tutel.impls import fast_dispatch, losses, moe_layer

__all__ = ["fast_dispatch", "losses", "moe_layer"]
