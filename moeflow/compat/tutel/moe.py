"""``tutel.moe`` stand-in: ``from moeflow.compat.tutel import moe as tutel_moe``."""

from moeflow.compat.tutel.impls.fast_dispatch import (
    extract_critical,
    fast_cumsum_sub_one,
    fast_decode,
    fast_dispatcher,
    fast_encode,
)
from moeflow.compat.tutel.impls.moe_layer import MOELayer, moe_layer

top_k_routing = extract_critical  # Tutel's name for it in ``tutel.moe`` (helloworld_from_scratch)

__all__ = [
    "moe_layer",
    "MOELayer",
    "fast_encode",
    "fast_decode",
    "extract_critical",
    "top_k_routing",
    "fast_cumsum_sub_one",
    "fast_dispatcher",
]
