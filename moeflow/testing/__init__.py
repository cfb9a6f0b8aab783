"""Reference MoE implementations: the yardsticks for tests and the baselines for benchmarks.

- ``reference_routing``: the router's math written out token by token, independent of the
  vectorised code in ``moeflow.routing``.
- ``loop_moe``: a per-expert Python loop (HF eager style): obviously correct, every capacity
  mode and drop policy.
- ``einsum_moe``: the GShard one-hot einsum MoE (the fairseq/Tutel lineage): dispatch and combine
  as dense ``[T, E, C]`` tensors; fixed capacity (and dropless by padding every expert to the
  busiest one).
"""

from moeflow.testing.reference import einsum_moe, loop_moe, reference_routing

__all__ = ["reference_routing", "loop_moe", "einsum_moe"]
