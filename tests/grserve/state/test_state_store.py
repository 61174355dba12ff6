"""Issue 25 item 5: acknowledged writes survive a restart. Ranking's registrations and retrieval's catalog reloads are
committed to the SQLite store under ``--state-dir`` before they are answered; a real server killed with SIGKILL right
after its 2xx serves them again when restarted (the catalog even after its file changed); a writer killed at random
points leaves a readable store holding every acknowledged write and no part of a torn one; a write the store cannot
take is refused and never applied; the replay keeps identifier hand-overs valid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_process import ADMIN, SRC, kill9, serve

from grserve.catalog import Catalog, generate_catalog, save_catalog
from grserve.config import EdgeConfig, RankingConfig, RankingLimits
from grserve.state.store import MEMORY_ONLY, StateStore, StoredState, restore_registry, state_line


# ---- a real server process, killed with SIGKILL (tests/server_process.py) --------------------------------------
@contextlib.contextmanager
def _server(args: list[str], log_path: Path):
    with serve(args, log_path) as server:
        yield server.proc, server.url, log_path


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_ranking_registrations_survive_kill_9(tmp_path):
    """A new user, a replaced start-up user and a new item, each answered 200, then SIGKILL: the restarted server
    ranks with them exactly as with their tokens given raw (``recompute``: one prompt layout, so scores compare)."""
    state = tmp_path / "state"
    args = ["ranking", "--num-items", "30", "--num-users", "3", "--scale", "0.1", "--policy", "recompute",
            "--state-dir", str(state)]
    users = [{"user_id": 4242, "tokens": [100 + k for k in range(40)]}, {"user_id": 0, "tokens": [7, 8, 9, 10]}]
    item = {"item_id": 777, "tokens": [300, 301, 302, 12345]}  # 12345: no start-up item's identifier token
    ranks = [{"user_id": u["user_id"], "candidates": [0, 777, 5], "top_k": 3} for u in users]
    with _server(args, tmp_path / "first.log") as (proc, url, log):
        assert _post(url, "/v1/users", {"users": users}) == {"registered": 2, "replaced": 1, "total": 4}
        assert _post(url, "/v1/items", {"items": [item]})["total"] == 31
        kill9(proc)  # right after the last 2xx
        assert "restored 0 users, 0 items" in log.read_text()
    with _server(args, tmp_path / "second.log") as (proc, url, log):
        assert "restored 2 users, 1 items" in log.read_text() and str(state) in log.read_text()
        assert httpx.get(url + "/health").json()["items"] == 31
        for body, user in zip(ranks, users):
            got = _post(url, "/v1/rank", body)
            raw = _post(url, "/v1/rank", {"user_tokens": user["tokens"], "top_k": 3, "candidate_tokens": [
                _item_tokens(url, 0), item["tokens"], _item_tokens(url, 5)]})
            assert [i["index"] for i in got["items"]] == [i["index"] for i in raw["items"]]
            np.testing.assert_allclose([i["score"] for i in got["items"]], [i["score"] for i in raw["items"]],
                                       rtol=1e-5)


def _item_tokens(url: str, item_id: int) -> list[int]:
    """A start-up item's tokens: the server's generated registry, rebuilt here from the same flags."""
    from grserve.config import RankingDataConfig
    from grserve.ranking.startup_data import build_registry

    reg = build_registry(RankingDataConfig(num_items=30, num_users=3, scale=0.1), 32000)
    return [int(t) for t in reg.item_tokens(item_id)]


def _shifted_catalog(seed: int, shift: int) -> Catalog:
    base = generate_catalog(300, 3, 256, seed, 16)
    return Catalog.from_arrays(base.item_ids + shift, base.sids, base.codebook_sizes, 16, "v2.grcat")


def test_catalog_reload_survives_kill_9_and_the_file_changing(tmp_path):
    """A reload answered 200, SIGKILL, then the file is overwritten: the restarted server serves the acknowledged
    catalog (item ids only it has, its version), not the file's new content; the next reload is version 3."""
    cat_dir, state = tmp_path / "catalogs", tmp_path / "state"
    cat_dir.mkdir()
    save_catalog(_shifted_catalog(1, 10_000), cat_dir / "v2.grcat")
    args = ["retrieval", "--num-items", "500", "--beam-width", "8", "--catalog-dir", str(cat_dir),
            "--state-dir", str(state)]
    history = {"history_items": [10_000, 10_001, 10_002], "top_n": 4, "beam_width": 8}
    with _server(args, tmp_path / "first.log") as (proc, url, log):
        assert "no catalog reload stored" in log.read_text()
        assert _post(url, "/v1/catalog", {"name": "v2.grcat"})["catalog"]["version"] == 2
        kill9(proc)
    save_catalog(_shifted_catalog(2, 50_000), cat_dir / "v2.grcat")  # the file changes after the acknowledgement
    with _server(args, tmp_path / "second.log") as (proc, url, log):
        assert "restored catalog 'v2.grcat' version 2" in log.read_text()
        catalog = httpx.get(url + "/health").json()["catalog"]
        assert (catalog["version"], catalog["num_items"]) == (2, 300)
        got = _post(url, "/v1/recommend", history)
        assert got["catalog_version"] == 2 and all(10_000 <= it["item_id"] < 10_300 for it in got["items"])
        assert _post(url, "/v1/catalog", {"name": "v2.grcat"})["catalog"]["version"] == 3


# ---- torn writes: a writer killed at random points ---------------------------------------------------------------
_WRITER = """
import sys
import numpy as np
from grserve.catalog import generate_catalog
from grserve.state.store import StateStore

store = StateStore(sys.argv[1], "retrieval")
catalogs = [generate_catalog(20000, 3, 256, seed, 16) for seed in (0, 1)]
print("ready", flush=True)
i = 0
while True:
    i += 1
    store.put_registry("user", [(10 * i + k, np.full(20000, 10 * i + k)) for k in range(10)])
    print("users", i, flush=True)
    if i % 3 == 0:
        store.put_catalog(catalogs[i % 2], i)
        print("catalog", i, flush=True)
"""


@pytest.mark.parametrize("acks, delay_ms", [(3, 0), (17, 5), (40, 11)])
def test_a_kill_during_writes_leaves_every_acknowledged_write(tmp_path, acks, delay_ms):
    """SIGKILL a process looping writes (10 users of 160 KB per transaction, ~16 ms each here; a 400 KB catalog
    every third) ``delay_ms`` after its ``acks``-th acknowledgement: the store opens (integrity check), every
    acknowledged write is there with its content, a torn transaction left nothing of itself (batches are whole)
    and the catalog is the newest one committed (the writer may have committed more than the test read)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        acked = {"users": 0, "catalog": 0}
        for _ in range(acks):
            kind, i = proc.stdout.readline().split()
            acked[kind] = int(i)
        time.sleep(delay_ms / 1000)  # the kill lands somewhere inside the next write
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    assert os.path.exists(tmp_path / "grserve-state.sqlite3-wal")  # the recovery path is the one tested
    store = StateStore(str(tmp_path), "retrieval")
    state = store.load()
    store.close()
    users = dict(state.users)
    batches = {uid // 10 for uid in users}  # writes are sequential: what committed is a prefix of them
    assert batches == set(range(1, max(batches) + 1)) and max(batches) >= acked["users"], (acked, max(batches))
    for b in batches:
        for uid in range(10 * b, 10 * b + 10):
            np.testing.assert_array_equal(users[uid], np.full(20000, uid))
    if acked["catalog"]:
        v = state.catalog.version
        assert v % 3 == 0 and acked["catalog"] <= v <= max(batches), (acked, v)
        want = generate_catalog(20000, 3, 256, v % 2, 16)
        np.testing.assert_array_equal(state.catalog.item_ids, want.item_ids)
        np.testing.assert_array_equal(state.catalog.sids, want.sids)


# ---- in process: refusals, hand-overs, one server per directory ------------------------------------------------
@pytest.fixture()
def ranking(tiny_model, tmp_path):
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.ranking.registry import synthetic_registry
    from grserve.server.ranking.app import create_ranking_app

    model = tiny_model(seed=4)
    make = lambda: synthetic_registry(model.spec.vocab_size, 20, (3, 5), [10, 12], seed=1)  # noqa: E731
    reg = make()
    engine = RankingEngine(RankingRunner(model, reg, RankingConfig(policy="recompute"))).start()
    store = StateStore(str(tmp_path / "state"), "ranking")
    app = create_ranking_app(engine, RankingLimits(), edge=EdgeConfig(admin_api_key="adm"), store=store)
    with TestClient(app, headers=ADMIN, raise_server_exceptions=False) as client:
        yield client, reg, store, make
    engine.stop()
    store.close()


def test_restart_replays_identifier_hand_overs(ranking):
    """Item 0 gives its identifier to item 1 and takes item 1's: replayed item by item in the order of the last
    writes, item 1 would collide with start-up item 0; replayed as one change, the start-up registry plus the store
    is exactly the live registry."""
    client, reg, store, make = ranking
    id0, id1 = reg.identifier(0), reg.identifier(1)
    free = int(min(reg.identifier(i) for i in reg.item_ids())) - 1
    for item_id, ident in ((0, free), (1, id0), (0, id1)):
        r = client.post("/v1/items", json={"items": [{"item_id": item_id, "tokens": [20, 21, ident]}]})
        assert r.status_code == 200, r.text
    assert (reg.identifier(0), reg.identifier(1)) == (id1, id0)
    fresh = make()
    restore_registry(fresh, store.load())
    assert {i: fresh.item_tokens(i).tolist() for i in fresh.item_ids()} == \
           {i: reg.item_tokens(i).tolist() for i in reg.item_ids()}
    assert fresh.item_with_identifier(id0) == 1 and fresh.item_with_identifier(free) is None


def test_a_write_the_store_cannot_take_is_refused_and_not_applied(ranking, tmp_path):
    """The store fails (here: closed): 500 ``state_write_failed`` and nothing registered, users or items; a catalog
    reload likewise leaves the served catalog."""
    client, reg, store, _ = ranking
    store.close()
    r = client.post("/v1/users", json={"users": [{"user_id": 99, "tokens": [5, 6]}]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "state_write_failed", r.text
    r = client.post("/v1/items", json={"items": [{"item_id": 99, "tokens": [5, 6]}]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "state_write_failed", r.text
    assert not reg.has_user(99) and not reg.has_item(99)

    from test_catalog_reload import CatalogOnlyEngine

    from grserve.config import CatalogReloadConfig, ServerConfig
    from grserve.server.retrieval.app import create_app

    eng, broken = CatalogOnlyEngine(), StateStore(str(tmp_path / "retrieval-state"), "retrieval")
    broken.close()
    save_catalog(generate_catalog(50, 3, 8, 3, 16), tmp_path / "new.jsonl")
    app = create_app(eng, ServerConfig(), edge=EdgeConfig(admin_api_key="adm"),
                     reload=CatalogReloadConfig(catalog_dir=str(tmp_path)), store=broken)
    r = TestClient(app, headers=ADMIN).post("/v1/catalog", json={"name": "new.jsonl"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "state_write_failed", r.text
    assert eng.catalogs.current().version == 1 and len(eng.catalogs.current()) == 100


def test_one_server_per_directory_and_mode(tmp_path):
    """A second store on a directory in use is refused while the first is open (not after); a ranking store is not
    a retrieval server's; without --state-dir the start-up line says the state is memory only."""
    from grserve.flags import UsageError
    from grserve.state.store import StateError, open_state

    first = StateStore(str(tmp_path), "ranking")
    with pytest.raises(StateError, match="in use by another grserve server"):
        StateStore(str(tmp_path), "ranking")
    first.close()
    with pytest.raises(UsageError, match="ranking server"):
        open_state(str(tmp_path), "retrieval")
    StateStore(str(tmp_path), "ranking").close()
    assert open_state(None, "ranking")[0] is None
    assert state_line(None, StoredState()) == MEMORY_ONLY and "lost" in MEMORY_ONLY


def test_a_stored_catalog_keeps_its_sid_text_and_is_bound_again(tmp_path):
    """A catalog whose SIDs are tokenizer tokens is stored with its SID text (as ``.grcat`` bytes) and bound to the
    tokenizer again when restored: the served layout maps every code to the same token id, at the stored version."""
    import json

    from grserve.catalog import CatalogStore, load_catalog
    from grserve.catalog.sid_text import bind_catalog
    from grserve.state.store import restore_catalog

    ids = {f"<a_{c}>": 100 + 7 * c for c in range(3)} | {f"<b_{c}>": 250 - 3 * c for c in range(6)}

    class Vocab:
        def encode_each(self, texts):
            return [[ids[t]] for t in texts]

        def added_tokens(self):
            return dict(ids)

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"item_id": i, "sid_tokens": [f"<a_{i % 3}>", f"<b_{i}>"]}) + "\n"
                            for i in range(6)))
    bind = lambda c: bind_catalog(c, Vocab())[0]  # noqa: E731
    served = bind(load_catalog(path))
    assert not served.layout.is_arithmetic
    store = StateStore(str(tmp_path / "state"), "retrieval")
    store.put_catalog(served, 4)
    stored = store.load().catalog
    store.close()
    catalogs = CatalogStore(served, vocab_size=300, bind=bind)
    restore_catalog(catalogs, stored)
    got = catalogs.current()
    assert got.version == 4 and got.layout == served.layout and got.source == served.source
    np.testing.assert_array_equal(got.item_ids, served.item_ids)
    np.testing.assert_array_equal(got.sids, served.sids)


def test_a_stored_catalog_with_duplicate_sids_is_read_under_the_servers_policy(tmp_path):
    """Issue 41 (found by the restart matrix): a reload acknowledged under ``--duplicate-sids popularity`` must be
    restored under it; with ``refuse`` the store says why it cannot serve it and releases the directory."""
    from grserve.flags import UsageError
    from grserve.state.store import open_state

    base = generate_catalog(40, 3, 8, 0, 16)
    ids = np.concatenate([base.item_ids, [900, 901]])
    sids = np.concatenate([base.sids, base.sids[:2]])
    dup = Catalog.from_arrays(ids, sids, base.codebook_sizes, 16, "dup.jsonl", duplicate_sids="popularity")
    store = StateStore(str(tmp_path), "retrieval")
    store.put_catalog(dup, 2)
    store.close()
    with pytest.raises(UsageError, match="cannot be served with these flags.*duplicate SID"):
        open_state(str(tmp_path), "retrieval")
    store, state = open_state(str(tmp_path), "retrieval", "popularity")  # the lock was released
    assert state.catalog.version == 2 and state.catalog.num_items == 42 and len(state.catalog) == 40
    store.close()
