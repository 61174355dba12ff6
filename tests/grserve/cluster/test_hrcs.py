"""HRCS (BAT §5.2, Algorithm 1), placements, re-replication, and KV-cache workers — in process and as Ray
actors (skipped only when ray cannot be imported)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grserve.cluster.gr.hrcs import (ReReplicator, compute_replication_ratio, hash_placement, hrcs_placement,
                                  max_comm_ratio, replicate_placement)
from grserve.cluster.gr.kv_workers import ClusterItemSource, make_meta_service, start_workers, stop_workers
from grserve.kvcache.item_pool import ItemKVPool
from grserve.kvcache.paged import PagedKVStore

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


def _pool(n_items=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = ItemKVPool(PagedKVStore(L, H, D, num_pages=200, page_size=PS))
    lens = {}
    for i in range(n_items):
        lens[i] = 2 + i % 7
        pool.put(i, torch.randn(L, 2, lens[i], H, D, generator=g))
    return pool, lens


def _check_source(use_ray: bool):
    pool, lens = _pool()
    bpt = pool.store.bytes_per_token
    items = list(range(30))
    for placement in (hrcs_placement(items, {i: -i for i in items}, 0.2, 2), hash_placement(items, 2),
                      replicate_placement(items, 2)):
        handles = start_workers(placement, pool, use_ray=use_ray)
        try:
            src = ClusterItemSource(0, handles, placement)
            req = [3, 17, 8, 25, 0, 11]
            kv, hits = src.fetch(req)
            assert all(hits)
            # same multiset of token KV as the local pool (order within the concat is irrelevant to attention)
            ref = pool.store.get_concat(req)
            key = lambda t: t.permute(2, 0, 1, 3, 4).reshape(t.shape[2], -1)  # noqa: E731
            assert torch.equal(torch.sort(key(kv), dim=0).values, torch.sort(key(ref), dim=0).values)
            remote = [i for i in req if 0 not in placement.owners(i)]
            assert src.bytes_moved == sum(lens[i] for i in remote) * bpt
            if placement.name == "replicate":
                assert src.bytes_moved == 0
        finally:
            stop_workers(handles)


def test_cluster_item_source_in_process():
    _check_source(use_ray=False)


def test_rereplication_follows_hotness():
    pool, lens = _pool()
    items = list(range(30))
    p = hrcs_placement(items, {i: -i for i in items}, 0.1, 3)  # replicate items 0, 1, 2
    handles = start_workers(p, pool)
    rr = ReReplicator(p, handles)
    add, drop = rr.step({i: float(i) for i in items})  # hotness flips: 29, 28, 27 are now hottest
    assert add == {27, 28, 29} and drop == {0, 1, 2} and p.replicated == {27, 28, 29}
    for w, h in enumerate(handles):
        assert all(h.call("has", [27, 28, 29]))
        assert h.call("has", [0]) == [p.home[0] == w]
    assert rr.bytes_moved == sum(lens[i] for i in (27, 28, 29)) * 2 * pool.store.bytes_per_token
    src = ClusterItemSource(1, handles, p)
    kv, _ = src.fetch([27])
    assert torch.equal(kv, pool.get(27)) and src.bytes_moved == 0  # now local everywhere


# ---------------------------------------------------------------------------------------------------------
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_ray_workers_and_meta_service(ray_cluster):
    _check_source(use_ray=True)
    meta = make_meta_service(True, user_window_s=10.0)
    assert meta.call("record_request", 1, [5, 6], 0.0) == 0.0
    assert meta.call("record_request", 1, [5], 0.0) == 1.0
    assert meta.call("item_frequencies", 0.0) == {5: 2.0, 6: 1.0}
    meta.call("set_item_locations", {5: [0, 1]})
    assert meta.call("item_locations", [5, 9]) == [frozenset({0, 1}), frozenset()]
    ray.kill(meta.actor)
