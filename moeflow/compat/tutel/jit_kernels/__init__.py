"""``tutel.jit_kernels`` stand-in: only the gating helpers (``gating.fast_cumsum_sub_one``)."""

from moeflow.compat.tutel.jit_kernels import gating

__all__ = ["gating"]
