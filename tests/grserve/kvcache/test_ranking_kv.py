"""KV stores (paged store, user cache, item pool, meta service) and the ranking engine's cache use:
stored KV round-trips exactly, cached tokens are never recomputed, and every policy's scores equal the
explicit-mask recomputation of the layout it chose (fp32, ≤ 1e-5 on probabilities)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grserve.attention.bipartite import reference_forward
from grserve.config import RankingConfig
from grserve.engine.ranking_engine import RankingEngine
from grserve.engine.ranking_runner import RankingRequest, RankingRunner
from grserve.kvcache.meta import CacheMetaService, DecayedWindowFrequency
from grserve.kvcache.paged import PagedKVStore
from grserve.kvcache.user_cache import UserKVCache
from grserve.ranking.layouts import ITEM_PREFIX, USER_PREFIX, build_prompt
from grserve.ranking.registry import RegistryError, synthetic_registry
from grserve.ranking.scoring import score_candidates


def _kv(n, seed=0, L=2, H=2, D=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, n, H, D, generator=g)


def test_paged_store_roundtrip_and_accounting():
    s = PagedKVStore(2, 2, 4, num_pages=10, page_size=4)
    a, b, c = _kv(5, 1), _kv(8, 2), _kv(1, 3)
    assert s.put("a", a) and s.put("b", b) and s.put("c", c)
    assert s.free_pages == 10 - 2 - 2 - 1
    assert torch.equal(s.get("a"), a) and torch.equal(s.get("b"), b)
    assert torch.equal(s.get_concat(["c", "a", "b"]), torch.cat([c, a, b], dim=2))
    assert not s.put("d", _kv(30))  # does not fit: nothing stored
    assert "d" not in s and s.free_pages == 5
    s.remove("b")
    assert s.free_pages == 7 and torch.equal(s.get("a"), a)
    assert s.used_bytes == 3 * s.bytes_per_page
    s2 = PagedKVStore.with_capacity_bytes(10_000, 2, 2, 4, page_size=4)
    assert s2.capacity_bytes <= 10_000 and s2.capacity_bytes + s2.bytes_per_page > 10_000


def test_decayed_window_frequency():
    f = DecayedWindowFrequency(window_s=10.0)
    f.touch("u", 0.0)
    f.touch("u", 0.0)
    assert f.get("u", 0.0) == 2.0
    assert math.isclose(f.get("u", 10.0), 2 * math.exp(-1), rel_tol=1e-12)
    f.touch("u", 10.0)
    assert math.isclose(f.get("u", 20.0), (2 * math.exp(-1) + 1) * math.exp(-1), rel_tol=1e-12)
    m = CacheMetaService(user_window_s=10.0)
    assert m.record_request(7, [1, 2], 0.0) == 0.0  # prediction = frequency before this request
    assert m.record_request(7, [1], 0.0) == 1.0
    assert m.item_frequencies(0.0) == {1: 2.0, 2: 1.0}


def test_user_cache_lru_and_frequency_replacement():
    freqs = {1: 5.0, 2: 0.5, 3: 2.0}
    store = PagedKVStore(2, 2, 4, num_pages=6, page_size=4)
    lru = UserKVCache(store, "lru")
    for u in (1, 2, 3):
        assert lru.admit(u, _kv(8, u), lru.plan_admission(8))
    lru.get(1)  # 1 is now most recent → 2 is the LRU victim
    assert lru.plan_admission(8) == [2]
    fc = UserKVCache(PagedKVStore(2, 2, 4, num_pages=6, page_size=4), "frequency",
                     lambda us: {u: freqs[u] for u in us})
    for u in (1, 2, 3):
        fc.admit(u, _kv(8, u), fc.plan_admission(8, 9.0))
    assert fc.min_frequency() == 0.5
    assert fc.plan_admission(8, 1.0) == [2]  # lowest frequency first, only below the newcomer's
    assert fc.plan_admission(16, 1.0) is None  # would need user 3 (f=2 ≥ 1): refused
    assert fc.plan_admission(16, 3.0) == [2, 3]
    assert fc.plan_admission(100, 99.0) is None  # larger than the whole cache
    fc.admit(4, _kv(8, 4), fc.plan_admission(8, 1.0))
    assert 2 not in fc and 4 in fc and fc.evictions == 1
    assert torch.equal(fc.get(4), _kv(8, 4))
    assert fc.store.used_bytes <= fc.store.capacity_bytes


def test_kv_size_formula():
    from grserve.model.spec import PRESETS
    s = PRESETS["qwen2-1.5b"]
    assert s.kv_bytes_per_token(2) == 28672  # paper Table 2


# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=2)


def _registry(vocab, n_users=6):
    rng = np.random.default_rng(0)
    lens = [int(x) for x in rng.integers(20, 90, size=n_users)]
    return synthetic_registry(vocab, 40, (3, 7), lens, seed=3)


def _req(reg, user, items, now):
    return RankingRequest(reg.user_tokens(user), [reg.item_tokens(i) for i in items], user_id=user,
                          item_ids=list(items), top_k=len(items), now=now)


def _reference_scores(model, reg, user, items, layout):
    p = build_prompt(layout, reg.user_tokens(user), [reg.item_tokens(i) for i in items], reg.instruction,
                     reg.notation)
    h, _ = reference_forward(model, p)
    return np.array(score_candidates(h[-1], model.lm_head.weight, torch.from_numpy(p.identifier_tokens),
                                     len(items)).all_scores)


@pytest.mark.parametrize("policy", ["bat", "user_prefix", "item_prefix", "greedy_size", "recompute"])
def test_every_policy_scores_equal_reference_and_counts_tokens(model, policy):
    reg = _registry(model.spec.vocab_size)
    runner = RankingRunner(model, reg, RankingConfig(policy=policy, user_cache_bytes=1 << 20, page_size=8))
    rng = np.random.default_rng(1)
    reqs = []
    for t in range(10):
        u = int(rng.integers(0, 3))
        items = [int(x) for x in rng.choice(40, size=5, replace=False)]
        reqs.append(_req(reg, u, items, float(t)))
    results = []
    for k in range(0, 10, 3):  # batches of 3 requests
        results += runner.run(reqs[k:k + 3])
    for req, res in zip(reqs, results):
        ref = _reference_scores(model, reg, req.user_id, req.item_ids, res.layout)
        full = np.zeros(len(req.item_ids))
        full[res.order] = res.scores
        np.testing.assert_allclose(full, ref, atol=1e-5, rtol=0)
        assert res.computed_tokens + res.cached_tokens == res.total_tokens == req.num_tokens + len(reg.instruction)
    st = runner.stats.summary()
    assert st["computed_tokens"] + st["cached_tokens"] == st["total_tokens"]
    if policy == "recompute":
        assert st["cached_tokens"] == 0
    if policy == "item_prefix":
        assert st["cached_user_tokens"] == 0 and st["item_hit_rate"] == 1.0
    if policy == "user_prefix":
        assert st["cached_item_tokens"] == 0 and st["user_hits"] > 0
        hits = [r for r in results if r.user_cache_hit]
        assert all(r.cached_tokens == len(reg.user_tokens(q.user_id)) for q, r in zip(reqs, results)
                   if r.user_cache_hit) and hits


def test_item_pool_entries_equal_items_computed_alone(model):
    reg = _registry(model.spec.vocab_size)
    runner = RankingRunner(model, reg, RankingConfig(policy="item_prefix"))
    assert len(runner.item_pool) == reg.num_items
    for iid in (0, 17, 39):
        toks = reg.item_tokens(iid)
        p = build_prompt(ITEM_PREFIX, reg.user_tokens(0)[:1], [toks], reg.instruction)
        _, ctx = reference_forward(model, p)
        assert torch.allclose(runner.item_pool.get(iid), ctx.kv(0, len(toks)), atol=1e-4, rtol=0)


def test_ip_miss_is_computed_and_written_back(model):
    reg = _registry(model.spec.vocab_size)
    runner = RankingRunner(model, reg, RankingConfig(policy="item_prefix"))
    runner.item_pool.remove(5)
    items = [5, 6, 7]
    r1 = runner.run([_req(reg, 0, items, 0.0)])[0]
    assert r1.computed_tokens == len(reg.user_tokens(0)) + len(reg.instruction) + len(reg.item_tokens(5))
    assert 5 in runner.item_pool
    r2 = runner.run([_req(reg, 0, items, 1.0)])[0]
    assert r2.computed_tokens == len(reg.user_tokens(0)) + len(reg.instruction)
    np.testing.assert_allclose(r1.scores, r2.scores, atol=1e-5)


def test_registry_change_invalidates_user_kv(model):
    reg = _registry(model.spec.vocab_size)
    runner = RankingRunner(model, reg, RankingConfig(policy="user_prefix", user_cache_bytes=1 << 20))
    runner.run([_req(reg, 1, [1, 2], 0.0)])
    assert 1 in runner.user_cache
    reg.add_user(1, np.arange(100, 150))
    assert 1 not in runner.user_cache
    res = runner.run([_req(reg, 1, [1, 2], 1.0)])[0]
    ref = _reference_scores(model, reg, 1, [1, 2], USER_PREFIX)
    full = np.zeros(2)
    full[res.order] = res.scores
    np.testing.assert_allclose(full, ref, atol=1e-5)
    with pytest.raises(RegistryError):
        reg.add_item(3, [model.spec.vocab_size])


def test_engine_threads_return_every_result(model):
    reg = _registry(model.spec.vocab_size)
    runner = RankingRunner(model, reg, RankingConfig(policy="bat", max_batch_requests=4))
    with RankingEngine(runner) as eng:
        reqs = [_req(reg, k % 4, [k, k + 1, k + 2], float(k)) for k in range(9)]
        futs = [eng.submit(r).future for r in reqs]
        res = [f.result(timeout=120) for f in futs]
    assert [r.request_id for r in res] == [q.request_id for q in reqs]
    assert runner.stats.requests == 9 and runner.stats.batches >= 3
