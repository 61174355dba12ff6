"""The retrieval/ranking cluster front end's logic without Ray processes: fake instance actors whose calls return
futures the test completes. Routing by load and by the user's cached KV (from user-cache events in the global
index), answers of moved requests, re-submission on a death, and the migration limit (503)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("ray")

from grserve.cluster.core.kv_index import user_key  # noqa: E402
from grserve.cluster.core.recovery import RequestLost  # noqa: E402
from grserve.cluster.gr.front_end import ClusterGREngine  # noqa: E402
from grserve.cluster.wire import (  # noqa: E402
    CatalogReplace,
    GRInstanceInfo,
    KVEvent,
    KVSnapshot,
    RegistryUpdate,
)
from grserve.config import ClusterConfig  # noqa: E402
from grserve.engine.types import RankingRequest  # noqa: E402


class _Method:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def remote(self, *args):
        fut: Future = Future()
        self.calls.append((self.name, args, fut))
        return SimpleNamespace(future=lambda: fut)


class _Actor:
    def __init__(self):
        self.calls: list = []
        self.run, self.cancel = _Method(self.calls, "run"), _Method(self.calls, "cancel")

    def runs(self):
        return [(args[0], fut) for name, args, fut in self.calls if name == "run"]


class _Engine(ClusterGREngine):
    mode = "test"


def _Req(request_id: str, user_tokens: np.ndarray, user_id: int | None = None, items: int = 10) -> RankingRequest:
    """A ranking request of ``len(user_tokens) + items`` tokens: ten one-token candidates."""
    return RankingRequest(user_tokens, [np.array([7]) for _ in range(items)], user_id=user_id, request_id=request_id)


def _engine(n=3, **cc):
    actors = [_Actor() for _ in range(n)]
    infos = [GRInstanceInfo(i, f"inc{i}", mode="ranking") for i in range(n)]
    eng = _Engine(actors, infos, ClusterConfig(instances=n, **cc))
    eng._status = "ok"  # no poll threads: nothing here may reach Ray
    for i in range(n):
        eng.index.apply_snapshot(KVSnapshot(i, f"inc{i}", 0, {}))
    return eng, actors


def test_load_spreads_and_the_users_kv_attracts():
    eng, actors = _engine()
    u = np.arange(40)
    eng.index.apply(2, [KVEvent(2, "inc2", 0, "store", (user_key(9),))], 1)  # instance 2 holds user 9's KV
    eng.submit(_Req("a", u[:5]))
    eng.submit(_Req("b", u[:5]))
    eng.submit(_Req("c", u, user_id=9))  # 50 tokens, 40 cached on 2: cost 50 - 2*40 < 0
    eng.submit(_Req("d", u, user_id=9))  # 2 now has 10 booked: 10 + 50 - 80 still beats 15
    eng.submit(_Req("e", u, user_id=3))  # nobody holds user 3: least loaded (2 has 20 booked, 0 and 1 15)
    where = {r.request_id: i for i, a in enumerate(actors) for r, _ in a.runs()}
    assert where == {"a": 0, "b": 1, "c": 2, "d": 2, "e": 0}
    assert eng.router.decisions == {"prefix": 2, "load": 3, "round_robin": 0, "recovery": 0}
    eng.index.apply(2, [KVEvent(2, "inc2", 1, "evict", (user_key(9),))], 2)  # the user left instance 2's cache
    eng.submit(_Req("f", u, user_id=9))
    assert actors[1].runs()[-1][0].request_id == "f"


def test_a_death_resubmits_and_the_limit_fails_with_503():
    eng, actors = _engine(migration_limit=1)
    handles = [eng.submit(_Req(r, np.arange(8))) for r in "abc"]  # a→0, b→1, c→2
    first_a = actors[0].runs()[0][1]
    eng.instance_down(0, "test")
    assert not eng.instances[0].up and eng.counters["recomputed"] == 1
    moved = eng.records["a"].instance
    assert moved in (1, 2) and actors[moved].runs()[-1][0].request_id == "a"
    first_a.set_result("stale")  # a late answer of the dead attempt is ignored
    assert not handles[0].future.done()
    actors[moved].runs()[-1][1].set_result("A")
    assert handles[0].future.result(1) == "A"
    eng.instance_down(1, "test")  # b's first death: moved to 2
    eng.instance_down(2, "test")  # b's second death (limit 1) and c's first with no instance left: both lost
    for h in handles[1:]:
        with pytest.raises(RequestLost) as err:
            h.future.result(1)
        assert err.value.http_status == 503
    assert "migration limit 1" in str(handles[1].future.exception())
    assert eng.counters["lost"] == 2 and not eng.records


def test_engine_errors_reach_the_client_and_cancel_reaches_the_instance():
    from grserve.engine.protocol import EngineOverloaded, RequestCancelled

    eng, actors = _engine(n=2)
    h = eng.submit(_Req("a", np.arange(4)))
    actors[0].runs()[0][1].set_exception(EngineOverloaded("full"))
    with pytest.raises(Exception) as err:
        h.future.result(1)
    assert getattr(err.value, "http_status", None) == 429
    h = eng.submit(_Req("b", np.arange(4)))
    assert eng.cancel("b") and not eng.cancel("b")
    with pytest.raises(RequestCancelled):
        h.future.result(1)
    assert [c[0] for c in actors[0].calls] == ["run", "run", "cancel"] and not eng.records
    assert eng.router.load[0].requests == 0


def test_the_front_end_refuses_instances_serving_another_catalog():
    from grserve.cluster.gr.instance import catalog_digest
    from grserve.cluster.gr.modes import ClusterRetrievalEngine
    from grserve.config import CatalogConfig, ServeConfig
    from grserve.engine.retrieval_engine import build_catalog

    cfg = ServeConfig(catalog=CatalogConfig(num_items=300))
    good = GRInstanceInfo(0, "a", vocab_size=32000, catalog_version=1, catalog=catalog_digest(build_catalog(cfg)))
    eng = ClusterRetrievalEngine([_Actor()], [good], ClusterConfig(), cfg)
    assert eng.catalogs.current().version == 1 and len(eng.catalogs.current()) == 300
    other = dataclasses.replace(cfg, catalog=CatalogConfig(num_items=300, seed=1))
    bad = dataclasses.replace(good, index=1, catalog=catalog_digest(build_catalog(other)))
    with pytest.raises(ValueError, match="same catalog"):
        ClusterRetrievalEngine([_Actor(), _Actor()], [good, bad], ClusterConfig(instances=2), cfg)


def test_broadcast_log_replays_the_newest_state_compactly():
    """A restarted instance is sent the newest catalog (with its version) and each key's newest tokens, in the
    order of the last updates, grouped into runs of one kind."""
    from grserve.cluster.gr.broadcast_log import BroadcastLog

    log = BroadcastLog()
    assert log.replay(lambda change: pytest.fail("nothing to replay")) == 0
    cat2, cat3 = SimpleNamespace(version=2), SimpleNamespace(version=3)
    log.record(RegistryUpdate("user", ((1, "a"), (2, "x"))))
    log.record(RegistryUpdate("item", ((5, "i"),)))
    log.record(CatalogReplace(cat2))
    log.record(RegistryUpdate("user", ((1, "b"),)))
    log.record(CatalogReplace(cat3))
    sent = []
    assert log.replay(sent.append) == 4 and len(log) == 4
    assert sent == [CatalogReplace(cat3, 3), RegistryUpdate("user", ((2, "x"),)), RegistryUpdate("item", ((5, "i"),)),
                    RegistryUpdate("user", ((1, "b"),))]


def test_broadcast_log_replays_the_newest_item_placement_last():
    """Ranking with KV-cache workers: a restarted instance is sent the newest ``ItemPlacement`` after the registry
    updates (it lists items those updates register)."""
    from grserve.cluster.gr.broadcast_log import BroadcastLog
    from grserve.cluster.gr.hrcs import hrcs_placement
    from grserve.cluster.wire import ItemPlacement

    log = BroadcastLog()
    v1 = ItemPlacement(1, ("w0", "w1"), hrcs_placement([1, 2], {}, 0.0, 2))
    v2 = ItemPlacement(2, ("w0", "w1"), hrcs_placement([1, 2, 3], {}, 0.0, 2))
    log.record(v1)
    log.record(RegistryUpdate("item", ((3, "t"),)))
    log.record(v2)
    sent = []
    assert log.replay(sent.append) == 2 and sent == [RegistryUpdate("item", ((3, "t"),)), v2]
