"""Benchmarks that `moeflow bench` runs: the candidate beside its baselines in one process."""

from moeflow.bench.layer import BenchConfig, format_table, run_layer_bench

__all__ = ["BenchConfig", "run_layer_bench", "format_table"]
