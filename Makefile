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

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/trm_step.py
