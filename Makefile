# Two commands on a fresh machine: `make export` (the main job) and `make test`.
# Each creates the virtual environment and installs the project on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: export test lint bench mutation

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

export: $(STAMP)
	$(BIN)/python -m codegen export $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Modules spread over one worker per core (at most 4: each holds jax, torch and its models);
# the 15 slowest tests are listed at the end (docs/testing.md).
test: lint
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder --durations 15 $(ARGS)

# Mutation testing (docs/mutation.md), slow, not in CI: all modules, or MODULE=ref/cache.py.
mutation: $(STAMP)
	$(BIN)/pip install -q mutmut==3.8.1
	$(BIN)/python tools/mutation.py $(MODULE) $(ARGS)
