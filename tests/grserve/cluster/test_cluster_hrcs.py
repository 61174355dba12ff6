"""BAT's item-KV placement served (issue 28 item 5): ``serve ranking --instances 2`` with two KV-cache workers on a
real local Ray. The instances hold no item pool: every item-as-prefix request reads its candidates' KV from the
workers (all cached: ``cached_tokens`` = the candidates' tokens), answers equal one engine's, the item KV is split
over the workers (each holds its shard, not the catalog), a re-placement from the served hotness replicates the hot
items (Algorithm 1 with a GPU-like prefill time) and cuts the remote reads, new and replaced items reach the
workers, and a KV-cache worker killed by PID is rebuilt while requests keep being answered (none fails).

The tests run in order and share one cluster (Ray and two instance actors: the bulk of the module's time).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from grserve.cluster.core.ray_runtime import new_incarnation, start_ray  # noqa: E402
from grserve.cluster.gr.instance import build_ranking_engine, spawn_gr_instance  # noqa: E402
from grserve.cluster.gr.modes import ClusterRankingEngine  # noqa: E402
from grserve.config import (ClusterConfig, HRCSConfig, ModelConfig, RankingConfig,  # noqa: E402
                            RankingDataConfig, RankingServeConfig)
from grserve.engine.types import RankingRequest  # noqa: E402
from grserve.model.loader import resolve_dtype  # noqa: E402

# The link is given in fp32 terms: at the default --dtype auto (bf16 on a CPU with fast bf16) an item's KV is half
# the bytes, so the same link moves twice the items and HRCS would replicate fewer of them; scaled by the element
# size, the placement (which items pay to replicate) is the one these tests were written for at any dtype.
KV_BYTES = resolve_dtype(ModelConfig().dtype).itemsize
CFG = RankingServeConfig(ranking=RankingConfig(policy="item_prefix"),
                         data=RankingDataConfig(num_items=120, num_users=10, scale=0.05),
                         hrcs=HRCSConfig(hrcs_prefill_s=0.01, hrcs_link_gbps=2.0 * KV_BYTES / 4, hrcs_interval_s=0))
CC = ClusterConfig(instances=2, heartbeat_timeout_s=6.0, restart_instances=False)


@pytest.fixture(scope="module")
def cluster():
    owns = start_ray(None)
    actors = [spawn_gr_instance(i, "ranking", CFG, CC, new_incarnation()) for i in range(CC.instances)]
    eng = ClusterRankingEngine(actors, ray.get([a.info.remote() for a in actors]), CC, CFG).start()
    yield eng
    eng.stop()
    if owns:
        ray.shutdown()


@pytest.fixture(scope="module")
def reference():
    """One engine in this process, its item pool precomputed from the same registry."""
    torch.set_num_threads(1)
    eng = build_ranking_engine(CFG).start()
    yield eng
    eng.stop()


def _request(reg, uid, items, tag):
    return RankingRequest(reg.user_tokens(uid), [reg.item_tokens(i) for i in items], user_id=uid, item_ids=list(items),
                          top_k=5, request_id=tag)


def _same(a, b):
    assert a.order == b.order
    np.testing.assert_allclose(a.scores, b.scores, rtol=1e-5, atol=1e-6)


def _stored(eng) -> list[set[int]]:
    """The items each KV-cache worker holds (asked directly)."""
    ids = eng.registry.item_ids()
    return [set(ray.get(w.actor.get.remote(ids)).item_ids) for w in eng.item_kv.workers]


def _remote_items(eng) -> int:
    time.sleep(2 * CC.poll_wait_s)  # the instances' counters arrive with their polls
    return int(sum(inst.stats.get("items_fetched_remote", 0) for inst in eng.instances))


def _run(eng, ref, reqs, check_cached=True):
    got = [h.future.result(120) for h in [eng.submit(r) for r in reqs]]
    for req, g in zip(reqs, got):
        _same(g, ref.submit(dataclasses.replace(req, request_id=req.request_id + "-ref")).future.result(120))
        if check_cached:  # every candidate's KV came from a KV-cache worker: none was computed
            assert g.cached_tokens == sum(len(t) for t in req.item_tokens) and g.layout == "item_prefix"
    return got


def test_the_item_kv_is_sharded_over_the_workers_and_answers_equal_one_engine(cluster, reference):
    eng, reg = cluster, cluster.registry
    items = set(reg.item_ids())
    shards = _stored(eng)
    assert shards[0] | shards[1] == items and not shards[0] & shards[1]  # r = 0 at start: each item once
    assert all(len(s) == len(items) // 2 for s in shards)
    assert all(inst.info.item_pool_bytes == 0 for inst in eng.instances)  # no instance precomputed a pool
    rng = np.random.default_rng(0)
    reqs = [_request(reg, u, rng.choice(sorted(items), 16, replace=False).tolist(), f"a{k}")
            for k, u in enumerate(reg.user_ids()[:6])]
    _run(eng, reference, reqs)
    assert _remote_items(eng) > 0  # half of the candidates live on the other instance's worker
    assert any("KV-cache workers" in line for line in eng.describe())


def test_replacement_replicates_the_hot_items(cluster, reference):
    eng, reg = cluster, cluster.registry
    hot = reg.item_ids()[:12]
    _run(eng, reference, [_request(reg, u, hot, f"h{k}") for k, u in enumerate(reg.user_ids()[:8])])
    ratio = eng.item_kv.replace()
    assert ratio is not None and 0 < ratio < 1
    placed = eng.item_kv.placed.placement
    assert set(hot) <= placed.replicated and len(placed.replicated) < len(placed.home)
    shards = _stored(eng)
    assert all(set(hot) <= s for s in shards)  # on every worker now
    assert all(s - placed.replicated and not (s & shards[1 - k]) - placed.replicated for k, s in enumerate(shards))
    before = _remote_items(eng)
    _run(eng, reference, [_request(reg, u, hot, f"h2{k}") for k, u in enumerate(reg.user_ids()[:4])])
    assert _remote_items(eng) == before  # hot candidates are read from the instance's own worker


def test_new_and_replaced_items_reach_the_workers(cluster, reference):
    eng, reg = cluster, cluster.registry
    ref_reg = reference.registry
    old = reg.item_ids()[20]
    new_id = max(reg.item_ids()) + 1
    ident = int(reg.item_tokens(old)[-1])
    used = {int(reg.item_tokens(i)[-1]) for i in reg.item_ids()}
    free = next(t for t in range(reg.vocab_size - 1, 0, -1) if t not in used)
    new_tokens = np.asarray([7, 8, 9, free], dtype=np.int64)
    replaced = np.asarray([11, 12, 13, 14, 15, ident], dtype=np.int64)
    for r in (reg, ref_reg):
        r.add_item(new_id, new_tokens)
    eng.runner.add_items([new_id])
    reference.runner.add_items([new_id])
    for r in (reg, ref_reg):
        r.add_item(old, replaced)  # the registry's change listener: every instance, then the workers
    assert new_id in eng.item_kv.placed.placement.home and any(new_id in s for s in _stored(eng))
    _run(eng, reference, [_request(reg, u, [new_id, old] + reg.item_ids()[30:40], f"n{k}")
                          for k, u in enumerate(reg.user_ids()[:3])])


def test_a_restored_store_reaches_the_workers(cluster, reference):
    """A restarted front end's ``--state-dir`` replay (``restore``, after start-up): stored new and replaced items
    reach the instances and their KV the workers (every candidate read from a worker), answers equal one engine's."""
    from grserve.state.store import StoredState

    eng, reg = cluster, cluster.registry
    used = {int(reg.item_tokens(i)[-1]) for i in reg.item_ids()}
    free = next(t for t in range(reg.vocab_size - 2, 0, -1) if t not in used)
    new_id, old = max(reg.item_ids()) + 1, reg.item_ids()[40]
    stored = [(new_id, np.asarray([21, 22, free], dtype=np.int64)),
              (old, np.asarray([23, 24, 25, int(reg.item_tokens(old)[-1])], dtype=np.int64))]
    eng.restore(StoredState(items=stored))
    for key, tokens in stored:
        reference.registry.add_item(key, tokens)
    reference.runner.add_items([new_id])
    assert any(new_id in s for s in _stored(eng))
    _run(eng, reference, [_request(reg, u, [new_id, old] + reg.item_ids()[50:60], f"s{k}")
                          for k, u in enumerate(reg.user_ids()[:3])])


def test_a_killed_kv_cache_worker_is_rebuilt_and_no_request_fails(cluster, reference):
    eng, reg = cluster, cluster.registry
    victim = eng.item_kv.workers[0]
    pid = ray.get(victim.actor.pid.remote())
    held = _stored(eng)[0]
    rng = np.random.default_rng(1)
    reqs = [_request(reg, u, rng.choice(reg.item_ids(), 16, replace=False).tolist(), f"k{k}")
            for k, u in enumerate(list(reg.user_ids()) * 2)]
    handles = [eng.submit(r) for r in reqs[:10]]
    os.kill(pid, signal.SIGKILL)
    handles += [eng.submit(r) for r in reqs[10:]]  # while it is dead or being rebuilt
    for req, h in zip(reqs, handles):  # every request is answered, and correctly (items computed inline if need be)
        _same(h.future.result(120), reference.submit(dataclasses.replace(req, request_id=req.request_id + "-ref"))
              .future.result(120))
    end = time.monotonic() + 120
    while eng.item_kv.counters["rebuilds"] < 1:
        assert time.monotonic() < end, "the KV-cache worker was not rebuilt"
        time.sleep(0.1)
    assert eng.item_kv.workers[0].actor is not victim.actor and _stored(eng)[0] == held  # its items, all back
    assert eng.counters["failed"] == 0 and eng.counters["lost"] == 0
    _run(eng, reference, [_request(reg, u, reg.item_ids()[:16], f"r{k}") for k, u in enumerate(reg.user_ids()[:3])])
