"""Prompt-prefix KV reuse in GR retrieval (``kvcache/prefix_blocks.py``): the beams and scores with the cache equal
those without it (same items in the same order, scores within 1e-4 fp32) on the host path, the device fast path
(run on the CPU here) and the thinking path, with exclude / include filters and a catalog swap in between; the cache
really is used (tokens loaded > 0, fewer tokens prefilled); block alignment, at least one computed token, capacity,
the host tier's spill and return, the KV budget (the cache gives way, a request never fails)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grserve.attention.prefix_prefill import prefix_causal_attention
from grserve.catalog import CatalogStore
from grserve.config import AccelConfig, PrefixCacheConfig, SchedulerConfig, SearchConfig
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.think import ThinkSpec
from grserve.engine.types import RetrievalRequest
from grserve.kvcache.block_hash import chained_block_hashes
from grserve.kvcache.prefix_blocks import KVBudget, PrefixBlockCache

from gr_fixtures import grid_catalog

TOL = 1e-4  # fp32, as tests/grserve/engine/test_retrieval_exact.py


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=3)


def _engine(model, catalog, tokens=0, *, fast=False, block=8, policy="lru", budget=0, **search):
    accel = AccelConfig(fast_path="on", batch_buckets="1,2,4,8", prompt_bucket=64) if fast else None
    prefix = PrefixCacheConfig(prefix_cache_tokens=tokens, prefix_block_size=block, prefix_cache_policy=policy,
                               kv_budget_bytes=budget)
    return RetrievalEngine(model, CatalogStore(catalog), SearchConfig(**search), SchedulerConfig(), accel=accel,
                           prefix=prefix)


def _workload(seed=0, instruction=40):
    """Shared-instruction prompts and returning users (a user's next prompt = the last one + new items)."""
    rng = np.random.default_rng(seed)
    inst = rng.integers(0, 2000, instruction)
    users = [rng.integers(0, 2000, int(n)) for n in (3, 11, 19, 26)]
    visits = []
    for k in range(3):
        for u, hist in enumerate(users):
            users[u] = np.concatenate([hist, rng.integers(0, 2000, 5 + k)])
            visits.append(np.concatenate([inst, users[u]]).astype(np.int64))
    visits.append(rng.integers(0, 2000, 23).astype(np.int64))  # a cold prompt: no shared prefix
    return visits


def _same(a, b):
    assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
    assert [tuple(i.sid) for i in a.items] == [tuple(i.sid) for i in b.items]
    assert max((abs(x.score - y.score) for x, y in zip(a.items, b.items)), default=0.0) <= TOL


def _run(engine, prompts, bw=16, per_batch=4, **kw):
    out = []
    for s in range(0, len(prompts), per_batch):
        out += engine.run_batch([RetrievalRequest(prompt_tokens=p, beam_width=bw, top_n=10, **kw)
                                 for p in prompts[s:s + per_batch]])
    return out


# ---- the attention rule -------------------------------------------------------------------------------------------
def test_prefix_causal_attention_equals_the_rows_of_the_whole_prefill():
    g = torch.Generator().manual_seed(0)
    L, n, hq, hkv, d = 29, 11, 4, 2, 8
    q = torch.randn(L, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(hkv, L, d, generator=g, dtype=torch.float64)
    v = torch.randn(hkv, L, d, generator=g, dtype=torch.float64)
    whole = prefix_causal_attention(q, k, v)
    rest = prefix_causal_attention(q[L - n:], k, v)
    assert torch.allclose(rest, whole[L - n:], atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_aligned_attention_rows_do_not_depend_on_the_prompt_or_the_cache(dtype):
    """The prefill's attention in block-aligned query chunks: the rows after a cached prefix are the bits of the same
    rows of the whole prompt's prefill, and a prefix's rows the bits of a longer prompt's (the CPU's one-call causal
    SDPA rounds a row differently with the sequence length; at bf16 that moved scores by up to 0.1)."""
    from grserve.attention.prefix_prefill import block_aligned_attention

    g = torch.Generator().manual_seed(0)
    L, B, hq, hkv, d = 45, 4, 8, 2, 32
    q = torch.randn(L, hq, d, generator=g).to(dtype)
    k = torch.randn(hkv, L, d, generator=g).to(dtype)
    v = torch.randn(hkv, L, d, generator=g).to(dtype)
    whole = block_aligned_attention(q, k, v, B)
    for m in (4, 16, 40):  # the rest after a cached prefix of m tokens
        assert torch.equal(block_aligned_attention(q[m:], k, v, B), whole[m:])
    for n in (8, 20, 33):  # a shorter prompt that is a prefix of this one: its full blocks' rows
        short = block_aligned_attention(q[:n], k[:, :n], v[:, :n], B)
        assert torch.equal(short[:n - n % B], whole[:n - n % B])
    ref = prefix_causal_attention(q.double(), k.double(), v.double())
    assert torch.allclose(whole.double(), ref, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=0)
    with pytest.raises(ValueError):
        block_aligned_attention(q[3:], k, v, B)  # a cached prefix is whole blocks


def _rows_invariant_gemms(model) -> bool:
    """Whether this CPU's projections (as the runner runs them: oneDNN-packed where it can) give a row the same bits
    whatever the row count, at the model's widths and dtype: the reuse is bit-equal only then (a prompt's rest is
    projected with another row count than the whole prompt)."""
    from grserve.model.packed_linear import grouped_linear, shared_pack

    packed = shared_pack(model)
    g = torch.Generator().manual_seed(1)
    layer = model.model.layers[0]
    for lin in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        x = torch.randn(97, lin.weight.shape[1], generator=g).to(model.dtype)
        full = grouped_linear(x, lin, packed, None)
        if any(not torch.equal(grouped_linear(x[:m].contiguous(), lin, packed, None), full[:m]) for m in (1, 3, 17, 60)):
            return False
    return True


def test_bf16_beams_with_the_cache_are_the_bits_without():
    """At bf16 (the default --dtype auto on a CPU with fast bf16): the same items and the same score bits with the
    prefix cache as without it, hits or not (a thinking request's prompt is not covered: engine/think.py)."""
    from grserve.model import load_model

    model = load_model("tiny", dtype="bfloat16", seed=3)
    if not _rows_invariant_gemms(model):
        pytest.skip("this CPU's bf16 GEMMs round a row differently with the row count: reuse is not bit-equal here")
    catalog = grid_catalog(40, seed=0, first_id=100)
    prompts = _workload(seed=4)
    off = _run(_engine(model, catalog, block=8), prompts)
    on_engine = _engine(model, catalog, 4096, block=8)
    on = _run(on_engine, prompts)
    assert sum(r.cached_tokens for r in on) > 0
    for a, b in zip(off, on):
        assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
        assert [i.score for i in a.items] == [i.score for i in b.items]


# ---- exactness ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scoring", ["renormalized", "hf"])
@pytest.mark.parametrize("policy", ["lru", "leader", "laru"])
def test_beams_with_the_cache_equal_beams_without(model, scoring, policy):
    catalog = grid_catalog(40, seed=0, first_id=100)
    prompts = _workload()
    off = _run(_engine(model, catalog, scoring=scoring), prompts)
    on_engine = _engine(model, catalog, 4096, policy=policy, scoring=scoring)
    on = _run(on_engine, prompts)
    for a, b in zip(off, on):
        _same(a, b)
    cached = [r.cached_tokens for r in on]
    assert cached[-1] == 0  # the cold prompt
    assert sum(cached[4:-1]) > 0 and all(c % 8 == 0 for c in cached)  # returning users hit, whole blocks only
    s = on_engine.stats()
    assert s["prefix_reused_tokens"] == sum(cached)
    assert s["prefix_computed_tokens"] == sum(len(p) for p in prompts) - sum(cached)
    on_engine.prefix.check()


def test_fast_path_with_the_cache_equals_the_host_path_without(model):
    catalog = grid_catalog(40, seed=0, first_id=100)
    prompts = _workload(seed=1)
    off = _run(_engine(model, catalog), prompts)
    fast = _engine(model, catalog, 4096, fast=True)
    on = _run(fast, prompts)
    assert type(fast.runner).__name__ == "DeviceRetrievalRunner"
    for a, b in zip(off, on):
        _same(a, b)
    assert sum(r.cached_tokens for r in on) > 0


def test_filters_thinking_and_a_catalog_swap_with_the_cache(model):
    cat_a, cat_b = grid_catalog(40, seed=0, first_id=100), grid_catalog(40, seed=5, first_id=100)
    prompts = _workload(seed=2)
    exclude = np.array([100, 105, 117, 130], dtype=np.int64)
    think = ThinkSpec(max_think_tokens=3, sid_begin=int(cat_a.layout.level_range(0)[0]))
    engines = [_engine(model, cat_a), _engine(model, cat_a, 4096)]
    results = []
    for e in engines:
        rs = _run(e, prompts[:6], exclude_items=exclude)
        e.catalogs.replace(cat_b)
        rs += _run(e, prompts[2:8])  # after the swap: the same prompts hit, the beams follow the new catalog
        rs += _run(e, prompts[4:10], think=think)
        results.append(rs)
    for a, b in zip(*results):
        _same(a, b)
        assert a.thought == b.thought
    assert all(i.item_id not in exclude for r in results[1][:6] for i in r.items)
    assert sum(r.cached_tokens for r in results[1][6:12]) > 0  # hits across the catalog swap
    assert sum(r.cached_tokens for r in results[1][12:]) > 0  # thinking requests load their prompt's prefix


def test_include_items_with_the_cache(model):
    from grserve.catalog.allowlist import Allow

    catalog = grid_catalog(40, seed=0, first_id=100)
    allow = Allow(items=np.arange(100, 120, dtype=np.int64))
    prompts = _workload(seed=3)
    off = _run(_engine(model, catalog), prompts, include=allow)
    on = _run(_engine(model, catalog, 4096), prompts, include=allow)
    for a, b in zip(off, on):
        _same(a, b)
        assert all(100 <= i.item_id < 120 for i in b.items)
    assert sum(r.cached_tokens for r in on) > 0


# ---- the cache's own rules ----------------------------------------------------------------------------------------
def _cache(tokens=64, block=4, **kw):
    return PrefixBlockCache(tokens, block_size=block, num_layers=2, num_kv_heads=1, head_dim=2, **kw)


def _kv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 1, n, 2, generator=g), torch.randn(2, 1, n, 2, generator=g)


def test_load_copies_whole_blocks_and_leaves_one_token_to_compute():
    c = _cache()
    p = np.arange(12)  # three full blocks of 4
    k, v = _kv(12, 0)
    c.store(p, c.load(p, *_kv(12, 9)), k, v)
    assert len(c.tiers[0].blocks) == 3
    k2, v2 = torch.zeros(2, 1, 12, 2), torch.zeros(2, 1, 12, 2)
    m = c.load(p, k2, v2)  # the same prompt: at most ⌊11 / 4⌋ = 2 blocks, its last token is computed
    assert m.tokens == 8 and torch.equal(k2[:, :, :8], k[:, :, :8]) and torch.equal(v2[:, :, :8], v[:, :, :8])
    assert not k2[:, :, 8:].any()
    m = c.load(np.concatenate([p, [7, 7, 7]]), torch.zeros(2, 1, 15, 2), torch.zeros(2, 1, 15, 2))
    assert m.tokens == 12
    assert c.load(np.array([1, 0, 2, 3, 4, 5]), *_kv(6, 1)).tokens == 0  # another first block: nothing
    assert m.hashes[:3] == chained_block_hashes(p, 4)
    c.check()


def test_capacity_is_kept_by_the_policy():
    c = _cache(tokens=16, block=4)  # 4 blocks
    for u in range(5):
        p = np.arange(12) + 100 * u
        c.store(p, c.load(p, *_kv(12, u)), *_kv(12, u))
        assert len(c.tiers[0].blocks) <= 4
        c.check()
    assert c.stats["evicted_blocks"] == 15 - 4


@pytest.mark.parametrize("policy", ["lru", "lfu", "leader", "density", "laru"])
def test_a_huge_capacity_costs_nothing_until_blocks_are_stored(policy):
    """Hostile pass 2: --prefix-cache-tokens is an upper bound (--kv-budget-bytes may be the real one), so a huge
    value must not allocate the policy's bookkeeping up front: 10**20 tokens raised OverflowError at start-up and
    10**9 took ~10 GB of host memory before serving anything (RecencyIndex sized by the capacity)."""
    import tracemalloc

    tracemalloc.start()
    try:
        c = PrefixBlockCache(10**20, block_size=16, num_layers=1, num_kv_heads=1, head_dim=4, policy=policy)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20
    for u in range(40):  # the bookkeeping grows as blocks come
        p = np.arange(64) + 1000 * u
        kv = (torch.randn(1, 1, 64, 4), torch.randn(1, 1, 64, 4))
        c.store(p, c.load(p, *kv), *kv)
    assert len(c.tiers[0].blocks) == 40 * 4
    c.check()
    kv = (torch.zeros(1, 1, 64, 4), torch.zeros(1, 1, 64, 4))
    assert c.load(np.arange(64) + 1000 * 7, *kv).tokens == 48


def test_the_engine_cache_refits_a_learned_policy_off_the_batch_thread(model, monkeypatch):
    """Hostile pass 2: --prefix-cache-policy laru refitted its LightGBM model inline, inside a batch's load/store and
    under the cache's lock, so every batch running waited for it (one store took 1.1 s, p99 108 ms, on 2 shared
    cores). The engine's cache refits on a background thread (predictions keep the previous model meanwhile); the
    answers do not depend on it."""
    import threading

    from grserve.eviction.predictor import LearnedPredictor

    fits: list[bool] = []
    fit = LearnedPredictor._fit

    def spy(self, data):
        fits.append(threading.current_thread() is threading.main_thread())
        return fit(self, data)

    monkeypatch.setattr(LearnedPredictor, "_fit", spy)
    from grserve.engine.retrieval_engine import make_prefix_cache
    from grserve.kvcache.prefix_blocks import KVBudget

    cache = make_prefix_cache(model, PrefixCacheConfig(prefix_cache_tokens=256, prefix_block_size=4,
                                                       prefix_cache_policy="laru"), KVBudget(None))
    spec = model.spec
    kv = [torch.zeros(spec.num_hidden_layers, spec.num_key_value_heads, 16, spec.head_dim) for _ in range(2)]
    rng = np.random.default_rng(0)
    for _ in range(1200):  # ~ 5,000 block accesses: past min_train and two retrain periods
        p = np.arange(16) + 100 * int(rng.zipf(1.3) % 300)
        cache.store(p, cache.load(p, *kv), *kv)
    cache.tiers[0].policy.predictor.wait_training()
    assert fits and not any(fits)
    cache.check()


def test_a_host_tier_takes_spills_and_gives_them_back():
    c = _cache(tokens=8, block=4, host_tokens=16)  # device 2 blocks, host 4
    a, b = np.arange(8), np.arange(8) + 50
    ka, va = _kv(8, 1)
    c.store(a, c.load(a, *_kv(8, 0)), ka, va)
    c.store(b, c.load(b, *_kv(8, 0)), *_kv(8, 2))  # a's blocks spill to the host tier
    assert c.stats["spilled_blocks"] == 2 and c.stats["evicted_blocks"] == 0
    assert set(c.tiers[1].blocks) == set(chained_block_hashes(a, 4))
    dst = torch.zeros(2, 1, 9, 2), torch.zeros(2, 1, 9, 2)
    m = c.load(np.concatenate([a, [1]]), *dst)  # a host hit: copied, and back on the device
    assert m.tokens == 8 and torch.equal(dst[0][:, :, :8], ka) and torch.equal(dst[1][:, :, :8], va)
    assert c.stats["host_hit_blocks"] == 2
    assert set(c.tiers[0].blocks) == set(chained_block_hashes(a, 4))
    c.check()


def test_the_cache_gives_way_to_the_beam_kv_budget():
    budget = KVBudget(3 * 2 * 2 * 1 * 2 * 4 * 4)  # three blocks' bytes (2 planes · 2 layers · 1 head · 2 dims · 4 tokens · fp32)
    c = _cache(tokens=64, block=4, budget=budget)
    p = np.arange(20)
    c.store(p, c.load(p, *_kv(20, 0)), *_kv(20, 0))
    assert len(c.tiers[0].blocks) == 3 and c.stats["store_skipped_blocks"] == 2  # stores stop at the budget
    budget.reserve(2 * c.block_bytes)  # a batch's beam KV
    assert c.give_way() == 2 and c.bytes + budget.in_flight <= budget.total
    budget.reserve(10 * c.block_bytes)  # a batch larger than the budget: the cache empties, the batch still runs
    c.give_way()
    assert c.bytes == 0
    c.check()


def test_an_engine_under_a_tight_budget_serves_every_request_exactly(model):
    catalog = grid_catalog(40, seed=0, first_id=100)
    prompts = _workload(seed=4)
    off = _run(_engine(model, catalog), prompts)
    spec = model.spec
    per_token = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * 4
    budget = 4 * (70 + 16 * 3) * per_token  # about one batch of beam KV: the cache keeps what is left
    tight = _engine(model, catalog, 4096, budget=budget)
    on = _run(tight, prompts)
    for a, b in zip(off, on):
        _same(a, b)
    s = tight.stats()
    assert s["prefix_gave_way_blocks"] > 0 or s["prefix_bytes_device"] < 4096 * per_token
    assert s["prefix_bytes_device"] <= budget
    tight.prefix.check()


def test_off_by_default_and_the_flag_names_itself():
    from grserve.config import ConfigError, ServeConfig

    assert not ServeConfig().prefix.enabled
    with pytest.raises(ConfigError, match="--prefix-cache-tokens"):
        PrefixCacheConfig(prefix_cache_tokens=8, prefix_block_size=16)


def test_a_host_tier_on_a_cpu_is_refused(model):
    from grserve.config import ConfigError

    with pytest.raises(ConfigError, match="prefix.cache.host.tokens"):
        RetrievalEngine(model, CatalogStore(grid_catalog(40, seed=0, first_id=100)),
                        prefix=PrefixCacheConfig(prefix_cache_tokens=64, prefix_cache_host_tokens=64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fast", [False, True])
def test_cuda_host_tier_spills_to_pinned_memory_and_stays_exact(fast):
    """On a GPU: the host-driven path and the GPU fast path (CUDA graphs) with a device tier too small for the
    workload and a pinned host tier = the host path without a cache."""
    from grserve.model import load_model

    gpu_model = load_model("tiny", seed=3, device="cuda")
    catalog = grid_catalog(40, seed=0, first_id=100)
    prompts = _workload(seed=5)
    off = _run(_engine(gpu_model, catalog), prompts)
    prefix = PrefixCacheConfig(prefix_cache_tokens=64, prefix_block_size=8, prefix_cache_host_tokens=4096,
                               prefix_cache_policy="lru")
    accel = AccelConfig(fast_path="on", batch_buckets="1,2,4,8", prompt_bucket=64) if fast else None
    on_engine = RetrievalEngine(gpu_model, CatalogStore(catalog), SearchConfig(), SchedulerConfig(), accel=accel,
                                prefix=prefix)
    on = _run(on_engine, prompts)
    for a, b in zip(off, on):
        _same(a, b)
    c = on_engine.prefix
    assert c.stats["spilled_blocks"] > 0 and c.stats["host_hit_blocks"] > 0
    assert all(b.k.is_pinned() for b in c.tiers[1].blocks.values())
    c.check()
