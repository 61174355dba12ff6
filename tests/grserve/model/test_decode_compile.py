"""The compiled decode step (``model/decode_compile.py``, ``--decode-compile``) against the eager step and HF.

Greedy tokens: fp32 identical to HF ``generate`` and to the eager engine; bf16 identical to the eager bf16 engine
over ~100 tokens with requests joining and finishing. Padding rows of a bucket never reach the attention context or
the cache; a bucket is traced once and reused; any compile/runtime failure means the eager step, with one warning.

The tests that run Inductor (a C++ compile per bucket, ~20-60 s on a 2-core machine; a cache hit afterwards) are
marked ``slow`` and run on the native lane only (``GRSERVE_CPU_ISA`` unset): the forced lanes check the fallback.
The bucket and padding tests trace with Dynamo but run the FX graph as is (no Inductor): fast everywhere.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.model import decode_compile as dcm
from grserve.model.decode_compile import CompiledDecode, decode_compiler
from grserve.scheduler.fcfs import FCFSScheduler

native_only = pytest.mark.skipif(bool(os.environ.get("GRSERVE_CPU_ISA")) or dcm.compiler_missing() is not None,
                                 reason="Inductor runs on the native lane with a C++ compiler")


def _prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab - 1, (int(k),), generator=g).tolist()
            for k in torch.randint(lo, hi, (n,), generator=g)]


class _Counting:
    """A Dynamo backend that runs the traced FX graph as is (no Inductor) and counts the graphs it was given."""

    def __init__(self):
        self.graphs = 0
        self.limits = []  # (Dynamo's recompile limit, Inductor's compile threads) on the compiling thread

    def __call__(self, gm, example_inputs):
        import torch._inductor.config as inductor_config

        self.graphs += 1
        self.limits.append((torch._dynamo.config.recompile_limit, inductor_config.compile_threads))
        return gm.forward


def _fx_compile(backend):
    return lambda f: torch.compile(f, dynamic=False, backend=backend)


def _engine(model, mode: str, **kw):
    return build_model_engine(model, FCFSScheduler(), num_blocks=256, block_size=4, decode_compile=mode, **kw)


@native_only
@pytest.mark.slow
def test_fp32_greedy_equals_hf_and_eager(hf_qwen3):
    hf, ours = hf_qwen3(kv_heads=2, seed=3, perturb_norms=True)
    prompts = _prompts(5, 4, 20, 300, 9)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eager = _engine(ours, "off")
    compiled = _engine(ours, "on")
    dc = compiled.executor.decode_compiled
    assert eager.executor.decode_compiled is None and dc is not None
    got = compiled.generate(prompts, sp)
    assert dc.failed is None and dc.steps > 0 and dc.compiled_buckets == {8}
    assert got == eager.generate(prompts, sp)
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=12, min_new_tokens=12, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert toks == ref


@native_only
@pytest.mark.slow
def test_bf16_greedy_tokens_equal_the_eager_bf16_path():
    """The tiny preset in bf16 (random weights: near-tied logits, so one bf16 rounding that differs from eager
    flips a token): 10 requests of 40-100 tokens, at most 6 running (requests join as others finish)."""
    from grserve.model import load_model

    model = load_model("tiny", dtype="bfloat16", seed=0)
    prompts = _prompts(10, 5, 60, model.spec.vocab_size, 1)
    g = torch.Generator().manual_seed(2)
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in torch.randint(40, 101, (10,), generator=g)]
    runs = {}
    for mode in ("off", "on"):
        eng = build_model_engine(model, FCFSScheduler(max_num_seqs=6), num_blocks=512, block_size=16,
                                 decode_compile=mode)
        assert eng.executor.staging.kernel is not None  # both attend through the C++ decode kernel
        runs[mode] = eng.generate(prompts, params)
    dc = eng.executor.decode_compiled
    assert dc.failed is None and dc.steps > 0
    assert runs["on"] == runs["off"]


def test_a_failure_means_the_eager_step_for_good_with_one_warning(tiny_model):
    model = tiny_model(0)
    prompts = _prompts(3, 4, 12, model.spec.vocab_size, 4)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = _engine(model, "off").generate(prompts, sp)
    eng = _engine(model, "on")
    dc = eng.executor.decode_compiled

    def broken(*a, **kw):
        raise RuntimeError("no C++ compiler (forced)")

    dc._compiled = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = eng.generate(prompts, sp)
    assert got == want
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        "compiled decode step failed, using the eager decode step: RuntimeError: no C++ compiler (forced)"]
    assert dc.failed and dc.steps == 0 and "compile failed" in eng.executor.describe()


def test_padding_rows_never_reach_the_context_or_the_cache(tiny_model):
    """3 decode rows in the bucket of 4: the context sees 3 rows per layer, and the only pool rows the step
    changes are the 3 requests' new K/V slots."""
    from grserve.attention.hybrid import HybridPagedContext
    from grserve.engine import llm as llm_mod

    model = tiny_model(0)
    eng = _engine(model, "on")
    dc = eng.executor.decode_compiled
    dc._compiled = _fx_compile(_Counting())(dc.stack)
    seen, written, before = [], [], {}

    class Spy(HybridPagedContext):
        def attend(self, layer, q, k, v):
            seen.append((q.shape[0], k.shape[0], v.shape[0]))
            if layer == 0:
                written.extend(self._k_dst.tolist() + self._v_dst.tolist())
                before["data"] = eng.executor.storage.data.clone()
            return super().attend(layer, q, k, v)

    prompts = _prompts(3, 4, 12, model.spec.vocab_size, 5)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    orig = llm_mod.HybridPagedContext
    llm_mod.HybridPagedContext = Spy
    try:
        for p in prompts:
            eng.add_request(p, sp)
        eng.step()  # the prefills (eager)
        seen.clear()
        written.clear()
        eng.step()  # one pure decode step of 3 rows: compiled, bucket 4
    finally:
        llm_mod.HybridPagedContext = orig
    assert dc.steps == 1 and dc.compiled_buckets == {4}
    assert seen == [(3, 3, 3)] * model.spec.num_hidden_layers
    changed = (eng.executor.storage.data != before["data"]).any(dim=(0, 2)).nonzero().squeeze(1).tolist()
    assert changed and set(changed) <= set(written)


def test_a_bucket_is_traced_once_and_reused(tiny_model):
    model = tiny_model(0)
    backend = _Counting()
    dc = CompiledDecode(model, None, bucket_sizes=(8, 16), compile_fn=_fx_compile(backend))
    dc.warm_up((8,))
    assert backend.graphs == 1 and dc.compiled_buckets == {8} and dc.warm_s is not None
    with torch.inference_mode():
        for n in (3, 5, 8):
            dc._run(torch.zeros(n, dtype=torch.int64), torch.arange(n), dcm._WarmContext())
        assert backend.graphs == 1
        dc._run(torch.zeros(9, dtype=torch.int64), torch.arange(9), dcm._WarmContext())
    assert backend.graphs == 2 and dc.compiled_buckets == {8, 16}
    assert not dc.accepts(type("Ctx", (), {"pure_decode": True, "all_kv": True, "lone_prefill": False})(), 17)


def test_auto_is_off_where_the_fast_paths_are(forced_cpu_isa, tiny_model):
    model = tiny_model(0)
    assert decode_compiler(model, None, "off") is None
    forced_cpu_isa("reference")
    assert decode_compiler(model, None, "auto") is None
    with pytest.raises(ValueError, match="decode_compile"):
        decode_compiler(model, None, "always")


def test_buckets_past_the_warm_up_budget_compile_in_the_background(tiny_model):
    import time

    backend = _Counting()
    dc = CompiledDecode(tiny_model(0), None, bucket_sizes=(8, 16), compile_fn=_fx_compile(backend))
    ctx = type("Ctx", (), {"pure_decode": True, "all_kv": True, "lone_prefill": False})()
    dc.pending = {16}  # as while the thread compiles: that bucket's steps run eager
    assert dc.accepts(ctx, 5) and not dc.accepts(ctx, 12)
    dc.pending = set()
    lines: list[str] = []
    dc.on_background_done = lines.append  # serve llm prints it beside its start lines
    dc.warm_up(budget_s=0.0)  # nothing fits: every bucket goes to the thread
    assert "background" in dc.deferred
    deadline = time.monotonic() + 120
    while (dc.pending or not lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not dc.pending and dc.compiled_buckets == {8, 16} and backend.graphs == 2 and dc.failed is None
    assert len(lines) == 1 and lines[0].startswith("decode compile: buckets 8,16 compiled on the background thread")
    assert dc.accepts(ctx, 12)
    # torch keeps Dynamo's and Inductor's configs per thread: the compile thread set its own (room for every
    # bucket's graph; kernels compiled in-process), not the defaults (8, a worker pool)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        assert backend.limits == [(64, 1), (64, 1)]
