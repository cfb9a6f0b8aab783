"""moeflow's benchmark harness, outside the package (not in the wheel).

Run a benchmark from the repository root as a module: ``python -m bench.generate``,
``python -m bench.gpu_check --smoke`` (moeflow need not be installed: the checkout is on the
path). Each puts moeflow beside the peers a user would pick instead, on the same weights and
inputs in one run, and writes its report under ``bench/results/`` unless ``--json`` says
otherwise. ``moeflow bench`` (the layer and expert parallelism) lives in ``moeflow.bench``.
"""
