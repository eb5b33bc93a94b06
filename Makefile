# The README's two commands: `make serve` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
TOPOLOGY ?= topologies/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install serve test engine-checks lint typecheck check

install:
	@bash scripts/install.sh

# `disagg up` builds the embedded tiny model on first use.
serve: install
	$(PY) -m disagg up $(TOPOLOGY)

test: install
	@bash scripts/system-deps.sh
	$(PY) -m ruff check disagg connectors tests benchmarks scripts harness
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	@VENV=$(VENV) bash scripts/engine-package-checks.sh
	$(PY) -m pytest $(PYTEST_ARGS)

# SGLang's and LMCache's own parsers on our argv/YAML, in small side directories
# (.disagg/pkgcheck/) next to .venv; `test` runs this too.
engine-checks: install
	@VENV=$(VENV) bash scripts/engine-package-checks.sh

lint: install
	$(PY) -m ruff check disagg connectors tests benchmarks scripts harness
	$(VENV)/bin/lint-imports
	$(PY) -m mypy

# mypy --strict on disagg/ and connectors/ ([tool.mypy] in pyproject.toml; ~15 s cold).
typecheck: install
	$(PY) -m mypy

check: install
	$(PY) -m disagg check topologies/*.yaml
