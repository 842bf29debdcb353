# gptrain: `make train` and `make test` set up .venv when missing, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Users get the newest torch their platform offers (CUDA builds on GPU machines); CI pins a CPU build
# through TORCH_SPEC (see .ci/run).
TORCH_SPEC ?=
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast lint format bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(BIN)/python -m pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

train: setup
	$(BIN)/gptrain train --config configs/default.toml $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

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
