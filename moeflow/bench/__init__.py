"""The benchmarks ``moeflow bench`` runs: the MoE layer beside the GShard einsum, the per-expert
loop and the expert-GEMM floor (``layer``) with its peak memory (``memory``), expert parallelism
over N local ranks (``parallel``, ``moeflow bench --nproc``) and the all-to-all link measurement
behind ``moeflow a2a-model --calibrate`` (``calibrate``). Every other benchmark (generation,
storage, the Hugging Face blocks, the GPU acceptance run, ...) is the harness in the repository's
top-level ``bench/`` folder, outside the wheel."""

from moeflow.bench.layer import BenchConfig, format_table, run_layer_bench

__all__ = ["BenchConfig", "run_layer_bench", "format_table"]
