"""``exclude_history``: a request that never gets back an item its own history names — the same search as
``exclude_items`` listing those items, for every history form (item ids, SIDs, raw tokens with other tokens between
the items), online and offline."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import CatalogStore, generate_catalog
from grserve.catalog.history import items_in_tokens
from grserve.config import SearchConfig, ServerConfig
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.server.retrieval.app import create_app

TOP = 64


@pytest.fixture(scope="module")
def served(tiny_model):
    catalog = generate_catalog(200, 3, 8, 0, 16)
    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(catalog, vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=TOP, max_beam_width=TOP)).start()
    yield catalog, TestClient(create_app(eng, ServerConfig(max_top_n=TOP)))
    eng.stop()


def _ids(r) -> list[int]:
    assert r.status_code == 200, r.text
    return [it["item_id"] for it in r.json()["items"]]


def test_exclude_history_equals_excluding_the_history_items_in_every_form(served):
    catalog, client = served
    rng = np.random.default_rng(3)
    rows = rng.choice(len(catalog), 12, replace=False)
    history = [int(i) for i in catalog.item_ids[rows]]
    sids = catalog.sids[rows].astype(np.int64)
    tokens = catalog.layout.items_to_tokens(sids).reshape(len(rows), -1)
    noisy = np.concatenate([np.concatenate([[3, 5], t]) for t in tokens]).tolist()  # other tokens between items
    forms = {"history_items": history, "history_sids": sids.tolist(), "history_tokens": noisy}
    for field, value in forms.items():
        plain = _ids(client.post("/v1/recommend", json={field: value, "top_n": TOP}))
        assert set(plain) & set(history), field  # without the flag the model does return some of them
        got = _ids(client.post("/v1/recommend", json={field: value, "top_n": TOP, "exclude_history": True}))
        assert not set(got) & set(history), field
        same = _ids(client.post("/v1/recommend", json={field: value, "top_n": TOP, "exclude_items": history}))
        assert got == same, field
    both = _ids(client.post("/v1/recommend", json={"history_items": history, "top_n": TOP, "exclude_history": True,
                                                   "exclude_items": [int(catalog.item_ids[0])]}))
    assert int(catalog.item_ids[0]) not in both and not set(both) & set(history)


def test_items_in_tokens_finds_whole_sids_only(served):
    catalog, _ = served
    t = catalog.layout.items_to_tokens(catalog.sids[[4, 9]].astype(np.int64)).tolist()
    assert sorted(items_in_tokens(catalog, t).tolist()) == sorted(int(i) for i in catalog.item_ids[[4, 9]])
    assert items_in_tokens(catalog, t[1:]).tolist() == [int(catalog.item_ids[9])]  # a cut SID names nothing
    assert items_in_tokens(catalog, t[:2]).size == 0


def test_the_offline_api_takes_exclude_history(served, tmp_path):
    from grserve.catalog import save_catalog
    from grserve.recommender import Recommender

    catalog, client = served
    path = tmp_path / "c.jsonl"
    save_catalog(catalog, path)
    history = [int(i) for i in catalog.item_ids[:10]]
    with Recommender(model="tiny", catalog=str(path), beam_width=16) as rec:
        out = rec.recommend([{"history_items": history, "exclude_history": True, "top_n": 16}], progress=False)
        ref = rec.recommend([{"history_items": history, "exclude_items": history, "top_n": 16}], progress=False)
    assert out[0].item_ids == ref[0].item_ids and not set(out[0].item_ids) & set(history)
