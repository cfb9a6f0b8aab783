#!/usr/bin/env bash
# The core-layer speed targets (issue: core MoE layer), each one `moeflow bench` run that puts
# moeflow beside the einsum and loop references and the expert-GEMM floor in one process.
# Writes bench/results/core_*.json and prints the tables; record the figures in docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MOEFLOW:-.venv/bin/moeflow}
REPEATS=${REPEATS:-9}
# 1) capacity mode: target moeflow forward+backward <= 1.15x the floor
$BIN bench --tokens 4096 --dim 512 --hidden 1024 --experts 8 --top-k 2 --capacity-factor 1.0 \
  --threads 2 --repeats "$REPEATS" --json bench/results/core_cf1.json
# 2) dropless: target <= 1.20x the floor
$BIN bench --tokens 4096 --dim 512 --hidden 1024 --experts 8 --top-k 2 --capacity-factor 0 \
  --threads 2 --repeats "$REPEATS" --json bench/results/core_dropless.json
# 3) many small experts, k=1: target moeflow >= 5x faster than the einsum reference
$BIN bench --tokens 8192 --dim 256 --hidden 512 --experts 64 --top-k 1 --capacity-factor 1.0 \
  --threads 2 --repeats "$REPEATS" --json bench/results/core_e64.json
