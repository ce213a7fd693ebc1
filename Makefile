# One entry point for installing, serving and testing pagedserve.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install up test check unit-tests lint ruff types docs docs-check bench

# Serving needs only the package itself (torch, no triton or test tools); tests add the rest.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build on a machine without CUDA (ops/install_torch.py says from where).
	$(PY) ops/install_torch.py
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e '.[test,bench,dev]'
	touch $@

install: $(VENV)/.installed

up: install
	@echo "the pagedserve command: $(VENV)/bin/pagedserve (or: source $(VENV)/bin/activate)"
	$(VENV)/bin/pagedserve up $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder $(ARGS)

# The inner loop: lint, types and every test that starts no server, spread over the cores; the type
# check runs beside the tests, on what their workers leave idle.
check: ruff
	$(MAKE) -j2 --no-print-directory types unit-tests

unit-tests: $(VENV)/.installed-test
	$(PY) -m pytest -q -m "not slow" -n auto $(ARGS)

lint: ruff types

ruff: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

types: $(VENV)/.installed-test
	$(VENV)/bin/mypy

docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8080

docs-check: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $$(mktemp -d)

bench: $(VENV)/.installed-test
	$(PY) benchmarks/scheduler_bench.py
