"""Every benchmark of moeflow, each the candidate beside its baselines in one run: the layer
(``layer``, ``moeflow bench``) and its memory (``memory``), expert parallelism (``parallel``,
``moeflow bench --nproc``), tiered storage (``storage``, ``moeflow infer --bench``), the Hugging
Face blocks (``hf``), text generation against transformers' ``generate`` (``generate``) and its
CPU expert products over packed weights (``expert_products``), the
GPU kernels and overlap (``gpu_kernels``, ``gpu_overlap``), the all-to-all link model
(``calibrate``), the per-stage profile of one layer (``stage_profile``) and the GPU acceptance
run that runs all of a GPU machine's checks in one command (``gpu_check``). The ``bench/`` folder at the top of the repository holds
their results and launchers for the documented commands."""

from moeflow.bench.layer import BenchConfig, format_table, run_layer_bench

__all__ = ["BenchConfig", "run_layer_bench", "format_table"]
