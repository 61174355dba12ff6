"""Issue 26, the history a recsys engineer sends first: a new user's empty history (cold start, answered from the
popularity order) and a history longer than ``--max-prompt-tokens`` (``truncate``: the newest items that fit, or
413 for who asks). The real engine answers where the engine's answer matters."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import CatalogError, CatalogStore, generate_catalog
from grserve.catalog.popularity import Popularity
from grserve.config import SearchConfig, ServerConfig
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.server.retrieval.app import create_app

DEPTH, CODEBOOK, OFFSET = 3, 8, 16


@pytest.fixture()
def catalog():
    return generate_catalog(200, DEPTH, CODEBOOK, 0, OFFSET)


@pytest.fixture()
def engine(tiny_model, catalog):
    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(catalog, vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=16, max_beam_width=64)).start()
    yield eng
    eng.stop()


def _client(engine, popularity=None, **server) -> TestClient:
    cfg = ServerConfig(**({"max_prompt_tokens": 30, "max_top_n": 64} | server))
    return TestClient(create_app(engine, cfg, popularity=popularity), raise_server_exceptions=False)


def _ids(resp) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [it["item_id"] for it in resp.json()["items"]]


# ----------------------------------------------------------------------------------------------------------
# 1. cold start
# ----------------------------------------------------------------------------------------------------------
def test_empty_history_is_answered_from_the_popularity_order(engine, catalog):
    """Every history form, empty, is a 200 naming its source; the items are the catalog's most interacted ones
    (count descending, then id), scored log((c + 1) / (Σc + N)); the engine computes nothing."""
    ids = catalog.item_ids
    counts = {int(ids[7]): 50, int(ids[3]): 20, int(ids[150]): 20, int(ids[9]): 1, 10 ** 12: 99}  # + not in catalog
    client = _client(engine, Popularity(counts))
    expected = [int(ids[7])] + sorted([int(ids[3]), int(ids[150])]) + [int(ids[9])]
    rest = sorted(set(int(i) for i in ids) - set(expected))[:2]  # count 0: by item id
    total = 50 + 20 + 20 + 1 + len(catalog)  # the count of an id outside the catalog is not in the total
    for field in ("history_items", "history_sids", "history_tokens"):
        r = client.post("/v1/recommend", json={field: [], "top_n": 6})
        assert _ids(r) == expected + rest
        body = r.json()
        assert body["source"] == "popularity" and body["history_dropped"] == 0 and body["batch_size"] == 0
        want = [math.log((c + 1) / total) for c in (50, 20, 20, 1, 0, 0)]
        np.testing.assert_allclose([it["score"] for it in body["items"]], want, rtol=1e-12)
        assert body["items"][0]["sid"] == catalog.sids[7].tolist()
    assert engine.stats()["requests_done"] == 0


def test_cold_start_respects_exclude_items_and_has_a_default_order(engine, catalog):
    """``exclude_items`` are never in a cold-start answer; without a popularity file every item counts 0, so the
    order is the item-id order with score log(1/N)."""
    client = _client(engine)
    ordered = sorted(int(i) for i in catalog.item_ids)
    r = client.post("/v1/recommend", json={"history_items": [], "top_n": 5, "exclude_items": ordered[1:3] + [-5]})
    assert _ids(r) == [ordered[0]] + ordered[3:7]
    assert all(it["score"] == pytest.approx(math.log(1 / len(catalog))) for it in r.json()["items"])


def test_a_history_is_still_answered_by_the_model(engine, catalog):
    r = _client(engine, Popularity({int(catalog.item_ids[0]): 5})).post(
        "/v1/recommend", json={"history_items": [int(catalog.item_ids[4])], "top_n": 3})
    assert r.status_code == 200 and r.json()["source"] == "model"
    assert r.json()["batch_size"] == 1  # computed in an engine batch (a cold start answers batch_size 0)


def test_popularity_files(tmp_path, catalog):
    """The file is ``{"<item id>": count}``; a bad one is refused naming the file; save → load is the same."""
    good = tmp_path / "pop.json"
    good.write_text(json.dumps({"5": 3, "-2": 0, "9": 7}))
    pop = Popularity.load(good)
    assert dict(zip(pop.item_ids.tolist(), pop.counts.tolist())) == {5: 3, -2: 0, 9: 7}
    pop.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == {"9": 7, "5": 3, "-2": 0}
    for text, match in (("[1, 2]", "JSON object"), ('{"x": 1}', "not an integer"), ('{"1": -1}', "non-negative"),
                        ('{"1": 2.5}', "non-negative"), ('{"1": true}', "non-negative"), ("{", "cannot read")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(CatalogError, match=match) as err:
            Popularity.load(tmp_path / "bad.json")
        assert "bad.json" in str(err.value)
    with pytest.raises(CatalogError, match="cannot read"):
        Popularity.load(tmp_path / "missing.json")


def test_popularity_follows_a_catalog_reload(catalog):
    """The order is rebuilt for a new catalog snapshot: an item that left the catalog is not answered."""
    ids = catalog.item_ids
    pop = Popularity({int(ids[0]): 9, int(ids[1]): 8})
    assert pop.top(catalog, 2).item_ids.tolist() == [int(ids[0]), int(ids[1])]
    keep = np.arange(1, len(catalog))
    smaller = type(catalog).from_arrays(ids[keep], catalog.sids[keep].astype(np.int64), catalog.codebook_sizes,
                                        OFFSET)
    assert pop.top(smaller, 1).item_ids.tolist() == [int(ids[1])]


def test_movielens_popularity_counts_every_event_but_the_test_items(tmp_path):
    """The demo's popularity.json: per item, its events in the training histories and validation items — the same
    counts as ``bench quality``'s popularity baseline (the held-out test items never counted)."""
    import pandas as pd

    from grserve.movielens.artifacts import Artifacts, write_popularity

    ratings = pd.DataFrame({"user_id": [1, 1, 1, 1, 2, 2, 2], "movie_id": [10, 11, 12, 13, 10, 12, 14],
                            "timestamp": [1, 2, 3, 4, 1, 2, 3]})
    art = Artifacts(tmp_path)
    write_popularity(art, type("ML", (), {"ratings": ratings})())
    # user 1: train [10, 11], valid 12, test 13; user 2: train [10], valid 12, test 14
    assert json.loads(art.popularity.read_text()) == {"10": 2, "12": 2, "11": 1}


# ----------------------------------------------------------------------------------------------------------
# 2. long histories
# ----------------------------------------------------------------------------------------------------------
def _prompt_of(engine, catalog, client, body) -> tuple[dict, list[int]]:
    """The response and the prompt the engine saw (recorded around submit)."""
    seen: list = []
    submit = engine.submit
    engine.submit = lambda req: seen.append(req.prompt_tokens.tolist()) or submit(req)
    try:
        r = client.post("/v1/recommend", json=body)
    finally:
        engine.submit = submit
    assert r.status_code == 200, r.text
    return r.json(), seen[0]


def test_a_long_history_keeps_its_newest_items_by_default(engine, catalog):
    """max_prompt_tokens 30, depth 3: of 14 items the newest 10 are the prompt and the answer says 4 were dropped;
    the answer equals the one for those 10 items sent alone."""
    client = _client(engine)
    items = [int(i) for i in catalog.item_ids[20:34]]
    body, prompt = _prompt_of(engine, catalog, client, {"history_items": items, "top_n": 8})
    assert body["history_dropped"] == 4 and body["source"] == "model"
    assert prompt == catalog.layout.sids_to_tokens(catalog.sids_of_items(np.array(items[4:]))).tolist()
    alone = client.post("/v1/recommend", json={"history_items": items[4:], "top_n": 8}).json()
    assert alone["history_dropped"] == 0 and alone["items"] == body["items"]


def test_truncation_of_sids_and_raw_tokens(engine, catalog):
    client = _client(engine)
    sids = [[i % 8, (i * 3) % 8, 1] for i in range(12)]
    body, prompt = _prompt_of(engine, catalog, client, {"history_sids": sids})
    assert body["history_dropped"] == 2
    assert prompt == catalog.layout.sids_to_tokens(np.array(sids[2:])).tolist()
    tokens = list(range(16, 16 + 35))
    body, prompt = _prompt_of(engine, catalog, client, {"history_tokens": tokens, "truncate": "left"})
    assert body["history_dropped"] == 5 and prompt == tokens[5:]


def test_413_stays_for_who_asks(engine, catalog):
    """``truncate: "none"`` in the request, or ``--truncate none`` on the server (a request's "left" overrides)."""
    items = [int(i) for i in catalog.item_ids[:11]]
    r = _client(engine).post("/v1/recommend", json={"history_items": items, "truncate": "none"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "prompt_too_long"
    strict = _client(engine, truncate="none")
    r = strict.post("/v1/recommend", json={"history_items": items})
    assert r.status_code == 413 and r.json()["error"]["field"] == "history_items"
    r = strict.post("/v1/recommend", json={"history_items": items, "truncate": "left"})
    assert r.status_code == 200 and r.json()["history_dropped"] == 1
    assert strict.post("/v1/recommend", json={"history_items": items[:10]}).status_code == 200


def test_a_truncated_history_is_bounded_by_max_history_entries(engine, catalog):
    """Truncation reads at most --max-history-entries entries (checked on the raw body, before it is parsed): more
    is a 413 naming the field; at the bound it is cut to the newest that fit."""
    client = _client(engine, max_history_entries=40)
    ids = [int(i) for i in catalog.item_ids[:41]]
    r = client.post("/v1/recommend", json={"history_items": ids})
    assert r.status_code == 413 and r.json()["error"]["type"] == "history_too_long", r.text
    assert r.json()["error"]["field"] == "history_items"
    r = client.post("/v1/recommend", json={"history_items": ids[1:]})
    assert r.status_code == 200 and r.json()["history_dropped"] == 30


def test_dropped_entries_are_still_validated(engine, catalog):
    """An unknown id or a bad SID among the dropped (oldest) entries is still the request's error."""
    client = _client(engine)
    items = [10 ** 9] + [int(i) for i in catalog.item_ids[:10]]
    r = client.post("/v1/recommend", json={"history_items": items})
    assert r.status_code == 404 and r.json()["error"]["field"] == "history_items[0]"
    r = client.post("/v1/recommend", json={"history_sids": [[0, 9, 0]] + [[0, 0, 0]] * 10})
    assert r.status_code == 400 and r.json()["error"]["field"] == "history_sids[0][1]"


def test_a_history_of_items_larger_than_the_limit_becomes_a_cold_start(engine, catalog):
    """max_prompt_tokens 2 < one item's 3 tokens: every item is dropped, and the answer is the popularity one."""
    r = _client(engine, Popularity({int(catalog.item_ids[5]): 3}), max_prompt_tokens=2).post(
        "/v1/recommend", json={"history_items": [int(catalog.item_ids[0])], "top_n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["source"] == "popularity" and body["history_dropped"] == 1
    assert body["items"][0]["item_id"] == int(catalog.item_ids[5])


def test_a_layout_with_a_start_token_answers_a_new_user_from_the_model(onerec_dir):
    """OneRec-like layout (items wrapped in sid_begin/sid_end): an empty history is the prompt-only history
    [sid_begin], answered by the model; a long history is cut in whole wrapped items (5 tokens each)."""
    from grserve.config import CatalogConfig, ModelConfig, ServeConfig

    cfg = ServeConfig(model=ModelConfig(source=str(onerec_dir.path)),
                      catalog=CatalogConfig(path=str(onerec_dir.catalog)), search=SearchConfig(beam_width=8))
    eng = RetrievalEngine.build(cfg).start()
    try:
        client = TestClient(create_app(eng, ServerConfig(max_prompt_tokens=10)), raise_server_exceptions=False)
        layout = eng.catalogs.current().layout
        r = client.post("/v1/recommend", json={"history_items": [], "top_n": 4})
        assert r.status_code == 200 and r.json()["source"] == "model", r.text
        same = client.post("/v1/recommend", json={"history_tokens": [layout.sid_begin], "top_n": 4}).json()
        assert r.json()["items"] == same["items"]
        body, prompt = _prompt_of(eng, None, client, {"history_items": [3, 7, 11], "top_n": 4})
        assert body["history_dropped"] == 1
        assert prompt == layout.items_to_tokens(onerec_dir.sids[[7, 11]]).tolist() + [layout.sid_begin]
    finally:
        eng.stop()
