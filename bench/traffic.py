"""``python bench/traffic.py [...]``: the memory-traffic count of one MoE layer fwd+bwd,
``moeflow.bench.traffic``; the report goes to bench/results/traffic.json unless ``--json`` says
otherwise."""
from pathlib import Path

from moeflow.bench.traffic import main

if __name__ == "__main__":
    raise SystemExit(main(default_json=Path(__file__).parent / "results" / "traffic.json"))
