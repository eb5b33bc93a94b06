# The README's two commands: `make serve` and `make test`; `make test-fast` for the edit loop.
VENV := .venv
PY := $(VENV)/bin/python
TOPOLOGY ?= topologies/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install serve test test-fast engine-checks lint typecheck check

install:
	@bash scripts/install.sh

# `disagg up` builds the embedded tiny model on first use.
serve: install
	$(PY) -m disagg up $(TOPOLOGY)

# Everything: the tests that start no vLLM on four pytest-xdist workers (as test-fast, the slow
# ones included), then those that do (`e2e`, `engine`) in one process, in order: their session
# fixtures start each deployment once and never more than two engines at a time.
test: install
	@bash scripts/system-deps.sh
	$(PY) -m ruff check disagg connectors tests benchmarks scripts harness
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	@VENV=$(VENV) bash scripts/engine-package-checks.sh
	$(PY) -m pytest -m "not e2e" -n 4 $(PYTEST_ARGS)
	$(PY) -m pytest -m e2e $(PYTEST_ARGS)

# The edit loop: the same checks and tests less everything that runs vLLM (tests marked
# `e2e` or `engine` in pyproject.toml), the few that wait out a shipped default in real time
# (`slow`; the same is checked in virtual time), the engine package checks and system-deps.sh
# (without iproute2/sshd the tests that need them skip and say why). Four pytest-xdist workers,
# since the tests mostly wait; tests/net runs on one of them (tests/xdist_schedule.py).
test-fast: install
	$(PY) -m ruff check disagg connectors tests benchmarks scripts harness
	$(VENV)/bin/lint-imports
	$(PY) -m mypy
	$(PY) -m pytest -m "not e2e and not engine and not slow" -n 4 $(PYTEST_ARGS)

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
