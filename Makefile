# `make demo` and `make test` do all set-up themselves on a fresh clone.
PYTHON ?= python3
VENV := .venv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(VENV)/bin/jaxport trm demo

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/trm_step.py
