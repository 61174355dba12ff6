"""``--dtype auto`` (issue 42, ``model/dtype_choice.py``): bf16 on CUDA and where this CPU computes it faster, fp32 on
CPUs without fast bf16 and on the reference lane, each with its reason. This file runs in both CPU lanes of
``make test`` (AVX2-held and ``GRSERVE_CPU_ISA=reference``), where auto must give fp32."""

import pytest
import torch

from grserve.config import ModelConfig
from grserve.model import dtype_choice, load_model, resolve_dtype
from grserve.model.cpu_support import cpu_support
from grserve.model.dtype_choice import MIN_SPEEDUP, choice, choose_dtype


def test_auto_is_the_default_everywhere():
    """Every mode's ModelConfig, the offline Recommender / LLM (their ModelConfig), grserve recommend (its flags) and
    the benches with a dtype flag default to auto."""
    from grserve_bench.ranking import RankingBenchConfig
    from grserve_bench.retrieval import RetrievalBenchConfig

    from grserve.config import LLMServeConfig, RankingServeConfig, ServeConfig

    assert ModelConfig().dtype == "auto"
    assert ServeConfig().model.dtype == LLMServeConfig().model.dtype == RankingServeConfig().model.dtype == "auto"
    assert RankingBenchConfig().dtype == "auto" and RetrievalBenchConfig().dtype == "auto"


def test_a_named_dtype_is_used_as_asked():
    assert choose_dtype("float32", "cpu") == ("float32", "asked for")
    assert choose_dtype("bfloat16", "cpu") == ("bfloat16", "asked for")


def test_cuda_gets_bf16():
    name, reason = choose_dtype("auto", "cuda:0")
    assert name == "bfloat16" and "CUDA" in reason


def test_this_cpu_gets_what_its_support_and_trial_say():
    s = cpu_support()
    name, reason = choose_dtype("auto", "cpu")
    assert reason.startswith("auto, ")
    if not s.fast_paths:
        assert (name, reason) == ("float32", "auto, the reference lane (GRSERVE_CPU_ISA=reference) runs fp32")
    elif not s.onednn_bf16:  # an AVX2-only CPU, or the AVX2 lane
        assert name == "float32" and "no fast bf16" in reason
    else:
        speedup = dtype_choice.bf16_speedup()[2]
        assert name == ("bfloat16" if speedup >= MIN_SPEEDUP else "float32")
        assert f"{speedup:.1f}x" in reason or f"{speedup:.2f}x" in reason


def test_a_cpu_whose_trial_says_bf16_is_not_faster_gets_fp32(monkeypatch):
    if not (cpu_support().fast_paths and cpu_support().onednn_bf16):
        pytest.skip("fp32 already: no fast bf16 here")
    monkeypatch.setattr(dtype_choice, "bf16_speedup", lambda: (1.0, 1.0, 1.0))
    name, reason = choose_dtype("auto", "cpu")
    assert name == "float32" and "not faster" in reason


def test_a_failing_trial_gives_fp32(monkeypatch):
    if not (cpu_support().fast_paths and cpu_support().onednn_bf16):
        pytest.skip("fp32 already: no fast bf16 here")

    def boom():
        raise RuntimeError("no")

    monkeypatch.setattr(dtype_choice, "bf16_speedup", boom)
    assert choose_dtype("auto", "cpu") == ("float32", "auto, the bf16 timed trial failed (RuntimeError)")


def test_the_trial_is_cached_and_handed_to_child_processes(monkeypatch):
    if not (cpu_support().fast_paths and cpu_support().onednn_bf16):
        pytest.skip("no trial without fast bf16")
    first = dtype_choice.bf16_speedup()
    assert dtype_choice.bf16_speedup() is first  # once per process
    monkeypatch.setenv(dtype_choice.TRIAL_ENV, "0.002 0.001")
    dtype_choice.bf16_speedup.cache_clear()
    try:
        assert dtype_choice.bf16_speedup() == (0.002, 0.001, 2.0)
    finally:
        dtype_choice.bf16_speedup.cache_clear()


def test_loader_builds_the_chosen_dtype_and_says_so():
    name, reason = choose_dtype("auto", "cpu")
    assert resolve_dtype("auto") == getattr(torch, name)
    model = load_model("tiny", dtype="auto", seed=0)
    assert model.dtype == getattr(torch, name)
    assert model.dtype_choice.name == name and model.dtype_choice.asked == "auto"
    assert model.dtype_choice.label("cpu") == f"{name}: {reason}, cpu"
    assert load_model("tiny", seed=0).dtype_choice == choice("float32")  # load_model's own default stays fp32
