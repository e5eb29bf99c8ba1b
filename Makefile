# bloomery: the two commands of a fresh machine are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BLOOMERY := $(VENV)/bin/bloomery
export BLOOMERY_MODELS ?= $(HOME)/.cache/bloomery/models

.PHONY: venv models demo test test-fast gates clean

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

# SmolLM2-135M-Instruct's real ModelOpt NVFP4 export, prepared into an artifact (outside the
# repository) and asked one question on the CPU; the decode speed goes to stderr.
DEMO_ARTIFACT ?= $(BLOOMERY_MODELS)/../artifacts/smollm2-135m-nvfp4
demo: venv
	$(PY) -m bloomery.tools.models --only smollm2-135m/nvfp4
	$(BLOOMERY) prepare $(BLOOMERY_MODELS)/smollm2-135m/nvfp4 $(DEMO_ARTIFACT)
	$(BLOOMERY) run $(DEMO_ARTIFACT) --prompt "What is the capital of France?"

test: models
	$(PY) -m pytest -q

# The tests that need no test checkpoints.
test-fast: venv
	$(PY) -m pytest -q -m "not models"

# The numerical gates: every gated model and format through prepare and the NumPy executor against
# the float32 oracle, plus tp 2 against tp 1 (tools/gates.py, bands in specs/bands.yaml, docs/gates.md).
# Artifacts and oracle logits are cached under ~/.cache/bloomery/{gates,oracle}.
gates: models
	$(PY) -m bloomery.tools.gates

clean:
	rm -rf $(VENV) build *.egg-info
