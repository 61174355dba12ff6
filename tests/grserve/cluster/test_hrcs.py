"""HRCS (BAT §5.2, Algorithm 1), the placement and its re-placement, and a KV-cache worker's store — without Ray
(the served placement on Ray: ``test_cluster_hrcs.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import asyncio

from grserve.cluster.gr.hrcs import compute_replication_ratio, hrcs_placement, max_comm_ratio, place_new, replicate
from grserve.cluster.gr.kv_workers import KVCacheWorker, item_kv
from grserve_bench.hrcs_compare import hash_placement, replicate_placement

L, H, D, PS = 2, 2, 4, 4


def _ratio(F, B=1000.0, alpha=0.1, t=1.0, c=10, tau_i=10.0, N=4, factor="paper"):
    return compute_replication_ratio(B, F, 100.0, tau_i, alpha, c, N, t, factor)


def test_algorithm1_properties():
    skewed = np.r_[np.full(10, 90 / 10), np.full(90, 10 / 90)]  # 90% of mass on 10% of items
    uniform = np.ones(100)
    assert _ratio(uniform, N=1) == 1.0  # one worker: everything local
    # R_max = α t B (N-1) / (c τ_i N): choose B so that R_max = 0.1
    b = 0.1 * 10 * 10 * 4 / (0.1 * 1.0 * 3)
    assert abs(max_comm_ratio(0.1, 1.0, b, 10, 10.0, 4) - 0.1) < 1e-12
    assert abs(_ratio(skewed, B=b) - 0.10) <= 0.01  # T7: 90/10 with R_max = 0.1 → r ≈ 0.1
    assert abs(_ratio(uniform, B=b) - 0.90) <= 0.01  # T7: uniform → r ≈ 1 − R_max
    rs = [_ratio(skewed, B=x) for x in (10, 100, 300, 1000, 1e4)]
    assert all(a >= b_ for a, b_ in zip(rs, rs[1:]))  # non-increasing in B
    ra = [_ratio(skewed, B=300, alpha=x) for x in (0.01, 0.1, 0.5, 1.0)]
    assert all(a >= b_ for a, b_ in zip(ra, ra[1:]))  # non-increasing in α
    assert _ratio(skewed, B=1e9) == 0.01  # R_max ≥ 1: line 12 fires at i = 1
    # the derived factor N/(N-1) allows more communication than the printed (N-1)/N
    assert max_comm_ratio(0.1, 1, b, 10, 10, 4, "derived") > max_comm_ratio(0.1, 1, b, 10, 10, 4, "paper")
    with pytest.raises(ValueError):
        max_comm_ratio(0.1, 1, 1, 1, 1, 2, "nope")


def test_placements_cover_every_item():
    items = list(range(50))
    freq = {i: 1.0 / (i + 1) for i in items}
    p = hrcs_placement(items, freq, 0.2, 3)
    assert p.replicated == set(range(10))  # the hottest 20%
    for w in range(3):
        assert set(range(10)) <= set(p.items_on(w))
    shards = [set(p.items_on(w)) - p.replicated for w in range(3)]
    assert set().union(*shards) == set(range(10, 50)) and sum(map(len, shards)) == 40
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # uniform partition
    assert replicate_placement(items, 3).owners(7) == frozenset({0, 1, 2})
    assert hash_placement(items, 3).owners(7) == frozenset({1})


def test_replacement_keeps_homes_and_moves_only_the_hot_set():
    items = list(range(30))
    p = hrcs_placement(items, {i: -i for i in items}, 0.1, 3)  # 0, 1, 2 replicated
    q = replicate(p, {i: float(i) for i in items}, 0.1)  # hotness flips: 29, 28, 27 are now the hottest
    assert q.replicated == {27, 28, 29} and q.home == p.home and p.replicated == {0, 1, 2}
    assert replicate(p, {}, 0.0).replicated == set()
    r = place_new(q, [30, 31, 5])  # new items go to the workers with the fewest homes; known ones keep theirs
    counts = [sum(1 for w in p.home.values() if w == k) for k in range(3)]
    assert r.home[5] == p.home[5] and {r.home[30], r.home[31]} <= {k for k in range(3) if counts[k] == min(counts)}
    assert r.replicated == q.replicated and 30 not in q.home


def test_kv_cache_worker_stores_items_and_grows():
    g = torch.Generator().manual_seed(0)
    kvs = {i: torch.randn(L, 2, 2 + i % 7, H, D, generator=g) for i in range(40)}
    w = KVCacheWorker(0, page_size=PS)
    run = asyncio.run
    assert run(w.put(item_kv(list(kvs.items())[:10]))) == 10
    assert run(w.put(item_kv(list(kvs.items())[10:]))) == 30  # more than the first pool held: it grew
    ans = run(w.get([3, 99, 17, 0]))  # only what it holds, in the order asked
    assert ans.item_ids == (3, 17, 0) and ans.lengths == tuple(kvs[i].shape[2] for i in (3, 17, 0))
    assert torch.equal(ans.kv, torch.cat([kvs[i] for i in (3, 17, 0)], dim=2))
    assert run(w.drop([3, 99])) == 1 and run(w.get([3])).item_ids == ()
    st = run(w.poll(0)).stats
    pages = sum(-(-kvs[i].shape[2] // PS) for i in kvs if i != 3)
    assert st["items"] == 39 and st["stored_bytes"] == pages * w.store.bytes_per_page
