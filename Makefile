# The README's two commands: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
TOPOLOGY ?= topologies/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install serve test lint check

install:
	@bash scripts/install.sh

# `disagg up` builds the embedded tiny model on first use.
serve: install
	$(PY) -m disagg up $(TOPOLOGY)

test: install
	@bash scripts/system-deps.sh
	$(PY) -m ruff check disagg connectors tests benchmarks scripts
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check disagg connectors tests benchmarks scripts

check: install
	$(PY) -m disagg check topologies/*.yaml
