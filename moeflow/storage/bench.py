"""Deprecated alias of ``moeflow.bench.storage`` (benchmarks live in ``moeflow/bench/``). Kept
for one release; import from ``moeflow.bench.storage`` instead."""

import warnings

from moeflow.bench.storage import StorageBenchConfig, format_storage_report, run_storage_bench

__all__ = ["StorageBenchConfig", "run_storage_bench", "format_storage_report"]

warnings.warn("moeflow.storage.bench is deprecated and will be removed in the next release: import from "
              "moeflow.bench.storage", DeprecationWarning, stacklevel=2)
