"""Prefix-choice policies (BAT §5.3) on hand-built queries, and their effect on a bound user cache."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.scheduler.prefix_choice import (ITEM_PREFIX, USER_PREFIX, BatPolicy, PrefixQuery, make_policy)


def q(**kw):
    base = dict(user_tokens=2000, item_tokens=1000, cached_item_tokens=1000, cacheable_user=True,
                user_cached=False, user_frequency=2.0, min_cached_frequency=1.0, user_fits_free=False,
                user_evictable=True)
    base.update(kw)
    return PrefixQuery(**base)


def test_bat_rule_cases():
    bat = make_policy("bat")
    assert bat.choose(q(user_tokens=999)).layout == ITEM_PREFIX  # τ_u < τ_i → IP always
    d = bat.choose(q())  # long, f_u > min f_p → UP, admitted with eviction
    assert d.layout == USER_PREFIX and d.admit_user and not d.read_user_cache
    assert bat.choose(q(user_frequency=1.0)).layout == ITEM_PREFIX  # strict ">"
    assert bat.choose(q(user_frequency=0.5)).layout == ITEM_PREFIX
    d = bat.choose(q(user_frequency=0.0, user_cached=True, min_cached_frequency=0.0))  # a hit stays UP
    assert d.layout == USER_PREFIX and d.read_user_cache
    assert bat.choose(q(user_frequency=0.0, user_fits_free=True)).admit_user  # free space: admit
    assert bat.choose(q(user_evictable=False)).layout == ITEM_PREFIX  # cannot free enough → IP
    assert bat.choose(q(cacheable_user=False)).layout == ITEM_PREFIX  # raw-token users
    cached_mode = BatPolicy(item_tokens="cached")
    assert cached_mode.choose(q(user_tokens=900, item_tokens=1000, cached_item_tokens=500)).layout == USER_PREFIX


def test_baselines():
    assert make_policy("up").choose(q(user_tokens=10)).layout == USER_PREFIX
    assert make_policy("up").choose(q(user_cached=True)).read_user_cache
    assert make_policy("up").choose(q(user_frequency=0.0)).admit_user  # LRU admits everyone
    assert make_policy("ip").choose(q(user_cached=True)).layout == ITEM_PREFIX
    g = make_policy("greedy_size")
    assert g.choose(q(user_tokens=1000)).layout == USER_PREFIX
    assert g.choose(q(user_tokens=999)).layout == ITEM_PREFIX
    assert g.choose(q(user_frequency=0.0)).admit_user  # cache-agnostic: frequency ignored
    d = make_policy("recompute").choose(q(user_cached=True))
    assert d.layout == USER_PREFIX and not (d.read_user_cache or d.admit_user or d.read_item_cache)
    with pytest.raises(ValueError):
        make_policy("nope")


@settings(max_examples=200, deadline=None)
@given(tu=st.integers(1, 5000), ti=st.integers(1, 5000), fu=st.floats(0, 10), fmin=st.floats(0, 10),
       cached=st.booleans(), free=st.booleans(), evict=st.booleans())
def test_bat_never_admits_when_it_cannot_fit_and_matches_printed_rule(tu, ti, fu, fmin, cached, free, evict):
    d = make_policy("bat").choose(q(user_tokens=tu, item_tokens=ti, user_frequency=fu, min_cached_frequency=fmin,
                                    user_cached=cached, user_fits_free=free, user_evictable=evict))
    if tu < ti:
        assert d.layout == ITEM_PREFIX
    elif not cached and not free and (fu > fmin) and evict:
        assert d.layout == USER_PREFIX and d.admit_user  # the printed rule's "user" branch
    if d.admit_user:
        assert free or evict
    if d.layout == USER_PREFIX and not cached and not free:
        assert fu > fmin  # displacing someone needs a strictly higher frequency


def test_bat_protects_frequent_users_in_a_bound_cache():
    """T9(c): with a small user cache, once-seen long users churn an LRU cache; BAT keeps the frequent ones."""
    from grserve.kvcache.meta import CacheMetaService
    from grserve.kvcache.paged import PagedKVStore
    from grserve.kvcache.user_cache import UserKVCache

    rng = np.random.default_rng(0)
    trace = []
    for t in range(400):  # 4 frequent users interleaved with one-off users
        trace.append(int(rng.integers(0, 4)) if t % 2 == 0 else 1000 + t)

    def hits(name):
        meta = CacheMetaService(user_window_s=50.0)
        pol = make_policy(name)
        store = PagedKVStore(1, 1, 1, num_pages=4, page_size=1)  # room for 4 users of 1 token
        cache = UserKVCache(store, pol.user_replacement, lambda us: meta.user_frequencies(us, now))
        n_hit = 0
        for now, u in enumerate(trace):
            f = meta.record_request(u, [], float(now))
            d = pol.choose(PrefixQuery(1, 0, 0, True, u in cache, f, cache.min_frequency(), cache.fits_free(1),
                                       cache.plan_admission(1, f) is not None))
            if d.read_user_cache:
                n_hit += 1
                cache.get(u)
            elif d.admit_user:
                cache.admit(u, __import__("torch").zeros(1, 2, 1, 1, 1), cache.plan_admission(1, f))
        return n_hit

    assert hits("bat") > 1.5 * hits("user_prefix")


def test_workload_has_the_papers_statistics():
    """The bench trace (BAT §2.5 digest): > 55% of users once, ≈ 90% of realized candidate accesses on the top 10%
    of items, 100 candidates × 10–18 tokens, long-tailed profiles capped at 8K."""
    from grserve.ranking.workload import WorkloadSpec
    from grserve_bench.ranking_trace import generate_workload

    reg, trace, st = generate_workload(WorkloadSpec(num_items=2000, num_users=40, seed=3), vocab_size=32000)
    assert st["users_seen_once"] > 0.55
    assert abs(st["top10pct_access_share"] - 0.9) < 0.02
    assert all(len(r.item_ids) == 100 == len(set(r.item_ids)) for r in trace)
    lens = [len(reg.item_tokens(i)) for i in reg.item_ids()]
    assert min(lens) >= 10 and max(lens) <= 18
    assert st["profile_max"] <= 8192 and st["profile_mean"] > st["profile_median"]  # right-skewed
    assert [r.time_s for r in trace] == sorted(r.time_s for r in trace)
    # the cacheable ceiling: at least the item share (IP for every request), at most everything; a trace whose
    # every user is new can cache its items only
    assert st["item_token_share"] - 1e-9 <= st["cacheable_share_ceiling"] <= 1.0
    _, _, once = generate_workload(WorkloadSpec(num_items=2000, num_users=10, once_fraction=1.0, seed=3), 32000)
    assert abs(once["cacheable_share_ceiling"] - once["item_token_share"]) < 1e-9
