"""Retrieval and ranking instances on a real local Ray: ``serve --instances N`` / ``serve ranking --instances N``.

Ray and three instance actors (one retrieval, two ranking; spawned together so they load side by side: each actor
pays torch's import, the bulk of the module's time) start once for the module. The tests run in order and use the
instances up: outputs equal one in-process engine's, ranking routes a user's requests to the instance whose user
cache holds the user's KV, the unchanged HTTP apps (admin changes reach every instance, /metrics), then a kill by
PID (SIGKILL) of a ranking instance holding requests: nothing lost. The mode-free logic (spreading by load,
re-submission, the migration limit's 503) is tested without Ray in ``test_cluster_gr_unit.py``.
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

from fastapi.testclient import TestClient  # noqa: E402

from grserve.cluster.gr.instance import catalog_digest, spawn_gr_instance, user_key  # noqa: E402
from grserve.cluster.gr.modes import ClusterRankingEngine, ClusterRetrievalEngine  # noqa: E402
from grserve.cluster.core.ray_runtime import new_incarnation, start_ray  # noqa: E402
from grserve.config import (  # noqa: E402
    CatalogConfig,
    CatalogReloadConfig,
    ClusterConfig,
    EdgeConfig,
    PrefixCacheConfig,
    RankingConfig,
    RankingDataConfig,
    RankingServeConfig,
    ServeConfig,
)
from grserve.engine.ranking_runner import RankingRequest  # noqa: E402
from grserve.engine.types import RetrievalRequest  # noqa: E402

RCFG = ServeConfig(catalog=CatalogConfig(num_items=600), prefix=PrefixCacheConfig(prefix_cache_tokens=4096))
KCFG = RankingServeConfig(ranking=RankingConfig(policy="user_prefix", user_cache_bytes=2 << 20),
                          data=RankingDataConfig(num_items=80, num_users=12, scale=0.1),
                          edge=EdgeConfig(admin_api_key="adm"))
CC = ClusterConfig(instances=2, heartbeat_timeout_s=6.0)  # ranking
RCC = dataclasses.replace(CC, instances=1)  # retrieval


@pytest.fixture(scope="module")
def clusters():
    owns = start_ray(None)
    spawned = {"retrieval": (RCFG, RCC), "ranking": (KCFG, CC)}
    actors = {m: [spawn_gr_instance(i, m, cfg, cc, new_incarnation()) for i in range(cc.instances)]
              for m, (cfg, cc) in spawned.items()}
    infos = {m: ray.get([a.info.remote() for a in acts]) for m, acts in actors.items()}
    ret = ClusterRetrievalEngine(actors["retrieval"], infos["retrieval"], RCC, RCFG).start()
    rank = ClusterRankingEngine(actors["ranking"], infos["ranking"], CC, KCFG).start()
    yield ret, rank
    ret.stop()
    rank.stop()
    if owns:
        ray.shutdown()


@pytest.fixture(scope="module")
def references():
    """One retrieval engine and one ranking engine in this process, built from the same configs."""
    from grserve.cluster.gr.instance import build_ranking_engine
    from grserve.engine.retrieval_engine import RetrievalEngine

    torch.set_num_threads(1)  # beside three busy actors on a small machine, more threads only spin
    ret = RetrievalEngine.build(RCFG).start()
    rank = build_ranking_engine(dataclasses.replace(KCFG, edge=EdgeConfig())).start()
    yield ret, rank
    ret.stop()
    rank.stop()


def _histories(eng, n, length, seed=0):
    cat = eng.catalogs.current()
    rng = np.random.default_rng(seed)
    ids = np.asarray(cat.item_ids)
    return [cat.layout.sids_to_tokens(np.asarray(cat.sids_of_items(rng.choice(ids, length)), dtype=np.int64))
            .reshape(-1) for _ in range(n)]


def _retrieve(eng, prompts, tag):
    return [eng.submit(RetrievalRequest(prompt_tokens=p, beam_width=8, top_n=5, request_id=f"{tag}{k}"))
            for k, p in enumerate(prompts)]


def _same_retrieval(a, b):
    assert [i.item_id for i in a.items] == [i.item_id for i in b.items]
    np.testing.assert_allclose([i.score for i in a.items], [i.score for i in b.items], rtol=1e-4, atol=1e-4)


def _rank_request(reg, uid, k=0, n=10):
    items = reg.item_ids()[k:k + n]
    return RankingRequest(reg.user_tokens(uid), [reg.item_tokens(i) for i in items], user_id=uid, item_ids=items,
                          top_k=5)


def _same_ranking(a, b):
    assert a.order == b.order
    np.testing.assert_allclose(a.scores, b.scores, rtol=1e-4, atol=1e-5)


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_retrieval_equals_one_engine(clusters, references):
    ret, _ = clusters
    prompts = _histories(ret, 9, 6)
    got = [h.future.result(60) for h in _retrieve(ret, prompts, "eq")]
    want = [h.future.result(60) for h in _retrieve(references[0], prompts, "ref")]
    for a, b in zip(got, want):
        _same_retrieval(a, b)
    assert ret.router.decisions["load"] == 9 and ret.router.decisions["prefix"] == 0  # nothing cached yet
    # returning users: their prefix blocks reached the global KV index over Ray; the router counts them
    _wait(lambda: sum(1 for b in ret.index.blocks.values() if b) >= 9, timeout=30)
    again = [np.concatenate([p, p[:9]]) for p in prompts]
    got = [h.future.result(60) for h in _retrieve(ret, again, "again")]
    want = [h.future.result(60) for h in _retrieve(references[0], again, "ref-again")]
    for a, b in zip(got, want):
        _same_retrieval(a, b)
    assert ret.router.decisions["prefix"] == 9 and all(r.cached_tokens == 16 for r in got)
    _wait(lambda: ret.stats().get("prefix_reused_tokens", 0) >= 9 * 16, timeout=30)  # the polls carry them
    lines = ret.describe()
    assert len(lines) == 2 and all(str(inst.info.pid) in "\n".join(lines) for inst in ret.instances)


def test_ranking_prefers_the_instance_with_the_users_kv(clusters, references):
    _, rank = clusters
    reg = rank.registry
    uid = reg.user_ids()[0]
    first = rank.submit(_rank_request(reg, uid)).future.result(60)
    assert not first.user_cache_hit and rank.router.decisions["load"] == 1
    holder = next(i for i, n in enumerate(rank.router.routed) if n)
    _wait(lambda: rank.index.prefix_match([user_key(uid)], [0, 1])[holder])  # the instance's user-cache event
    other = reg.user_ids()[1]
    # one after the other (no load booked anywhere): the cached user prefix decides, every time
    res = [rank.submit(_rank_request(reg, uid, k)).future.result(60) for k in (10, 20, 30)]
    assert rank.router.decisions["prefix"] == 3 and rank.router.routed[holder] == 4
    assert all(r.user_cache_hit for r in res)
    # another user's request while the holder is busy with the first user's: no KV anywhere, least loaded wins
    busy = rank.submit(_rank_request(reg, uid, 40))
    res.append(rank.submit(_rank_request(reg, other)).future.result(60))
    busy.future.result(60)
    assert not res[3].user_cache_hit and rank.router.routed[1 - holder] == 1
    ref = references[1]
    for req, r in zip([_rank_request(reg, uid)] + [_rank_request(reg, uid, k) for k in (10, 20, 30)]
                      + [_rank_request(reg, other)], [first] + res):
        _same_ranking(r, ref.submit(req).future.result(60))


def test_http_apps_admin_changes_reach_every_instance(clusters, references, tmp_path):
    from grserve.server.ranking.app import create_ranking_app
    from grserve.server.launch.modes import cluster_app
    from grserve.server.retrieval.command import create_app_for

    ret, rank = clusters
    client = TestClient(cluster_app(rank, lambda m: create_ranking_app(rank, KCFG.limits, m, edge=KCFG.edge)),
                        headers={"Authorization": "Bearer adm"})
    reg = rank.registry
    uid = reg.user_ids()[0]
    holder = next(i for i in (0, 1) if rank.index.prefix_match([user_key(uid)], [0, 1])[i])
    new_tokens = [int(t) for t in reg.user_tokens(reg.user_ids()[2])]
    r = client.post("/v1/users", json={"users": [{"user_id": uid, "tokens": new_tokens}]})
    assert r.status_code == 200 and r.json()["replaced"] == 1
    _wait(lambda: not rank.index.prefix_match([user_key(uid)], [0, 1])[holder])  # its stale KV is gone
    r = client.post("/v1/rank", json={"user_id": uid, "candidates": reg.item_ids()[:10], "top_k": 5})
    assert r.status_code == 200 and not r.json()["user_cache_hit"]
    references[1].registry.add_user(uid, new_tokens)
    want = references[1].submit(_rank_request(references[1].registry, uid)).future.result(60)
    assert [it["index"] for it in r.json()["items"]] == want.order
    np.testing.assert_allclose([it["score"] for it in r.json()["items"]], want.scores, rtol=1e-4, atol=1e-5)
    metrics = client.get("/metrics").text
    prefix = rank.router.decisions["prefix"]
    assert prefix >= 4
    for name in (f'grserve_cluster_routing_decisions_total{{reason="prefix"}} {prefix:.1f}', "grserve_cluster_instance_up",
                 "grserve_cluster_instance_users_cached", "grserve_batch_size_count", "grserve_cluster_kv_index_blocks"):
        assert name in metrics, name
    assert client.get("/health").json()["instances_up"] == 2
    # retrieval: POST /v1/catalog (admin key) reloads the catalog on every instance before it answers
    from grserve.catalog import generate_catalog
    from grserve.catalog.io import save_catalog

    save_catalog(generate_catalog(300, 3, 256, 1, 16), tmp_path / "new.grcat")
    cfg = dataclasses.replace(RCFG, edge=EdgeConfig(admin_api_key="adm"),
                              reload=CatalogReloadConfig(catalog_dir=str(tmp_path)))
    rclient = TestClient(cluster_app(ret, lambda m: create_app_for(ret, cfg, m)))
    assert rclient.post("/v1/catalog", json={"name": "new.grcat"}).status_code == 401
    r = rclient.post("/v1/catalog", json={"name": "new.grcat"}, headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200 and r.json()["catalog"]["version"] == 2, r.text
    items = [int(i) for i in ret.catalogs.current().item_ids[:4]]
    r = rclient.post("/v1/recommend", json={"history_items": items, "top_n": 3},
                     headers={"Authorization": "Bearer adm"})
    assert r.status_code == 200 and r.json()["catalog_version"] == 2, r.text
    assert ray.get(ret.instances[0].actor.info.remote()).catalog_items == 300  # the instance serves it


def _kill(eng, victim):
    os.kill(eng.instances[victim].info.pid, signal.SIGKILL)


def test_kill_ranking_instance_by_pid_loses_nothing(clusters, references):
    _, rank = clusters
    reg = rank.registry
    uid = reg.user_ids()[3]
    reqs = [_rank_request(reg, uid, k, 12) for k in range(0, 72, 12)]
    handles = [rank.submit(r) for r in reqs]
    held = [rec.instance for rec in list(rank.records.values())]
    assert held, "every request finished before the kill"
    victim = max(set(held), key=held.count)  # the instance holding the most requests right now
    downs = []
    rank.on_death.append(lambda i, silent: downs.append(time.perf_counter()))
    t0 = time.perf_counter()
    _kill(rank, victim)
    res = [h.future.result(60) for h in handles]
    assert downs and downs[0] - t0 < CC.heartbeat_timeout_s  # Ray reported the death: no heartbeat wait
    for req, r in zip(reqs, res):
        _same_ranking(r, references[1].submit(dataclasses.replace(req, request_id=req.request_id + "r"))
                      .future.result(60))
    assert rank.counters["recomputed"] >= 1 and rank.counters["lost"] == 0
    assert all(victim not in holders for holders in rank.index.blocks.values())
    assert rank.counters["instance_deaths"] == 1  # restarted in the background (--restart-instances): next test


def test_killed_instances_restart_with_the_live_state(clusters, references):
    """--restart-instances (on): the killed ranking instance (previous test) and a killed retrieval instance come
    back as new actors that got every admin change made before (a replaced user; catalog version 2) and serve."""
    ret, rank = clusters
    old_pid = ret.instances[0].info.pid
    _kill(ret, 0)
    _wait(lambda: ret.counters["restarts"] == 1 and rank.counters["restarts"] == 1, timeout=300)
    assert ret.health().detail["instances_up"] == 1 and rank.health().detail["instances_up"] == 2
    new = ret.instances[0].info
    assert new.pid != old_pid and (new.catalog_version, new.catalog_items) == (2, 300)
    assert new.catalog == catalog_digest(ret.catalogs.current())
    got = _retrieve(ret, _histories(ret, 2, 5, seed=7), "rs")
    assert all({i.item_id for i in h.future.result(60).items} <= set(ret.catalogs.current().item_ids) for h in got)
    a, b = (inst.actor.info.remote() for inst in rank.instances)
    assert ray.get(a).registry == ray.get(b).registry  # the replaced user reached the new instance too
    reg = rank.registry
    reqs = [_rank_request(reg, u, 5) for u in reg.user_ids()[5:9]]
    before = list(rank.router.routed)
    handles = [rank.submit(r) for r in reqs]  # four at once, users nobody caches: load spreads them over both
    for req, h in zip(reqs, handles):
        _same_ranking(h.future.result(60), references[1].submit(dataclasses.replace(req, request_id=req.request_id
                                                                                     + "r")).future.result(60))
    assert all(n > m for n, m in zip(rank.router.routed, before)), (before, rank.router.routed)


def test_the_front_ends_store_reaches_every_instance_and_restarted_ones(clusters, references):
    """Issue 25 item 5: the front end owns the state store (``--state-dir``). What it holds when the front end
    restarts (``restore``; here on the running front ends) reaches every instance — a new and a replaced item as one
    change, a catalog at its stored version — and, recorded in the broadcast log, instances restarted later too."""
    from grserve.catalog import generate_catalog
    from grserve.cluster.gr.instance import registry_digest
    from grserve.state.store import StoredState

    ret, rank = clusters
    reg = rank.registry
    free = min(reg.identifier(i) for i in reg.item_ids()) - 1
    items = [(900, np.array([30, 31, free])), (1, np.array([40, 41, reg.identifier(1)]))]
    catalog = generate_catalog(200, 3, 256, 3, 16)
    catalog.version = 5
    rank.restore(StoredState(items=items))
    ret.restore(StoredState(catalog=catalog))

    def instances_agree():
        assert all(ray.get(inst.actor.info.remote()).registry == registry_digest(reg) for inst in rank.instances)
        info = ray.get(ret.instances[0].actor.info.remote())
        assert (info.catalog, info.catalog_version) == (catalog_digest(catalog), 5)

    instances_agree()
    assert ret.catalogs.current().version == 5 and reg.item_tokens(900).tolist() == [30, 31, free]
    _kill(rank, 0)
    _kill(ret, 0)
    _wait(lambda: ret.counters["restarts"] == 2 and rank.counters["restarts"] == 2, timeout=300)
    instances_agree()
    ref, uid = references[1], reg.user_ids()[4]
    ref.registry.update("item", items)
    ref.runner.add_items([900])
    req = RankingRequest(reg.user_tokens(uid), [reg.item_tokens(i) for i in (1, 900, 2)], user_id=uid,
                         item_ids=[1, 900, 2], top_k=3)
    _same_ranking(rank.submit(req).future.result(60),
                  ref.submit(dataclasses.replace(req, request_id=req.request_id + "r")).future.result(60))


def test_instances_flag_on_serve_and_serve_ranking():
    """``grserve serve --instances N`` (the default mode) and ``serve ranking --instances N`` carry the cluster flags
    that apply; the LLM-only ones are not offered."""
    from grserve.cli import _with_default_serve_mode, build_parser
    from grserve.server.ranking import command as ranking_main
    from grserve.server.retrieval import command as retrieval_main

    parser = build_parser()
    ns = parser.parse_args(_with_default_serve_mode(["serve", "--instances", "3", "--routing", "round_robin",
                                                      "--migration-limit", "1"]))
    cfg = retrieval_main.config_from_args(ns)
    assert (cfg.cluster.instances, cfg.cluster.routing, cfg.cluster.migration_limit) == (3, "round_robin", 1)
    ns = parser.parse_args(["serve", "ranking", "--instances", "2", "--ray-address", "10.0.0.1:6379",
                            "--cache-weight", "1.5"])
    cfg = ranking_main.config_from_args(ns)
    assert (cfg.cluster.instances, cfg.cluster.ray_address, cfg.cluster.cache_weight) == (2, "10.0.0.1:6379", 1.5)
    assert retrieval_main.config_from_args(parser.parse_args(["serve", "retrieval"])).cluster.instances == 1
    for argv in (["serve", "retrieval", "--kv-block-size", "8"], ["serve", "ranking", "--decode-weight", "1"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def test_user_keys_are_stable_across_processes():
    """The index key of a user's KV is a fixed function of the id (blake2b, never ``hash()``), distinct per user."""
    import hashlib

    assert user_key(7) == int.from_bytes(hashlib.blake2b(b"grserve-user:7", digest_size=16).digest(), "little")
    assert len({user_key(u) for u in range(-500, 500)} | {user_key(2**80)}) == 1001
