# One entry point for installing, serving and testing pagedserve.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install up test bench

# Serving needs only the package itself (torch, no triton or test tools); tests add the rest.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build on a machine without CUDA (ops/install_torch.py says from where).
	$(PY) ops/install_torch.py
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

install: $(VENV)/.installed

up: install
	@echo "the pagedserve command: $(VENV)/bin/pagedserve (or: source $(VENV)/bin/activate)"
	$(VENV)/bin/pagedserve up $(ARGS)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q $(ARGS)

bench: $(VENV)/.installed-test
	$(PY) benchmarks/scheduler_bench.py
