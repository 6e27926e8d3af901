# One entry point for a fresh machine: `make test` creates .venv, installs everything
# (torch first, from the CPU wheel, so no CUDA build is pulled) and runs the tests.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test lint bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

lint: install
	$(BIN)/ruff check protocol learner actors proxy tests bench

test: install lint
	$(BIN)/python -m pytest

bench: install
	$(BIN)/python bench/queue.py
	$(BIN)/python bench/learner.py
