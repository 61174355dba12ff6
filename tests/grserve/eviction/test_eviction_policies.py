"""Eviction policies: the recency index against its list twin, LRU/Belady against libcachesim, baselines against
brute-force references, locking semantics and the registry."""

from __future__ import annotations

import os
import random
from collections import OrderedDict
from typing import Hashable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.eviction import NoEvictableKey, make_policy, policy_names
from grserve_bench.eviction import AccessListOracle, simulate
from grserve.eviction.recency import NEG_INF, RecencyIndex


class ReferenceRecency:
    """Slow twin of ``RecencyIndex`` (a Python list in recency order), for tests."""

    def __init__(self):
        self.order: list[Hashable] = []
        self.val: dict[Hashable, float] = {}
        self.ev: dict[Hashable, bool] = {}

    def touch(self, key, value=None, evictable=None):
        if key in self.ev:
            self.order.remove(key)
        else:
            self.val[key] = NEG_INF if value is None else value
            self.ev[key] = True if evictable is None else evictable
        if value is not None:
            self.val[key] = value
        if evictable is not None:
            self.ev[key] = evictable
        self.order.append(key)

    def remove(self, key):
        self.order.remove(key)
        del self.val[key], self.ev[key]

    def set_value(self, key, value):
        self.val[key] = value

    def set_evictable(self, key, evictable):
        self.ev[key] = evictable

    def evictable_order(self):
        return [k for k in self.order if self.ev[k]]

    def oldest(self, l=1):
        return self.evictable_order()[l - 1]

    def argmax_among_oldest(self, l):
        cand = self.evictable_order()[:l]
        best = cand[0]
        for k in cand[1:]:
            if self.val[k] > self.val[best]:
                best = k
        return best


# ---- RecencyIndex == ReferenceRecency ------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["touch", "remove", "val", "ev", "q"]), st.integers(0, 12),
                          st.integers(-3, 3), st.booleans(), st.integers(1, 14)), max_size=120))
def test_recency_index_matches_reference(ops):
    fast, ref = RecencyIndex(2), ReferenceRecency()  # tiny size hint: forces many rebuilds / growth
    for op, key, val, flag, l in ops:
        if op == "touch":
            fast.touch(key, value=float(val), evictable=flag)
            ref.touch(key, value=float(val), evictable=flag)
        elif key not in ref.ev:
            continue
        elif op == "remove":
            fast.remove(key)
            ref.remove(key)
        elif op == "val":
            fast.set_value(key, float(val))
            ref.set_value(key, float(val))
        elif op == "ev":
            fast.set_evictable(key, flag)
            ref.set_evictable(key, flag)
        order = ref.evictable_order()
        assert fast.n_evictable == len(order) and len(fast) == len(ref.order)
        assert list(fast.keys()) == ref.order
        if order:
            ll = min(l, len(order))
            assert fast.oldest(ll) == order[ll - 1]
            assert fast.argmax_upto(fast.oldest_position(ll)) == ref.argmax_among_oldest(ll)
            assert fast.oldest_keys(ll) == order[:ll]


# ---- libcachesim cross-check ---------------------------------------------------------------------------------
def _libcachesim_miss_ratio(trace: list[int], cache_size: int, algo: str, tmp_path) -> float:
    lcs = pytest.importorskip("libcachesim")
    csv = os.path.join(tmp_path, f"t{len(trace)}_{cache_size}.csv")
    with open(csv, "w") as f:
        for t, k in enumerate(trace):
            f.write(f"{t + 1},{k + 1}\n")
    params = lcs.ReaderInitParam(has_header=False, has_header_set=True, delimiter=",", ignore_obj_size=True)
    params.time_field, params.obj_id_field = 1, 2
    reader = lcs.TraceReader(csv, lcs.TraceType.CSV_TRACE, params)
    if algo == "lru":
        return lcs.LRU(cache_size).process_trace(reader)[0]
    # Belady needs next-access times: convert to libCacheSim's oracleGeneral format with its own tool
    og = csv + ".oracleGeneral"
    lcs.Util.convert_to_oracleGeneral(reader._reader, og)
    return lcs.Belady(cache_size).process_trace(lcs.TraceReader(og, lcs.TraceType.ORACLE_GENERAL_TRACE))[0]


def _traces():
    rng = np.random.default_rng(7)
    from grserve_bench import traces

    return [
        ("uniform", rng.integers(0, 60, 3000).tolist(), 16),
        ("zipf", traces.zipf(6000, n_keys=2000, alpha=0.9, seed=3), 100),
        ("loop", traces.loop(3000, 150), 100),
        ("scan_hot", traces.scan_hot(5000, n_hot=200, scan_len=300, scan_every=700, seed=1), 64),
    ]


@pytest.mark.parametrize("name,trace,k", _traces(), ids=lambda v: v if isinstance(v, str) else "")
def test_lru_and_belady_match_libcachesim(name, trace, k, tmp_path):
    lru = simulate(trace, make_policy("lru", k))
    bel = simulate(trace, make_policy("belady", k, oracle=AccessListOracle.from_trace(trace)))
    n = len(trace)
    assert lru.misses == round(_libcachesim_miss_ratio(trace, k, "lru", str(tmp_path)) * n)
    assert bel.misses == round(_libcachesim_miss_ratio(trace, k, "belady", str(tmp_path)) * n)
    assert bel.misses <= lru.misses


# ---- references ----------------------------------------------------------------------------------------------
def _lru_reference(trace, k):
    od, ev = OrderedDict(), []
    for x in trace:
        if x in od:
            od.move_to_end(x)
            continue
        if len(od) >= k:
            ev.append(od.popitem(last=False)[0])
        od[x] = True
    return ev


def _belady_reference_misses(trace, k):
    cached, misses = set(), 0
    for t, x in enumerate(trace):
        if x in cached:
            continue
        misses += 1
        if len(cached) >= k:
            def nxt(y):
                for u in range(t + 1, len(trace)):
                    if trace[u] == y:
                        return u
                return float("inf")
            cached.remove(max(cached, key=nxt))
        cached.add(x)
    return misses


def _lfu_reference(trace, k, window):
    cached, last, ev = set(), {}, []
    for t, x in enumerate(trace):
        if x not in cached and len(cached) >= k:
            recent = trace[max(0, t - window):t]

            def score(y):
                return (recent.count(y), last[y])
            z = min(cached, key=score)
            cached.remove(z)
            ev.append(z)
        cached.add(x)
        last[x] = t
    return ev


traces_st = st.tuples(st.lists(st.integers(0, 15), min_size=1, max_size=150), st.integers(1, 8))


@settings(max_examples=120, deadline=None)
@given(traces_st)
def test_lru_belady_fpb_hf_against_references(tk):
    trace, k = tk
    assert simulate(trace, make_policy("lru", k), record_evictions=True).evictions == _lru_reference(trace, k)
    opt = _belady_reference_misses(trace, k)
    assert simulate(trace, make_policy("belady", k, oracle=AccessListOracle.from_trace(trace))).misses == opt
    # FPB with exact next-access times is Belady's rule
    assert simulate(trace, make_policy("fpb", k, predictor=AccessListOracle.from_trace(trace))).misses == opt
    # HF with a single candidate is LRU
    hf1 = make_policy("hf", k, predictor=AccessListOracle.from_trace(trace), candidates=1)
    assert simulate(trace, hf1, record_evictions=True).evictions == _lru_reference(trace, k)


@settings(max_examples=80, deadline=None)
@given(traces_st, st.integers(1, 30))
def test_window_lfu_against_reference(tk, window):
    trace, k = tk
    got = simulate(trace, make_policy("lfu", k, window=window), record_evictions=True).evictions
    assert got == _lfu_reference(trace, k, window)


def test_hf_uses_predictions_within_its_four_oldest():
    trace = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 6]
    # k = 5: at t=5 the 4 oldest are 0..3; the oracle says 3 comes back last among them -> HF evicts 3, LRU 0
    hf = simulate(trace, make_policy("hf", 5, predictor=AccessListOracle.from_trace(trace)), record_evictions=True)
    assert hf.evictions[0] == 3
    assert _lru_reference(trace, 5)[0] == 0


# ---- locking and registry ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["lru", "lfu", "belady", "fpb", "hf", "laru"])
def test_locked_keys_are_never_victims(name):
    rng = random.Random(0)
    trace = [rng.randrange(40) for _ in range(600)]
    kw = {"oracle": AccessListOracle.from_trace(trace)} if name == "belady" else {}
    if name in ("fpb", "hf", "laru"):
        kw["predictor"] = AccessListOracle.from_trace(trace)
    pol = make_policy(name, 8, **kw)
    cached: set[int] = set()
    locked: set[int] = set()
    for t, x in enumerate(trace):
        if x in cached:
            pol.on_hit(x, t)
        else:
            pol.on_miss(x, t)
            if len(cached) >= 8:
                if len(locked) == len(cached):
                    with pytest.raises(NoEvictableKey):
                        pol.victim(t)
                    continue
                z = pol.victim(t)
                assert z in cached and z not in locked
                cached.remove(z)
            pol.on_insert(x, t)
            cached.add(x)
        if rng.random() < 0.3:  # lock or unlock something
            y = rng.choice(sorted(cached))
            flag = y in locked
            pol.set_evictable(y, flag)
            (locked.discard if flag else locked.add)(y)
    assert len(pol) == len(cached)


def test_registry():
    assert set(policy_names()) >= {"lru", "lfu", "belady", "fpb", "hf", "laru"}
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("arc", 4)
    with pytest.raises(ValueError):
        make_policy("laru", 4)  # needs a predictor
    with pytest.raises(ValueError):
        make_policy("belady", 4)  # needs the future
    pol = make_policy("laru", 16, predictor=AccessListOracle({}))  # Algorithm 1's defaults: b = 2, SYNC
    assert pol.name == "laru" and pol.b == 2.0 and pol.mode == "sync" and pol.decay_every == 1
