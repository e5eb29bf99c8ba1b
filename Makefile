# bloomery: the two commands of a fresh machine are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BLOOMERY := $(VENV)/bin/bloomery
export BLOOMERY_MODELS ?= $(HOME)/.cache/bloomery/models

.PHONY: venv models demo test test-fast clean

$(VENV)/.stamp: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.stamp

# Real test checkpoints (SmolLM2-135M-Instruct and its ModelOpt exports, tiny random models),
# built into $(BLOOMERY_MODELS), outside the repository; rebuilt only when the recipe changes.
models: venv
	$(PY) -m bloomery.tools.models

demo: venv
	$(PY) -m bloomery.tools.models --only smollm2-135m/nvfp4
	$(BLOOMERY) inspect $(BLOOMERY_MODELS)/smollm2-135m/nvfp4

test: models
	$(PY) -m pytest -q

# The tests that need no test checkpoints.
test-fast: venv
	$(PY) -m pytest -q -m "not models"

clean:
	rm -rf $(VENV) build *.egg-info
