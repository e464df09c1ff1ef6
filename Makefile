# `make demo` and `make test` do all set-up themselves on a fresh clone.
PYTHON ?= python3
VENV := .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: demo test lint bench
demo: $(VENV)/.installed
	$(VENV)/bin/jaxport trm demo

# Two workers, each test module on one of them (module fixtures build once): most tests wait on
# `jaxport` subprocesses or compile, so two halves overlap well even on two cores.
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/trm_step.py
