# `make demo` and `make test` do all set-up themselves on a fresh clone.
PYTHON ?= python3
VENV := .venv

LOCK := requirements.lock
PIP := pip==26.3
PIP_TOOLS := pip-tools==7.6.2

# The exact versions of requirements.lock (pyproject.toml's `test` extra resolved), then jaxport itself.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(PIP)
	$(VENV)/bin/pip install -q -r $(LOCK)
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# requirements.lock anew: the newest versions pyproject.toml's ranges allow, through this machine's pip
# configuration (so torch stays the CPU build); pip-tools runs from a venv of its own, outside the locked one.
lock:
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q $(PIP) $(PIP_TOOLS)
	.lock-venv/bin/pip-compile --upgrade --quiet --extra test --strip-extras --no-emit-index-url \
		--no-emit-find-links -o $(LOCK) pyproject.toml
	rm -rf .lock-venv

.PHONY: demo test check lint bench lock
demo: $(VENV)/.installed
	$(VENV)/bin/jaxport trm demo

# Two workers, each test module on one of them (module fixtures build once): most tests wait on
# `jaxport` subprocesses or compile, so two halves overlap well even on two cores.
test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile

# The edit loop's check, under 3 minutes on two cores: the linters, then the tests not marked `slow` (those
# that compile big programs, start `jaxport` processes or servers, or train). `make test` stays the whole suite.
check: lint
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/trm_step.py
