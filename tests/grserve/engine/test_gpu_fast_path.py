"""The fast path on a CUDA device (every test is marked ``gpu``: skipped cleanly where there is none).

* graph replay = eager after the inputs change (tiny model, and the P2 shape: qwen3-1.7b, bf16, 8 × 5000, BW 256);
* GPU search = CPU search on the tiny model: fp32 same items, scores ≤ 1e-3; bf16 within the stated tolerance;
* no memory growth across replays;
* the Triton kernels = their torch references at production shapes (bf16);
* the Triton backend's search = the torch backend's.

Tolerances (docs/gpu.md): fp32 1e-3 on summed log-probs; bf16: kernels 3e-2 abs on outputs, items compared by
overlap (bf16 rounding of logits reorders near-ties).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from grserve.catalog import generate_catalog
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.device_runner import DeviceRetrievalRunner
from grserve.engine.retrieval import RetrievalRunner

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cpu_model(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def gpu_model(cpu_model):
    return copy.deepcopy(cpu_model).to("cuda")  # the same weights (seeded init on CUDA draws other numbers)


@pytest.fixture(scope="module")
def catalog():
    return generate_catalog(20_000, 3, 256, 0)


def prompts(lens, seed=0, vocab=2000):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).astype(np.int64) for n in lens]


def runner(model, backend="torch", graphs=True, **kw):
    return DeviceRetrievalRunner(model, SearchConfig(), AccelConfig(fast_path="on", attention_backend=backend,
                                                                     cuda_graphs=graphs, **kw))


def assert_same(ref, out, tol):
    for a, b in zip(ref.hits, out.hits, strict=True):
        assert [h.item_id for h in a] == [h.item_id for h in b]
        assert max((abs(x.score - y.score) for x, y in zip(a, b)), default=0.0) <= tol


def test_graph_replay_equals_eager_after_inputs_change(gpu_model, catalog):
    graphs, eager = runner(gpu_model), runner(gpu_model, graphs=False)
    graphs.run(prompts([300, 200, 120], 1), 64, [20] * 3, catalog)  # bucket (4, 512): warm-up + capture
    assert graphs.captures == 2
    for seed, lens in ((2, [400, 90, 17, 260]), (3, [450, 1]), (4, [333, 290, 300])):  # other inputs
        ps = prompts(lens, seed)
        out = graphs.run(ps, 64, [20] * len(ps), catalog)
        assert_same(eager.run(ps, 64, [20] * len(ps), catalog), out, 1e-5)
    assert graphs.captures == 4  # (4, 512) replayed twice; (2, 512) captured once


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_search_equals_cpu_search_fp32(cpu_model, gpu_model, catalog, backend):
    if backend == "triton":
        pytest.importorskip("triton")
    ps = prompts([120, 64, 200], 4)
    ref = RetrievalRunner(cpu_model, SearchConfig()).run(ps, 128, [20] * 3, catalog)
    out = runner(gpu_model, backend).run(ps, 128, [20] * 3, catalog)
    assert_same(ref, out, 1e-3)


def test_bf16_gpu_search_close_to_cpu(cpu_model, catalog):
    model = copy.deepcopy(cpu_model).to("cuda", torch.bfloat16)
    ps = prompts([120, 64, 200, 33], 5)
    ref = RetrievalRunner(cpu_model, SearchConfig()).run(ps, 128, [10] * 4, catalog)
    out = runner(model).run(ps, 128, [10] * 4, catalog)
    for a, b in zip(ref.hits, out.hits):
        ra, rb = {h.item_id: h.score for h in a}, {h.item_id: h.score for h in b}
        common = ra.keys() & rb.keys()
        assert len(common) >= 7  # top-10 overlap
        assert max(abs(ra[i] - rb[i]) for i in common) <= 0.25


def test_no_memory_growth_across_replays(gpu_model, catalog):
    r = runner(gpu_model)
    r.run(prompts([200, 150], 6), 64, [10, 10], catalog)
    r.run(prompts([180, 20], 7), 64, [10, 10], catalog)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks = []
    for seed in range(8, 20):
        torch.cuda.reset_peak_memory_stats()
        r.run(prompts([40 + 13 * (seed % 10), 77], seed), 64, [10, 10], catalog)
        peaks.append(torch.cuda.max_memory_allocated())
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base <= 1 << 20  # nothing kept per replay
    assert max(peaks) - min(peaks) <= 64 << 20  # only the eager prefill's transient memory varies with the lengths
    assert r.captures == 2


def test_triton_kernels_at_production_shapes(catalog):
    pytest.importorskip("triton")
    from grserve.attention.padded import shared_stage_padded
    from grserve.attention.staged import unshared_stage
    from grserve.kernels.beam_attention import shared_stage_triton, unshared_stage_triton
    from grserve.kernels.masked_topk import masked_topk_expand_triton
    from grserve.search.device_trie import DeviceTrie
    from grserve.search.masked_topk import masked_topk_expand

    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(8 * 256, 16, 128, **bf)
    uk, uv = torch.randn(8 * 256, 3, 8, 128, **bf), torch.randn(8 * 256, 3, 8, 128, **bf)
    o, lse = unshared_stage_triton(q, uk[:, :2], uv[:, :2])
    o_ref, lse_ref = unshared_stage(q.float(), uk[:, :2].float(), uv[:, :2].float())
    assert (o.float() - o_ref).abs().max() <= 3e-2 and (lse - lse_ref).abs().max() <= 3e-2
    sk, sv = torch.randn(8, 8, 5120, 128, **bf), torch.randn(8, 8, 5120, 128, **bf)
    lens = torch.tensor([5000, 4096, 1, 0, 5120, 333, 2048, 4999], device="cuda")
    bias = torch.where(torch.arange(5120, device="cuda")[None, :] < lens[:, None], 0.0, float("-inf"))
    o, lse = shared_stage_triton(q, sk, sv, lens)
    o_ref, lse_ref = shared_stage_padded(q.float(), sk.float(), sv.float(), bias[:, None, None, :])
    assert (o.float() - o_ref).abs().max() <= 3e-2
    fin = torch.isfinite(lse_ref)
    assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - lse_ref[fin]).abs().max() <= 3e-2
    trie = DeviceTrie(catalog, "cuda")
    nodes = torch.randint(-1, catalog.trie.num_nodes(2), (2048,), device="cuda", generator=g)
    logits = torch.randn(2048, 256, device="cuda", generator=g)
    scores = torch.randn(2048, device="cuda", generator=g)
    k = trie.max_children[2]
    v, c, n = masked_topk_expand(logits, trie, 2, nodes, scores, k)
    tv, tc, tn = masked_topk_expand_triton(logits, nodes, trie.indptr[2], trie.codes[2], k, scores, k)
    fin = torch.isfinite(v)
    assert torch.equal(fin, torch.isfinite(tv)) and torch.allclose(tv[fin], v[fin], atol=1e-5)
    assert torch.equal(tc[fin], c[fin]) and torch.equal(tn[fin], n[fin])


@pytest.mark.slow
def test_p2_shape_graph_replay_equals_eager():
    """qwen3-1.7b (seeded random weights, bf16), 8 × 5000-token prompts, BW 256, 3 SID tokens."""
    from grserve.model import load_model

    model = load_model("qwen3-1.7b", dtype="bfloat16", device="cuda", seed=0)
    cat = generate_catalog(20_000, 3, 256, 0)
    graphs, eager = runner(model, prompt_bucket=1000), runner(model, graphs=False, prompt_bucket=1000)
    graphs.run(prompts([5000] * 8, 1, 30000), 256, [10] * 8, cat)
    ps = prompts([5000] * 8, 2, 30000)
    out, ref = graphs.run(ps, 256, [10] * 8, cat), eager.run(ps, 256, [10] * 8, cat)
    top1 = np.mean([a[0].item_id == b[0].item_id for a, b in zip(ref.hits, out.hits)])
    assert top1 == 1.0
    del graphs, eager, model
    torch.cuda.empty_cache()


# ---- issue 36: the prefill as one varlen call, the last layer on the last rows (attention/varlen.py) ----------
EAGER_PREFILL = {"prefill_last_rows": False, "prefill_attention": "loop"}


def test_varlen_flash_equals_the_loop_bf16():
    from grserve.attention import varlen

    if varlen._varlen_fn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [1000, 1, 333, 5000, 64]
    n = sum(lens)
    q, k, v = (torch.randn(n, h, 128, device="cuda", generator=g).to(torch.bfloat16) for h in (16, 8, 8))
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    want = varlen.packed_causal_loop(q, k, v, cu).float()
    got = varlen.packed_causal(q, k, v, cu, "flash").float()
    assert varlen.flash_failure() is None  # the varlen call ran (no fallback)
    assert (got - want).abs().max().item() <= 2e-2


def test_new_prefill_equals_eager_prefill_fp32(gpu_model, catalog):
    ps = prompts([300, 1, 120, 257], 11)
    ref = runner(gpu_model, **EAGER_PREFILL).run(ps, 64, [20] * 4, catalog)
    assert_same(ref, runner(gpu_model).run(ps, 64, [20] * 4, catalog), 1e-5)


def test_bf16_new_prefill_close_to_eager_prefill(cpu_model, catalog):
    model = copy.deepcopy(cpu_model).to("cuda", torch.bfloat16)
    ps = prompts([300, 64, 200, 33], 12)
    ref = runner(model, **EAGER_PREFILL).run(ps, 128, [10] * 4, catalog)
    out = runner(model).run(ps, 128, [10] * 4, catalog)
    for a, b in zip(ref.hits, out.hits):
        ra, rb = {h.item_id: h.score for h in a}, {h.item_id: h.score for h in b}
        common = ra.keys() & rb.keys()
        assert len(common) >= 7  # top-10 overlap (bf16: the flash kernel rounds differently from SDPA's)
        assert max(abs(ra[i] - rb[i]) for i in common) <= 0.25
