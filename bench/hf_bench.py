"""``python bench/hf_bench.py [...]``: Hugging Face MoE blocks vs moeflow, ``moeflow.bench.hf``;
the report goes to bench/results/hf_bench.json unless ``--json`` says otherwise."""
from pathlib import Path

from moeflow.bench.hf import main

if __name__ == "__main__":
    main(default_json=Path(__file__).parent / "results" / "hf_bench.json")
