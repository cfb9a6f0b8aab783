"""Compatibility entry points: run code written for other MoE libraries on moeflow.

``moeflow.compat.tutel``: Tutel's ``moe_layer`` and ``fast_dispatch`` surface
(``from moeflow.compat.tutel import moe as tutel_moe``).
"""

__all__ = ["tutel"]
