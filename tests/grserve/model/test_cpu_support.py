"""CPU fast paths chosen by capability (``model/cpu_support.py``): the forcing switch, the trial calls, and what
each path falls back to. The lanes of ``make test`` run the engine/server/cluster tests again under
``ONEDNN_MAX_CPU_ISA=AVX2`` (as on a CPU without AVX-512) and ``GRSERVE_CPU_ISA=reference``."""

from __future__ import annotations

import pytest
import torch

from grserve.model import cpu_support as cs
from grserve.model.packed_linear import available, can_pack, maybe_pack


def test_label_names_the_cpu_and_isa():
    s = cs.cpu_support()
    assert s.cpu_model and s.cpu_model != "unknown CPU"
    assert s.isa in s.label() and s.machine in s.label()
    d = s.to_dict()
    assert d["cpu"] == s.label() and d["cores"] >= 1 and set(d) >= {"isa", "onednn", "onednn_bf16"}


def test_avx2_level_turns_bf16_off_and_keeps_fp32_packing(forced_cpu_isa):
    native = forced_cpu_isa(None)
    s = forced_cpu_isa("avx2")
    assert not s.onednn_bf16 and not available(torch.bfloat16)
    assert s.onednn == native.onednn  # fp32 oneDNN works on AVX2 CPUs too
    assert "AVX512" not in s.isa and "avx2" in s.reason and s.fast_paths


def test_reference_level_turns_every_fast_path_off(forced_cpu_isa, tiny_model):
    s = forced_cpu_isa("reference")
    assert not s.onednn and not s.onednn_bf16 and not s.fast_paths
    assert not available(torch.float32) and maybe_pack(tiny_model(0)) is None
    assert forced_cpu_isa("baseline").forced == "reference"  # the alias


def test_unknown_level_is_refused(forced_cpu_isa):
    with pytest.raises(ValueError, match="GRSERVE_CPU_ISA"):
        forced_cpu_isa("avx9000")


def test_a_failing_onednn_op_means_the_reference_path(forced_cpu_isa, monkeypatch):
    """A build whose op raises (as oneDNN's bf16 reorder does on an AVX2 CPU) is detected by the trial call,
    not at the first real request."""
    real = torch.ops.mkldnn._reorder_linear_weight

    def refuses_bf16(w, *a):
        if w.dtype == torch.bfloat16:
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
        return real(w, *a)

    monkeypatch.setattr(cs, "_bf16_supported", lambda: True)  # torch claims bf16; the op disagrees
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuses_bf16, raising=False)
    s = forced_cpu_isa(None)
    if not cs._onednn_ops():
        pytest.skip("this torch build has no oneDNN matmul")
    assert s.onednn and not s.onednn_bf16
    assert "bf16 trial failed" in s.reason and "avx_ne_convert" in s.reason


def test_bf16_models_are_packed_only_with_fast_bf16(forced_cpu_isa):
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import load_model
    from grserve.scheduler.fcfs import FCFSScheduler

    model = load_model("tiny", dtype="bfloat16", seed=0)
    native = forced_cpu_isa(None)
    assert can_pack(model) == native.onednn_bf16
    forced_cpu_isa("avx2")
    assert not can_pack(model) and maybe_pack(model) is None
    eng = build_model_engine(model, FCFSScheduler(), num_blocks=16, block_size=4)  # no oneDNN bf16 reorder here
    assert eng.executor.packed is None and "F.linear" in eng.executor.describe()
    assert "slower than fp32" in eng.executor.describe()
    out = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0]) == 3
