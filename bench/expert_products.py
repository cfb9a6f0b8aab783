"""``python bench/expert_products.py [...]``: the expert products of a CPU decode step over the
weights themselves and over packed copies, ``moeflow.bench.expert_products``; the report goes to
bench/results/expert_products.json unless ``--json`` says otherwise."""
from pathlib import Path

from moeflow.bench.expert_products import main

if __name__ == "__main__":
    raise SystemExit(main(default_json=Path(__file__).parent / "results" / "expert_products.json"))
