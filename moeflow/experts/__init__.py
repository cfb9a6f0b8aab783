"""Expert FFNs on grouped tokens with 3-D weights ``[E, ...]``; user modules through a protocol."""

from moeflow.experts.ffn import DenseFFN, Experts, GroupedExperts, ModuleExperts, activate
from moeflow.experts.fp8_weights import FP8WeightExperts, quantize_experts_fp8

__all__ = ["Experts", "GroupedExperts", "ModuleExperts", "DenseFFN", "activate", "FP8WeightExperts",
           "quantize_experts_fp8"]
