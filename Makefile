# `make test` sets up .venv on a fresh machine and runs every check; `make demo` comes with the controller.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint typecheck imports docs pytest bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml setup.py muster/net/shim/netshim.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check muster tests bench examples docs
	$(BIN)/ruff format --check muster tests bench examples docs

typecheck: setup
	$(BIN)/mypy

imports: setup
	$(BIN)/lint-imports

# The documentation site, strictly: a broken link, a missing page or snippet fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet -d site

# Two workers (pytest-xdist); the namespace-rig tests keep to one of them (tests/conftest.py).
PYTEST_WORKERS ?= 2
pytest: setup
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=15

test: lint typecheck imports docs pytest

# A controller on SQLite in a temporary data dir, two local agents, the DDP example.
demo: setup
	$(BIN)/muster demo

bench: setup
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/scheduler.py
	$(BIN)/python bench/store.py
	$(BIN)/python bench/launch.py
	$(BIN)/python bench/window.py
	$(BIN)/python bench/logs.py
	$(BIN)/python bench/control_plane.py
	$(BIN)/python bench/net.py
	$(BIN)/python bench/relay.py
	$(BIN)/python bench/star.py
	$(BIN)/python bench/train_hetero.py
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis *.egg-info site
