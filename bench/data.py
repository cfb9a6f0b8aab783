"""``python bench/data.py [...]``: one's own data, measured (``moeflow.bench.data``):
prepare-data throughput, the loader's resident memory against its window, its share of a
2-rank step; the report goes to bench/results/data.json unless ``--json`` says otherwise."""
from pathlib import Path

from moeflow.bench.data import main

if __name__ == "__main__":
    raise SystemExit(main(default_json=Path(__file__).parent / "results" / "data.json"))
