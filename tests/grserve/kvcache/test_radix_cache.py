"""Radix prefix-KV cache: prefix matching against a brute-force model, values, locking, leaf-only eviction
through every policy, the content-addressed node keys and the prefix oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve_bench import traces as T
from grserve.eviction import make_policy
from grserve.kvcache.radix import RadixCache, prefix_hashes
from grserve_bench.eviction import AccessListOracle, NoisyPredictor
from grserve_bench.eviction.oracle import prefix_access_times


def _lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


prompts_st = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=25)


@settings(max_examples=150, deadline=None)
@given(prompts_st)
def test_unbounded_match_is_longest_common_prefix(prompts):
    tree = RadixCache(10_000, policy="lru")
    seen = []
    for r, p in enumerate(prompts):
        m = tree.match_prefix(p, now=r)
        assert m.length == max((_lcp(p, q) for q in seen), default=0)
        # every returned value names (request, position) of a cached token equal to this prompt's token
        for i, v in enumerate(m.values.tolist()):
            q, pos = divmod(v, 100)
            assert pos == i and seen[q][: i + 1] == p[: i + 1]
        tree.insert(p, values=[r * 100 + i for i in range(len(p))], now=r)
        seen.append(p)
        tree.check()


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady", "fpb", "hf", "laru"])
@settings(max_examples=40, deadline=None)
@given(prompts=prompts_st, cap=st.integers(1, 20))
def test_bounded_tree_any_policy(policy, prompts, cap):
    times = prefix_access_times([np.asarray(p) for p in prompts])
    kw = {}
    if policy == "belady":
        kw["oracle"] = AccessListOracle(times)
    elif policy in ("fpb", "hf", "laru"):
        kw["predictor"] = NoisyPredictor(AccessListOracle(times), 0.3, seed=1)
    tree = RadixCache(cap, policy=make_policy(policy, cap, **kw))
    freed_values = []
    tree.on_evict = freed_values.append
    total = sum(len(p) for p in prompts)
    for r, p in enumerate(prompts):
        m = tree.match_prefix(p, now=r)
        tree.lock(m.last_node)
        already = tree.insert(p, now=r)
        assert already == m.length
        # the locked matched prefix survived the insert's evictions
        if m.length:
            assert tree.match_prefix(p[: m.length], now=r).length == m.length
        tree.unlock(m.last_node)
        tree.check()
        # node keys are content addresses known to the unbounded-tree oracle
        assert all(ident in times for ident in tree.nodes)
    assert tree.size <= cap
    assert sum(len(v) for v in freed_values) == tree.stats["evicted_tokens"] <= total


def test_locked_nodes_are_not_evicted_and_leaf_only():
    tree = RadixCache(12, policy="lru")
    tree.insert([1, 2, 3, 4], now=0)
    tree.insert([1, 2, 3, 9, 9], now=1)  # splits [1,2,3,4] -> [1,2,3] + [4]; new leaf [9,9]
    tree.check()
    assert tree.stats["splits"] == 1 and tree.size == 6
    m = tree.match_prefix([1, 2, 3, 4], now=2)
    assert m.length == 4
    tree.lock(m.last_node)
    assert tree.evict(100) == 2  # only the unlocked leaf [9,9] can go; inner [1,2,3] and locked [4] stay
    assert tree.match_prefix([1, 2, 3, 4], now=3).length == 4
    tree.unlock(m.last_node)
    assert tree.evict(100) == 4  # leaf [4] goes first, then its parent becomes an evictable leaf
    assert tree.size == 0 and not tree.nodes
    with pytest.raises(RuntimeError):
        tree.unlock(m.last_node)


def test_insert_evicts_lru_leaf_to_fit():
    tree = RadixCache(6, policy="lru")
    tree.insert([1, 1, 1], now=0)
    tree.insert([2, 2, 2], now=1)
    tree.match_prefix([1, 1, 1], now=2)  # [1,1,1] is now more recent
    tree.insert([3, 3, 3], now=3)
    assert tree.match_prefix([2, 2, 2], now=4).length == 0
    assert tree.match_prefix([1, 1, 1], now=5).length == 3
    tree.check()


def test_prefix_hashes_are_segmentation_independent():
    a = np.array([5, 6, 7, 8, 9])
    h = prefix_hashes(a)
    assert len(h) == 6 and h[0] == 0
    assert h[3] == prefix_hashes(a[:3])[3]
    assert prefix_hashes(np.array([5, 6, 7, 1]))[3] == h[3] and prefix_hashes(np.array([5, 6, 8]))[3] != h[3]


def test_prediction_induced_miss_is_detected_on_the_tree():
    # LARU with fully inverted predictions evicts the prefix that comes back soonest; its return is a Line-14 miss
    reqs = T.conversations(60, scale=0.02, seed=1)
    prompts = [r.tokens for r in reqs]
    times = prefix_access_times(prompts)
    cap = 400
    laru = make_policy("laru", cap, predictor=NoisyPredictor(AccessListOracle(times), 1.0))
    tree = RadixCache(cap, policy=laru)
    for r, p in enumerate(prompts):
        tree.match_prefix(p, now=r)
        tree.insert(p, now=r)
    assert laru.stats["line14"] > 0 and laru.stats["line25"] > 0
    # with exact predictions: never
    laru0 = make_policy("laru", cap, predictor=AccessListOracle(times))
    tree0 = RadixCache(cap, policy=laru0)
    opt = RadixCache(cap, policy=make_policy("belady", cap, oracle=AccessListOracle(times)))
    lru = RadixCache(cap, policy="lru")
    for r, p in enumerate(prompts):
        for t in (tree0, opt, lru):
            t.match_prefix(p, now=r)
            t.insert(p, now=r)
    # Theorem 2 is a paging result; on a tree (variable-size nodes, several evictions per miss, nodes sharing one
    # next-use time) exact predictions can still cause a rare Line-14 miss, so only "close to OPT" is asserted
    assert laru0.stats["line14"] <= 0.01 * laru0.stats["line25"]
    assert tree0.hit_rate >= 0.95 * opt.hit_rate and opt.hit_rate > lru.hit_rate + 0.02
