"""``python bench/storage_bench.py [--layers 8] [--threads 1] [--json bench/results/storage.json]``:
ring-memory inference from disk, prefetch vs synchronous loading vs all in memory.

Also reachable as ``moeflow infer --bench``. What is measured: see ``moeflow.bench.storage``.
"""

from moeflow.bench.storage import main

if __name__ == "__main__":
    raise SystemExit(main())
