"""``--prefill-compile`` (model/prefill_compile.py) against the eager prefill, fp32.

The plumbing (padding to the bucket, the pieces' arguments for every layer, the eager last layer of a
``last_rows`` prefill, cached prefixes) is checked with the pieces run uncompiled (fast); one test compiles them
with Inductor on the CPU (slow: tens of seconds). The GPU run compiles them on CUDA (``scripts/gpu-check.sh p2``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grserve.attention.beam_context import PrefillContext
from grserve.catalog import generate_catalog
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.device_runner import DeviceRetrievalRunner
from grserve.engine.retrieval import RetrievalRunner
from grserve.kvcache.beam import BeamKV
from grserve.model.prefill_compile import CompiledPrefill


def case(model, lens, seed=0):
    rng = np.random.default_rng(seed)
    tokens = torch.from_numpy(np.concatenate([rng.integers(0, 2000, n) for n in lens]).astype(np.int64))
    positions = torch.cat([torch.arange(n) for n in lens])
    rows = torch.from_numpy(np.cumsum(lens) - 1)
    s = model.spec
    kv = lambda: BeamKV(num_layers=s.num_hidden_layers, num_kv_heads=s.num_key_value_heads, head_dim=s.head_dim,
                        prompt_lens=lens, beam_width=4, decode_steps=3, dtype=model.dtype, device="cpu")
    return tokens, positions, rows, kv


@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("bucket", [16, 1000])
def test_pieces_equal_the_eager_forward(tiny_model, last, bucket):
    model = tiny_model(seed=3)
    tokens, positions, rows, kv = case(model, [37, 1, 50])
    compiled = CompiledPrefill(model, bucket, compile_fn=lambda f: f)  # the pieces, uncompiled
    with torch.inference_mode():
        kv0, kv1 = kv(), kv()
        want = model(tokens, positions, PrefillContext(kv0), last_rows=rows if last else None)
        got = compiled(tokens, positions, PrefillContext(kv1), rows if last else None)
    assert compiled.failed is None and compiled.buckets == {-(-88 // bucket) * bucket}
    assert got.shape == want.shape and (got - want).abs().max().item() <= 1e-5
    assert (kv0.shared_k - kv1.shared_k).abs().max().item() <= 1e-5
    assert (kv0.shared_v - kv1.shared_v).abs().max().item() <= 1e-5


def test_a_failing_compile_falls_back_to_the_eager_forward(tiny_model):
    model = tiny_model(seed=3)
    tokens, positions, rows, kv = case(model, [20, 9])

    def broken(_f):
        def fail(*a, **k):
            raise RuntimeError("no compiler here")
        return fail

    compiled = CompiledPrefill(model, 16, compile_fn=broken)
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="compiled prefill failed"):
        got = compiled(tokens, positions, PrefillContext(kv()), rows)
    with torch.inference_mode():
        want = model(tokens, positions, PrefillContext(kv()), last_rows=rows)
    assert compiled.failed.startswith("RuntimeError") and torch.equal(got, want)


@pytest.mark.slow
def test_inductor_compiled_runners_return_the_reference_items(tiny_model):
    """Both runners with --prefill-compile (Inductor on this CPU) = the eager reference runner."""
    model = tiny_model(seed=4)
    cat = generate_catalog(3000, 3, 64, 0)
    rng = np.random.default_rng(1)
    ps = [rng.integers(0, 2000, n).astype(np.int64) for n in (60, 7, 41)]
    ref_accel = AccelConfig(prefill_last_rows=False, prefill_attention="loop", cpu_packed_linears=False)
    want = RetrievalRunner(model, SearchConfig(), ref_accel).run(ps, 16, [10] * 3, cat)
    host = RetrievalRunner(model, SearchConfig(), AccelConfig(prefill_compile=True, prompt_bucket=64))
    dev = DeviceRetrievalRunner(model, SearchConfig(), AccelConfig(fast_path="on", prefill_compile=True,
                                                                   prompt_bucket=64))
    for runner in (host, dev):
        got = runner.run(ps, 16, [10] * 3, cat)
        assert runner.compiled.failed is None, runner.compiled.failed
        for a, b in zip(want.hits, got.hits, strict=True):
            assert [h.item_id for h in a] == [h.item_id for h in b]
            assert max(abs(x.score - y.score) for x, y in zip(a, b)) <= 1e-5
