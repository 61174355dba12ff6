"""Issue 26 item 3: allowlists inside the beam search — ``include_items`` and ``include_sid_prefix`` (a semantic
category: the items under a SID prefix) give exactly the search over the catalog restricted to the allowed items,
as ``exclude_items`` gives the search over the catalog without them."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import Catalog, CatalogStore, generate_catalog
from grserve.catalog.allowlist import Allow, ItemAllowlist, allowed_rows, prefix_rows
from grserve.catalog.popularity import Popularity
from grserve.config import AccelConfig, SearchConfig, ServerConfig
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.types import RetrievalRequest
from grserve.server.retrieval.app import create_app

BW = 16


@pytest.fixture(scope="module")
def cat():
    return generate_catalog(300, 3, 8, seed=1, token_offset=16)


@pytest.fixture(scope="module")
def runner(tiny_model):
    r = RetrievalRunner(tiny_model(seed=0), SearchConfig(beam_width=BW, max_beam_width=64))
    yield r
    r.close()


def _restricted(cat: Catalog, keep: np.ndarray) -> Catalog:
    return Catalog.from_arrays(cat.item_ids[keep], cat.sids[keep].astype(np.int64), cat.codebook_sizes, 16)


def _same(hits, ref) -> None:
    assert [(h.item_id, h.sid) for h in hits] == [(h.item_id, h.sid) for h in ref]
    # the reference runs alone, the filtered run in a batch of several: fp32 sums differ in the last bits
    np.testing.assert_allclose([h.score for h in hits], [h.score for h in ref], rtol=0, atol=1e-5)


def test_an_allowlist_equals_a_search_over_the_restricted_catalog(runner, cat):
    """Four requests in one batch: a random allowlist (+ unknown ids), an allowlist with exclusions, a SID prefix,
    and a prefix ∩ an allowlist. Each answer (ids, SIDs, scores) equals the same search over a catalog holding only
    the allowed items, and nothing outside them is returned."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(16, 400, size=12) for _ in range(4)]
    pick = rng.choice(len(cat), 60, replace=False)
    some = cat.item_ids[pick]
    prefix = tuple(int(c) for c in cat.sids[150, :1])
    allows = [Allow(np.append(some, [10 ** 15, -7])), Allow(some), Allow(sid_prefix=prefix),
              Allow(cat.item_ids[::2], prefix)]
    excludes = [None, some[:25], None, None]
    out = runner.run(prompts, BW, [BW] * 4, cat, exclude=excludes, include=allows)
    in_prefix = (cat.sids[:, 0] == prefix[0])
    keeps = [np.isin(cat.item_ids, some), np.isin(cat.item_ids, some[25:]), in_prefix,
             in_prefix & (np.arange(len(cat)) % 2 == 0)]
    for i, keep in enumerate(keeps):
        assert 0 < keep.sum() < len(cat)
        ref = runner.run([prompts[i]], BW, [BW], _restricted(cat, keep)).hits[0]
        _same(out.hits[i], ref)
        assert len(ref) == min(BW, int(keep.sum()))
        assert set(h.item_id for h in out.hits[i]) <= set(cat.item_ids[keep].tolist())


def test_a_small_allowlist_returns_only_its_items(runner, cat):
    """Fewer allowed items than the beam: exactly them (each once), a full SID prefix: that one item, nothing
    allowed (unknown ids, a prefix no item has): no item."""
    prompts = [np.arange(20, 32)] * 3
    few = cat.item_ids[[3, 77, 200]]
    sid = tuple(int(c) for c in cat.sids[42])
    out = runner.run(prompts, BW, [BW] * 3, cat, include=[Allow(few), Allow(sid_prefix=sid), Allow(np.array([-1]))])
    assert sorted(h.item_id for h in out.hits[0]) == sorted(few.tolist())
    assert [h.item_id for h in out.hits[1]] == [int(cat.item_ids[42])]
    assert out.hits[2] == []
    missing = next(c for c in range(8) if not (cat.sids[:, 0] == c).any()) if len(set(cat.sids[:, 0])) < 8 else None
    if missing is not None:
        assert runner.run(prompts[:1], BW, [BW], cat, include=[Allow(sid_prefix=(missing,))]).hits == [[]]


def test_masked_items_never_fill_a_beam_when_too_few_remain(runner, cat):
    """Fewer items left than the beam width (exclude all but 3 of a prefix's items; an allowlist of 3): only those
    come back. Masked codes are −inf, not the lowest finite float, which made excluded items fill the free beams."""
    prompt = [np.arange(20, 32)]
    branch = np.flatnonzero(cat.sids[:, 0] == cat.sids[0, 0])
    keep = cat.item_ids[branch[:3]]
    out = runner.run(prompt, BW, [BW], cat, exclude=[np.setdiff1d(cat.item_ids, keep)])
    assert sorted(h.item_id for h in out.hits[0]) == sorted(keep.tolist())
    assert all(np.isfinite(h.score) and h.score > -1e30 for h in out.hits[0])


def test_allowlist_kills_are_the_restricted_catalogs_mask(cat):
    """At every level, for every node: the codes left after the allowlist's kills = the restricted catalog's valid
    codes under the same prefix."""
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(cat), 40, replace=False))
    allow = ItemAllowlist(cat, rows)
    small = _restricted(cat, np.isin(np.arange(len(cat)), rows))
    for level in range(cat.depth):
        nodes = np.arange(cat.trie.num_nodes(level))
        valid_rows, valid_codes = cat.mask._positions(level, nodes)
        dead_rows, dead_codes = allow.kills(level, nodes)
        dead = set(zip(dead_rows.tolist(), dead_codes.tolist()))
        assert dead <= set(zip(valid_rows.tolist(), valid_codes.tolist()))  # a subset of what the mask allows
        prefixes = _node_prefixes(cat, level)
        for r, c in zip(valid_rows.tolist(), valid_codes.tolist()):
            under = small.trie.lookup(prefixes[r] + (c,)) >= 0
            assert ((r, c) not in dead) == under


def _node_prefixes(cat: Catalog, level: int) -> list[tuple[int, ...]]:
    """The SID prefix of every level-``level`` trie node, in node order."""
    return sorted({tuple(int(x) for x in s[:level]) for s in cat.sids}) if level else [()]


def test_prefix_rows_are_the_items_under_the_prefix(cat):
    for prefix in [(), (int(cat.sids[0, 0]),), tuple(int(c) for c in cat.sids[99, :2]), tuple(cat.sids[7].tolist())]:
        lo, hi = prefix_rows(cat, prefix)
        under = np.flatnonzero((cat.sids[:, : len(prefix)] == np.asarray(prefix, dtype=cat.sids.dtype)).all(axis=1))
        assert list(range(lo, hi)) == under.tolist()
    assert prefix_rows(cat, (7, 7, 7, 7)) == (0, 0)
    assert allowed_rows(cat, Allow(cat.item_ids[:10]), cat.item_ids[:4]).tolist() == \
        sorted(np.flatnonzero(np.isin(cat.item_ids, cat.item_ids[4:10])).tolist())


# ----------------------------------------------------------------------------------------------------------
# over HTTP, the device path, cold start
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture()
def client(tiny_model, cat):
    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(cat, vocab_size=model.spec.vocab_size), SearchConfig(beam_width=8)).start()
    pop = Popularity({int(i): int(i) for i in cat.item_ids})  # count = id: the popularity order is descending id
    yield TestClient(create_app(eng, ServerConfig(max_include_items=100), popularity=pop),
                     raise_server_exceptions=False), cat
    eng.stop()


def _ids(r) -> list[int]:
    assert r.status_code == 200, r.text
    return [it["item_id"] for it in r.json()["items"]]


def test_include_items_over_http(client):
    http, cat = client
    body = {"history_tokens": [20, 30, 40], "top_n": 8}
    allow = [int(i) for i in cat.item_ids[100:130]]
    got = _ids(http.post("/v1/recommend", json=body | {"include_items": allow + [-1, 2 ** 70]}))
    assert len(got) == 8 and set(got) <= set(allow)
    got = _ids(http.post("/v1/recommend", json=body | {"include_items": allow, "exclude_items": allow[:25]}))
    assert set(got) <= set(allow[25:]) and len(got) == 5
    prefix = [int(c) for c in cat.sids[120, :2]]
    got = _ids(http.post("/v1/recommend", json=body | {"include_sid_prefix": prefix}))
    assert got and all(cat.sid_of(i)[:2] == tuple(prefix) for i in got)
    assert _ids(http.post("/v1/recommend", json=body | {"include_items": []})) == []


@pytest.mark.parametrize("extra,status,field,etype", [
    ({"include_items": list(range(101))}, 413, "include_items", "too_many_included"),
    ({"include_sid_prefix": [0, 0, 0, 0]}, 400, "include_sid_prefix", "wrong_depth"),
    ({"include_sid_prefix": [0, 8]}, 400, "include_sid_prefix[1]", "out_of_range"),
    ({"include_sid_prefix": [-1]}, 400, "include_sid_prefix[0]", "out_of_range"),
    ({"include_sid_prefix": []}, 400, "include_sid_prefix", "too_short"),
    ({"include_items": ["1"]}, 422, "include_items[0]", "int_type"),
])
def test_bad_allowlists(client, extra, status, field, etype):
    http, _ = client
    r = http.post("/v1/recommend", json={"history_tokens": [20, 30], "top_n": 4} | extra)
    assert r.status_code == status, r.text
    assert (r.json()["error"]["field"], r.json()["error"]["type"]) == (field, etype)


def test_cold_start_keeps_to_the_allowlist(client):
    """A new user with an allowlist: the most popular allowed items (popularity here: descending item id)."""
    http, cat = client
    allow = [int(i) for i in cat.item_ids[10:40]]
    got = _ids(http.post("/v1/recommend", json={"history_items": [], "top_n": 4, "include_items": allow,
                                                "exclude_items": [max(allow)]}))
    assert got == sorted(allow, reverse=True)[1:5]
    prefix = [int(cat.sids[200, 0])]
    got = _ids(http.post("/v1/recommend", json={"history_items": [], "top_n": 3, "include_sid_prefix": prefix}))
    under = sorted((int(i) for i, s in zip(cat.item_ids, cat.sids) if s[0] == prefix[0]), reverse=True)
    assert got == under[:3]


def test_the_device_path_never_serves_an_allowlist_unmasked(tiny_model, cat):
    """The fast path has no per-request mask: a batch with an allowlist takes the host reference path."""
    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(cat, vocab_size=model.spec.vocab_size), SearchConfig(beam_width=8),
                          accel=AccelConfig(fast_path="on", batch_buckets="1,2")).start()
    try:
        allow = cat.item_ids[50:60]
        res = eng.submit(RetrievalRequest(np.arange(20, 32), 8, 8, include=Allow(allow))).future.result(timeout=120)
        assert len(res.items) == 8 and {it.item_id for it in res.items} <= set(allow.tolist())
    finally:
        eng.stop()
