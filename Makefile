# gptrain: `make train` and `make test` set up .venv when missing, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Users get the newest torch their platform offers (CUDA builds on GPU machines). CI (.ci/run) runs
# `make test` and `make test-benchmarks` the same way, then everything again in a second venv with
# the oldest torch pyproject.toml admits: make test-all VENV=.cache/venv-oldest
# TORCH_SPEC=torch==X.Y.Z (installed with the project, so no other dependency can move it).
TORCH_SPEC ?=
STAMP := $(VENV)/.installed

.PHONY: setup train test test-benchmarks test-all test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]" $(TORCH_SPEC)
	touch $(STAMP)

train: setup
	$(BIN)/gptrain train --config configs/default.toml $(ARGS)

# Two pytest workers (pytest-xdist), a test file each at a time (module fixtures are built once),
# the longest files first (tests/conftest.py's order, kept by --no-loadscope-reorder), one thread
# per process: on 2 cores the workers fill both (times: benchmarks/RESULTS.md, "Test-suite time").
# TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# `make test`: every proof of gptrain. The CPU dry runs of benchmarks/ scripts and the short chaos
# drills (marker `benchmark`: their scripts prove the same at full size) are `make test-benchmarks`;
# `make test-all` runs both in one suite. CI runs everything.
test: setup
	$(PYTEST) -m "not benchmark" $(ARGS)

test-benchmarks: setup
	$(PYTEST) -m benchmark $(ARGS)

test-all: setup
	$(PYTEST) $(ARGS)

test-fast: setup
	$(PYTEST) -m "not slow and not benchmark" $(ARGS)

lint: setup
	$(BIN)/ruff check gptrain tests benchmarks
	$(BIN)/ruff format --check gptrain tests benchmarks

format: setup
	$(BIN)/ruff format gptrain tests benchmarks
	$(BIN)/ruff check --fix gptrain tests benchmarks

bench: setup
	$(BIN)/gptrain bench --config configs/bench.toml --matrix

clean:
	rm -rf runs .pytest_cache
