"""Expert FFNs on grouped tokens with 3-D weights ``[E, ...]``; user modules through a protocol."""

from moeflow.experts.ffn import DenseFFN, Experts, GroupedExperts, ModuleExperts, activate

__all__ = ["Experts", "GroupedExperts", "ModuleExperts", "DenseFFN", "activate"]
