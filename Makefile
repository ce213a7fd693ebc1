# One entry point for installing, serving and testing pagedserve.
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: install up test bench

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: the CPU build on a machine without CUDA (ops/install_torch.py says from where).
	$(PY) ops/install_torch.py
	$(PY) -m pip install -q -e '.[worker,test,bench]'
	touch $@

install: $(VENV)/.installed

up: install
	$(VENV)/bin/pagedserve up $(ARGS)

test: install
	$(PY) -m pytest -q $(ARGS)

bench: install
	$(PY) benchmarks/scheduler_bench.py
