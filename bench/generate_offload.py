"""``python bench/generate_offload.py [...]``: generation with the experts on disk, moeflow's
expert cache vs Hugging Face accelerate's disk offload at the same memory budget (and moeflow
in memory), ``moeflow.bench.generate_offload``; the report goes to
bench/results/generate_offload.json unless ``--json`` says otherwise."""
from pathlib import Path

from moeflow.bench.generate_offload import main

if __name__ == "__main__":
    raise SystemExit(main(default_json=Path(__file__).parent / "results" / "generate_offload.json"))
