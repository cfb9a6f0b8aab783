"""``python bench/generate.py [...]``: moeflow generate vs transformers' generate on the same
weights, ``moeflow.bench.generate``; the report goes to bench/results/generate.json unless
``--json`` says otherwise."""
from pathlib import Path

from moeflow.bench.generate import main

if __name__ == "__main__":
    raise SystemExit(main(default_json=Path(__file__).parent / "results" / "generate.json"))
