"""The prefill of issue 36 (attention/varlen.py, ``Decoder.forward(last_rows=)``) against the reference paths, in fp32.

* the packed causal attention (loop) = an explicit block-diagonal causal mask over the whole packed stream;
* ``last_token`` = the last row of each prompt's causal attention;
* a prefill that keeps only each prompt's last row = the full prefill's rows, with the same K/V written (host
  ``PrefillContext``: all requests, a subset in another order, cached prefixes; device ``PaddedPrefillContext``);
* the retrieval runners with the new prefill (and packed projections) = the reference runner's items and scores;
* ``flash`` falls back to the loop where it cannot run (CPU, fp32).

The prefill comparisons run on KV stores filled with NaN first (``nan_filled``): a read of a slot the prefill did not
write then shows as NaN on every run, not as a small difference on some runs (whatever the allocator handed back,
often the previous run's K/V; issue 46). Both prefills are also held to a float64 run of the same model, so that a
failure says which of the two is off.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from grserve.attention import varlen
from grserve.attention.beam_context import PrefillContext
from grserve.attention.padded import PaddedPrefillContext
from grserve.catalog import generate_catalog
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.device_runner import DeviceRetrievalRunner
from grserve.engine.retrieval import RetrievalRunner
from grserve.kvcache.beam import BeamKV
from grserve.kvcache.padded_beam import PaddedBeamKV

LENS = [37, 1, 64, 20]


def qkv(n, hq=8, hkv=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))


def block_causal_reference(q, k, v, lens):
    """One SDPA call over the whole stream with an explicit [N, N] block-diagonal causal mask (fp64)."""
    n = sum(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    i = torch.arange(n)
    mask = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None],
                                       v.double().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def test_packed_causal_loop_equals_block_diagonal_mask():
    q, k, v = qkv(sum(LENS))
    cu = np.concatenate([[0], np.cumsum(LENS)]).tolist()
    want = block_causal_reference(q, k, v, LENS)
    for impl in ("loop", "auto", "flash"):  # on a CPU (and in fp32 anywhere) auto and flash are the loop
        got = varlen.packed_causal(q, k, v, cu, impl)
        assert (got.double() - want).abs().max().item() <= 1e-5


def test_flash_resolves_to_the_loop_where_it_cannot_run():
    assert varlen.resolve("auto", torch.device("cpu"), torch.bfloat16) == "loop"
    assert varlen.resolve("flash", torch.device("cpu"), torch.float16) == "loop"
    assert varlen.resolve("flash", torch.device("cuda"), torch.float32) == "loop"  # no fp32 flash kernel
    with pytest.raises(ValueError):
        varlen.resolve("nested", torch.device("cpu"), torch.float32)


def test_last_token_equals_the_last_causal_row():
    q, k, v = qkv(sum(LENS), seed=1)
    cu = np.concatenate([[0], np.cumsum(LENS)]).tolist()
    full = varlen.packed_causal_loop(q, k, v, cu)
    rows = torch.tensor(cu[1:]) - 1
    keys = [(k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)) for a, b in zip(cu, cu[1:])]
    got = varlen.last_token(q[rows], keys)
    assert (got - full[rows]).abs().max().item() <= 1e-5


def stream(model, lens, cached, order, seed=0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 2000, n).astype(np.int64) for n in lens]
    tokens = torch.from_numpy(np.concatenate([prompts[r][cached[r]:] for r in order]))
    positions = torch.cat([torch.arange(cached[r], lens[r]) for r in order])
    rows = torch.from_numpy(np.cumsum([lens[r] - cached[r] for r in order]) - 1)
    return prompts, tokens, positions, rows


def nan_filled(kv):
    """Every K/V slot of ``kv`` (``BeamKV`` or ``PaddedBeamKV``) set to NaN: what a prefill does not write stays NaN."""
    for t in (kv.shared_k, kv.shared_v, kv.unshared_k, kv.unshared_v):
        t.fill_(float("nan"))
    return kv


def beam_kv(model, lens):
    s = model.spec
    return nan_filled(BeamKV(num_layers=s.num_hidden_layers, num_kv_heads=s.num_key_value_heads, head_dim=s.head_dim,
                             prompt_lens=lens, beam_width=4, decode_steps=3, dtype=model.dtype, device="cpu"))


def float64_copy(model):
    """The model in float64 (a copy: the session's fp32 model is shared), the reference both fp32 prefills are held
    to. RoPE angles stay fp32 (``Decoder.rope``), so the copy differs from the fp32 model only in the arithmetic."""
    return copy.deepcopy(model).double()


# Measured on an AMD EPYC (AVX-512; the AVX2 and reference lanes alike), host context, all four cases: each fp32
# prefill ≤ 3.7e-6 from float64 (packed projections included), the full and the last-rows prefill ≤ 8.3e-7 apart
# (summation order: the GEMMs on S vs N rows, a one-row vs a causal SDPA call). The bounds below leave 5x and 12x.
# A difference of 1e-4 is not summation order: the last layer's q projection alone in TF32 gives 1.5e-4, in bf16
# 1.2e-3; one key of a prompt dropped, added or zeroed in its last-row attention, 1e-2 and more.
TOL_F64 = 2e-5
TOL = 1e-5


@pytest.mark.parametrize("case", ["all", "subset_cached"])
@pytest.mark.parametrize("packed", [False, True])
def test_last_rows_prefill_equals_full_prefill_host_context(tiny_model, case, packed):
    from grserve.model.packed_linear import shared_pack

    model = tiny_model(seed=5)
    pk = shared_pack(model) if packed else None
    if packed and pk is None:
        pytest.skip("no oneDNN packing on this CPU / under GRSERVE_CPU_ISA=reference")
    lens = [40, 3, 70, 25]
    if case == "all":
        order, cached, requests = [0, 1, 2, 3], [0, 0, 0, 0], None
    else:  # request 1 came from elsewhere (a thought); 0 and 3 have cached prefixes; the stream is 2, 0, 3
        order, cached, requests = [2, 0, 3], [16, 0, 0, 8], [2, 0, 3]
    _, tokens, positions, rows = stream(model, lens, cached, order)
    g = torch.Generator().manual_seed(9)
    prefix = [torch.randn(model.spec.num_hidden_layers, model.spec.num_key_value_heads, 16,
                          model.spec.head_dim, generator=g) for _ in range(2)]

    def prefill(m, last, pk):
        kv = beam_kv(m, lens)  # NaN: request 1's K/V (not streamed) stays NaN in the subset case
        for r in (0, 3):  # the same "cached" K/V in every run
            kv.shared_request(r)[0][:, :, : cached[r]] = prefix[0][:, :, : cached[r]]
            kv.shared_request(r)[1][:, :, : cached[r]] = prefix[1][:, :, : cached[r]]
        ctx = PrefillContext(kv, requests, cached if any(cached) else None)
        h = m(tokens, positions, ctx, packed=pk, last_rows=rows if last else None)
        return (h if last else h[rows]), [t.clone() for r in order for t in kv.shared_request(r)]

    with torch.inference_mode():
        (h0, kv0), (h1, kv1) = prefill(model, False, pk), prefill(model, True, pk)
        ref, _ = prefill(float64_copy(model), False, None)
    assert h1.shape == (len(order), model.spec.hidden_size)
    err = [(h.double() - ref).abs().max().item() for h in (h0, h1)]  # NaN (a read of an unwritten slot) fails too
    assert max(err) <= TOL_F64, f"vs float64: full prefill {err[0]:.2e}, last-rows prefill {err[1]:.2e}"
    assert (h0 - h1).abs().max().item() <= TOL
    assert all(torch.equal(a, b) for a, b in zip(kv0, kv1))  # the K/V of every row are the full prefill's (no NaN)


def test_last_rows_prefill_equals_full_prefill_padded_context(tiny_model):
    model = tiny_model(seed=6)
    s = model.spec
    lens, cached = [50, 9, 33], [0, 0, 16]
    _, tokens, positions, rows = stream(model, lens, cached, [0, 1, 2], seed=2)
    offsets = np.concatenate([[0], np.cumsum([n - m for n, m in zip(lens, cached)])]).tolist()
    outs = []
    with torch.inference_mode():
        pre = torch.randn(s.num_hidden_layers, s.num_key_value_heads, 16, s.head_dim)
        for last in (False, True):
            kv = PaddedBeamKV(num_layers=s.num_hidden_layers, num_kv_heads=s.num_key_value_heads,
                              head_dim=s.head_dim, num_requests=4, max_len=64, beam_width=4, decode_steps=3,
                              dtype=model.dtype, device="cpu")
            nan_filled(kv).set_lengths(lens)  # padding and the slots of a request to be written: NaN
            kv.shared_request(2)[0][:, :, :16] = pre
            kv.shared_request(2)[1][:, :, :16] = pre * 0.5
            ctx = PaddedPrefillContext(kv, offsets, cached)
            h = model(tokens, positions, ctx, last_rows=rows if last else None)
            outs.append((h if last else h[rows], kv.shared_k.clone(), kv.shared_v.clone()))
    (h0, k0, v0), (h1, k1, v1) = outs
    assert (h0 - h1).abs().max().item() <= TOL  # NaN (a read of padding or of an unwritten slot) fails
    assert all(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True) for a, b in ((k0, k1), (v0, v1)))  # padding: NaN


def test_a_context_without_attend_last_gets_the_full_layer(tiny_model):
    """``last_rows`` with a context that has no ``attend_last``: the full forward, rows picked after."""
    model = tiny_model(seed=5)
    lens = [12, 30]
    _, tokens, positions, rows = stream(model, lens, [0, 0], [0, 1])

    class NoLast:
        def __init__(self, inner):
            self.inner = inner

        def attend(self, *a):
            return self.inner.attend(*a)

    with torch.inference_mode():
        full = model(tokens, positions, PrefillContext(beam_kv(model, lens)))[rows]
        got = model(tokens, positions, NoLast(PrefillContext(beam_kv(model, lens))), last_rows=rows)
    assert torch.equal(full, got)


@pytest.fixture(scope="module")
def catalog():
    return generate_catalog(3000, 3, 64, 0)


def batch(seed=0, lens=(60, 7, 41, 90, 33)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2000, n).astype(np.int64) for n in lens]


REFERENCE = AccelConfig(prefill_last_rows=False, prefill_attention="loop", cpu_packed_linears=False)


@pytest.mark.parametrize("scoring", ["renormalized", "hf"])
def test_runners_with_the_new_prefill_return_the_reference_items(tiny_model, catalog, scoring):
    model = tiny_model(seed=7)
    ps = batch()
    search = SearchConfig(scoring=scoring)
    want = RetrievalRunner(model, search, REFERENCE).run(ps, 16, [10] * len(ps), catalog)
    runners = [RetrievalRunner(model, search), RetrievalRunner(model, search, AccelConfig(cpu_packed_linears=False)),
               DeviceRetrievalRunner(model, search, AccelConfig(fast_path="on", prompt_bucket=32)),
               DeviceRetrievalRunner(model, search, AccelConfig(fast_path="on", prompt_bucket=32,
                                                                 prefill_last_rows=False))]
    for runner in runners:
        got = runner.run(ps, 16, [10] * len(ps), catalog)
        for a, b in zip(want.hits, got.hits, strict=True):
            assert [h.item_id for h in a] == [h.item_id for h in b]
            assert max(abs(x.score - y.score) for x, y in zip(a, b)) <= 1e-5
