"""HTTP server, metrics and CLI, against a FakeEngine (the real engine has its own tests)."""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import time
import types

import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import Catalog, CatalogStore, generate_catalog, save_catalog
from grserve.cli import main as cli_main
from grserve.config import CatalogReloadConfig, EdgeConfig, SchedulerConfig, SearchConfig, ServerConfig
from grserve.engine.protocol import EngineHealth, EngineOverloaded, EngineStopped, RequestHandle
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.inputs.refusal import field_path
from grserve.server.http.metrics import Metrics
from grserve.server.retrieval.app import create_app


DEPTH, CODEBOOK, OFFSET, VOCAB = 3, 8, 16, 64  # SID tokens occupy [16, 40)
N_ITEMS = 200


class FakeEngine:
    """The Engine protocol with RetrievalEngine's extras (catalogs, search, vocab_size); answers at once with the
    first top_n catalog items, scores 0, -1, -2, ... ("hang": never answers, until cancelled)."""

    def __init__(self, catalog, vocab_size: int = VOCAB, search: SearchConfig | None = None) -> None:
        self.catalogs = CatalogStore(catalog, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.search = search or SearchConfig(beam_width=16, max_beam_width=64)
        self.scheduler = SchedulerConfig()
        self.mode = "ok"  # "ok" | "overload" | "stopped" | "error" | "hang"
        self.requests: list[RetrievalRequest] = []
        self.cancelled: list[str] = []
        self.handles: dict[str, RequestHandle] = {}
        self.started = self.stopped = False
        self._depth = 0

    @classmethod
    def build(cls, cfg, on_batch=None):
        eng = cls(generate_catalog(N_ITEMS, DEPTH, CODEBOOK, 0, OFFSET))
        eng.on_batch = on_batch
        return eng

    def start(self) -> FakeEngine:
        self.started = True
        return self

    def stop(self) -> None:
        self.stopped = True

    def drain(self, timeout_s=None) -> bool:
        return True

    @property
    def queue_depth(self) -> int:
        return self._depth

    def health(self) -> EngineHealth:
        return EngineHealth("ok", self._depth, len(self.handles))

    def stats(self) -> dict:
        return {"requests": len(self.requests)}

    def cancel(self, request_id: str) -> bool:
        handle = self.handles.pop(request_id, None)
        self.cancelled.append(request_id)
        if handle is None:
            return False
        handle.future.cancel()
        return True

    def submit(self, req: RetrievalRequest) -> RequestHandle:
        self.requests.append(req)
        if self.mode == "overload":
            raise EngineOverloaded("queue full (4096 waiting)")
        if self.mode == "stopped":
            raise EngineStopped("draining")
        handle: RequestHandle = RequestHandle(req.request_id, on_cancel=self.cancel)
        if self.mode == "error":
            handle.future.set_exception(RuntimeError("kaboom"))
        elif self.mode == "hang":
            self.handles[req.request_id] = handle
        else:
            handle.future.set_result(self.answer(req))
        return handle

    def answer(self, req: RetrievalRequest) -> RetrievalResult:
        cat = self.catalogs.current()
        n = min(req.top_n, len(cat))
        items = [RetrievedItem(int(cat.item_ids[i]), tuple(int(c) for c in cat.sids[i]), -float(i)) for i in range(n)]
        return RetrievalResult(req.request_id, items, queue_ms=1.5, compute_ms=2.5, batch_size=3,
                               catalog_version=cat.version)


@pytest.fixture()
def catalog():
    return generate_catalog(N_ITEMS, DEPTH, CODEBOOK, 0, OFFSET)


@pytest.fixture()
def engine(catalog):
    return FakeEngine(catalog)


@pytest.fixture()
def metrics():
    return Metrics()


@pytest.fixture()
def client(engine, metrics):
    app = create_app(engine, ServerConfig(max_prompt_tokens=30, max_top_n=12), metrics)
    return TestClient(app, raise_server_exceptions=False)


def _err(resp, status: int, field: str | None, type_: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "field", "type"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["field"] == field, err
    if type_ is not None:
        assert err["type"] == type_, err
    return err


# ----------------------------------------------------------------------------------------------------------
# happy paths
# ----------------------------------------------------------------------------------------------------------
def test_recommend_by_items(client, engine, catalog):
    ids = [int(x) for x in catalog.item_ids[[5, 17, 3]]]
    r = client.post("/v1/recommend", json={"history_items": ids, "beam_width": 8, "top_n": 4, "request_id": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["request_id"] == "u1"
    assert body["beam_width"] == 8 and body["batch_size"] == 3 and body["catalog_version"] == 1
    assert [it["score"] for it in body["items"]] == [0.0, -1.0, -2.0, -3.0]
    assert body["items"][0] == {"item_id": int(catalog.item_ids[0]), "sid": catalog.sids[0].tolist(), "score": 0.0}
    assert body["timing"]["queue_ms"] == 1.5 and body["timing"]["compute_ms"] == 2.5
    assert body["timing"]["total_ms"] >= 0
    req = engine.requests[-1]
    expected = catalog.layout.sids_to_tokens(catalog.sids_of_items(np.array(ids)))
    assert req.prompt_tokens.dtype == np.int64 and req.prompt_tokens.tolist() == expected.tolist()
    assert (req.beam_width, req.top_n) == (8, 4)
    assert req.request_id != "u1"  # the engine's key is the server's own; the client's id is only echoed


def test_recommend_by_sids(client, engine, catalog):
    sids = [[0, 1, 2], [7, 7, 7]]  # range-checked only: a SID need not be a catalog item
    r = client.post("/v1/recommend", json={"history_sids": sids})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["beam_width"] == 16 and len(body["items"]) == 10  # defaults: SearchConfig.beam_width, top_n 10
    assert len(body["request_id"]) > 0
    assert engine.requests[-1].prompt_tokens.tolist() == [16, 25, 34, 23, 31, 39]


def test_recommend_by_tokens(client, engine):
    r = client.post("/v1/recommend", json={"history_tokens": [0, 5, 63], "beam_width": 2, "top_n": 2})
    assert r.status_code == 200, r.text
    assert len(r.json()["items"]) == 2
    assert engine.requests[-1].prompt_tokens.tolist() == [0, 5, 63]


def test_prompt_at_exact_limit_is_accepted(client):
    assert client.post("/v1/recommend", json={"history_tokens": [1] * 30}).status_code == 200
    assert client.post("/v1/recommend", json={"history_sids": [[0, 0, 0]] * 10}).status_code == 200


# ----------------------------------------------------------------------------------------------------------
# every malformed request: 4xx, the error body, the field named
# ----------------------------------------------------------------------------------------------------------
BAD_REQUESTS = [
    # (id, json body, status, field, type)
    ("no-history", {"top_n": 3}, 422, "history", "history_missing"),
    ("no-history-nulls", {"history_items": None}, 422, "history", "history_missing"),
    ("two-histories", {"history_items": [1], "history_tokens": [1]}, 422, "history", "history_ambiguous"),
    ("unknown-items", {"history_items": [1, 5000, 2, 7000]}, 404, "history_items[1]", "unknown_items"),
    ("negative-item", {"history_items": [-3]}, 404, "history_items[0]", "unknown_items"),
    ("huge-item", {"history_items": [1, 2 ** 70]}, 404, "history_items[1]", "unknown_items"),
    ("sid-short", {"history_sids": [[1, 2, 3], [1, 2]]}, 400, "history_sids[1]", "wrong_depth"),
    ("sid-long", {"history_sids": [[1, 2, 3, 4]]}, 400, "history_sids[0]", "wrong_depth"),
    ("sid-empty", {"history_sids": [[]]}, 400, "history_sids[0]", "wrong_depth"),
    ("sid-code-high", {"history_sids": [[0, 0, 0], [1, 8, 0]]}, 400, "history_sids[1][1]", "out_of_range"),
    ("sid-code-neg", {"history_sids": [[0, 0, -1]]}, 400, "history_sids[0][2]", "out_of_range"),
    ("sid-code-huge", {"history_sids": [[2 ** 80, 0, 0]]}, 400, "history_sids[0][0]", "out_of_range"),
    ("token-high", {"history_tokens": [5, 64]}, 400, "history_tokens[1]", "out_of_range"),
    ("token-neg", {"history_tokens": [-1, 5]}, 400, "history_tokens[0]", "out_of_range"),
    ("token-huge", {"history_tokens": [3, 2 ** 90]}, 400, "history_tokens[1]", "out_of_range"),
    ("too-long-tokens", {"history_tokens": [1] * 31, "truncate": "none"}, 413, "history_tokens", "prompt_too_long"),
    ("too-long-items", {"history_items": [0] * 11, "truncate": "none"}, 413, "history_items", "prompt_too_long"),
    ("too-long-sids", {"history_sids": [[0, 0, 0]] * 11, "truncate": "none"}, 413, "history_sids",
     "prompt_too_long"),
    ("truncate-bad", {"history_tokens": [1], "truncate": "right"}, 400, "truncate", "literal_error"),
    ("truncate-int", {"history_tokens": [1], "truncate": 1}, 400, "truncate", "literal_error"),
    ("beam-zero", {"history_tokens": [1], "beam_width": 0}, 400, "beam_width", "greater_than_equal"),
    ("beam-neg", {"history_tokens": [1], "beam_width": -5}, 400, "beam_width", "greater_than_equal"),
    ("beam-too-big", {"history_tokens": [1], "beam_width": 65}, 400, "beam_width", "out_of_range"),
    ("top-n-zero", {"history_tokens": [1], "top_n": 0}, 400, "top_n", "greater_than_equal"),
    ("top-n-over-beam", {"history_tokens": [1], "beam_width": 4, "top_n": 5}, 400, "top_n", "out_of_range"),
    ("top-n-over-default-beam", {"history_tokens": [1], "top_n": 17}, 400, "top_n", "out_of_range"),
    ("top-n-over-server-max", {"history_tokens": [1], "beam_width": 64, "top_n": 13}, 400, "top_n",
     "out_of_range"),
    ("items-str", {"history_items": [1, "2"]}, 422, "history_items[1]", "int_type"),
    ("items-float", {"history_items": [1.0]}, 422, "history_items[0]", "int_type"),
    ("items-bool", {"history_items": [True]}, 422, "history_items[0]", "int_type"),
    ("items-not-list", {"history_items": 5}, 422, "history_items", "list_type"),
    ("sids-flat", {"history_sids": [1, 2, 3]}, 422, "history_sids[0]", "list_type"),
    ("sids-str-code", {"history_sids": [[1, "x", 2]]}, 422, "history_sids[0][1]", "int_type"),
    ("tokens-null-elem", {"history_tokens": [1, None]}, 422, "history_tokens[1]", "int_type"),
    ("beam-str", {"history_tokens": [1], "beam_width": "8"}, 422, "beam_width", "int_type"),
    ("top-n-float", {"history_tokens": [1], "top_n": 2.5}, 422, "top_n", "int_type"),
    ("request-id-int", {"history_tokens": [1], "request_id": 5}, 422, "request_id", "string_type"),
    ("request-id-empty", {"history_tokens": [1], "request_id": ""}, 400, "request_id", "string_too_short"),
    ("unknown-field", {"history_item": [1]}, 422, "history_item", "extra_forbidden"),
    ("body-list", [1, 2], 422, None, "model_attributes_type"),
    ("body-str", "hello", 422, None, "model_attributes_type"),
    ("body-null", None, 422, None, None),
]


@pytest.mark.parametrize("body,status,field,type_", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_errors(client, engine, body, status, field, type_):
    r = client.post("/v1/recommend", json=body)
    _err(r, status, field, type_)
    assert engine.requests == []  # nothing invalid reaches the engine


def test_unknown_item_message_lists_ids(client):
    err = _err(client.post("/v1/recommend", json={"history_items": [1, 5000, 2, 7000, 5000]}), 404,
               "history_items[1]", "unknown_items")
    assert "5000" in err["message"] and "7000" in err["message"] and "2 unknown" in err["message"]


def test_sid_error_message_names_level_range(client):
    err = _err(client.post("/v1/recommend", json={"history_sids": [[0, 9, 0]]}), 400, "history_sids[0][1]")
    assert "[0, 8)" in err["message"]


def test_non_json_bodies(client):
    _err(client.post("/v1/recommend", content=b"{not json", headers={"content-type": "application/json"}),
         400, None, "invalid_json")
    _err(client.post("/v1/recommend", content=b'{"history_tokens": [1,]}',
                     headers={"content-type": "application/json"}), 400, None, "invalid_json")
    _err(client.post("/v1/recommend", content=b"history=1", headers={"content-type": "text/plain"}),
         415, None, "unsupported_media_type")
    _err(client.post("/v1/recommend", content=b"", headers={"content-type": "application/json"}), 422, None)
    _err(client.post("/v1/recommend"), 422, None)


def test_unknown_route_and_method(client):
    _err(client.get("/v1/nope"), 404, None, "not_found")
    _err(client.get("/v1/recommend"), 405, None, "method_not_allowed")


def test_server_keeps_serving_after_bad_burst(client, engine):
    for _, body, *_ in BAD_REQUESTS * 3:
        assert 400 <= client.post("/v1/recommend", json=body).status_code < 500
    for _ in range(5):
        client.post("/v1/recommend", content=b"\x00\xff garbage", headers={"content-type": "application/json"})
    r = client.post("/v1/recommend", json={"history_tokens": [1, 2, 3], "top_n": 2})
    assert r.status_code == 200 and len(r.json()["items"]) == 2


# ----------------------------------------------------------------------------------------------------------
# engine failures
# ----------------------------------------------------------------------------------------------------------
def test_overload_is_429_then_recovers(client, engine):
    engine.mode = "overload"
    r = client.post("/v1/recommend", json={"history_tokens": [1]})
    err = _err(r, 429, None, "overloaded")
    assert "queue full" in err["message"] and r.headers["retry-after"] == "1"
    engine.mode = "ok"
    assert client.post("/v1/recommend", json={"history_tokens": [1]}).status_code == 200


def test_stopping_engine_is_503(client, engine):
    engine.mode = "stopped"
    r = client.post("/v1/recommend", json={"history_tokens": [1]})
    _err(r, 503, None, "stopped")
    assert r.headers["retry-after"] == "1"


def test_client_disconnect_cancels_the_request(engine, metrics):
    """A client that leaves before its answer has its request cancelled in the engine (its resources freed);
    the metrics record 499. Driven as raw ASGI: the body, then a disconnect while the engine still works."""
    app = create_app(engine, ServerConfig(), metrics)
    engine.mode = "hang"
    body = json.dumps({"history_tokens": [1, 2], "request_id": "gone-1"}).encode()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(0.05)  # the client leaves while the engine works
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/recommend", "raw_path": b"/v1/recommend",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    key = engine.requests[-1].request_id  # the server's key of the request, not the client's "gone-1"
    assert key != "gone-1" and engine.cancelled == [key] and engine.handles == {}
    assert sent[0]["status"] == 499
    assert 'grserve_requests_total{route="/v1/recommend",status="499"} 1.0' in metrics.render()[0].decode()


def test_client_disconnect_cancels_an_openai_beam_request(engine, metrics):
    """The OpenAI beam routes (``server/openai_beams.py``) cancel like /v1/recommend: a client that leaves has its
    request cancelled in the engine; the metrics record 499 on the route."""
    app = create_app(engine, ServerConfig(), metrics)
    engine.mode = "hang"
    body = json.dumps({"model": "grserve", "prompt": [1, 2], "n": 1}).encode()
    inbox = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    before = list(engine.cancelled)
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert len(engine.cancelled) == len(before) + 1 and engine.handles == {}
    assert sent[0]["status"] == 499
    assert 'grserve_requests_total{route="/v1/completions",status="499"} 1.0' in metrics.render()[0].decode()


def test_unknown_paths_share_one_metrics_label(client, metrics):
    """The request counter is labelled by route template: random unknown paths add no label values."""
    rng = random.Random(0)
    paths = ["/" + "".join(rng.choices(string.ascii_lowercase, k=12)) for _ in range(20)]
    for path in paths:
        _err(client.get(path), 404, None, "not_found")
    text = metrics.render()[0].decode()
    assert 'grserve_requests_total{route="unmatched",status="404"} 20.0' in text
    assert not any(path in text for path in paths)


def test_engine_exception_is_500_then_recovers(client, engine):
    engine.mode = "error"
    for _ in range(3):
        err = _err(client.post("/v1/recommend", json={"history_tokens": [1]}), 500, None, "internal")
        assert "kaboom" not in err["message"]  # no internals leak; the traceback is logged
    engine.mode = "ok"
    assert client.post("/v1/recommend", json={"history_tokens": [1]}).status_code == 200


def test_unexpected_exception_outside_engine_is_500(client, engine, monkeypatch):
    original = engine.catalogs.current

    def broken():
        raise RuntimeError("catalog store exploded")

    monkeypatch.setattr(engine.catalogs, "current", broken)
    _err(client.post("/v1/recommend", json={"history_tokens": [1]}), 500, None, "internal")
    monkeypatch.setattr(engine.catalogs, "current", original)
    assert client.post("/v1/recommend", json={"history_tokens": [1]}).status_code == 200


# ----------------------------------------------------------------------------------------------------------
# health and metrics
# ----------------------------------------------------------------------------------------------------------
def test_health(client, engine):
    engine._depth = 7
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "queue_depth": 7, "running": 0, "vocab_size": VOCAB,
                        "catalog": {"num_items": N_ITEMS, "version": 1, "depth": DEPTH,
                                    "codebook_sizes": [CODEBOOK] * DEPTH}}
    engine.health = lambda: EngineHealth("draining", 0, 2)
    r = client.get("/health")  # not taking requests: a load balancer must see it
    assert r.status_code == 503 and r.json()["status"] == "draining" and r.json()["running"] == 2


def test_metrics_after_requests(client, engine, metrics):
    client.post("/v1/recommend", json={"history_tokens": [1], "top_n": 3})
    client.post("/v1/recommend", json={"history_tokens": [1], "top_n": 5})
    client.post("/v1/recommend", json={"history_tokens": [999]})
    client.get("/does-not-exist")
    metrics.on_batch(4, 100)
    engine._depth = 5
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'grserve_requests_total{route="/v1/recommend",status="200"} 2.0' in text
    assert 'grserve_requests_total{route="/v1/recommend",status="400"} 1.0' in text
    assert 'grserve_requests_total{route="unmatched",status="404"} 1.0' in text
    assert 'grserve_request_latency_seconds_bucket{le="0.001",route="/v1/recommend"}' in text
    assert 'grserve_request_latency_seconds_count{route="/v1/recommend"} 3.0' in text
    assert "grserve_items_returned_count 2.0" in text and "grserve_items_returned_sum 8.0" in text
    assert "grserve_batch_size_count 1.0" in text and "grserve_batch_size_sum 4.0" in text
    assert "grserve_batch_tokens_sum 100.0" in text
    assert "grserve_queue_depth 5.0" in text
    # the scrape itself is counted on the next one
    assert 'grserve_requests_total{route="/metrics",status="200"} 1.0' in client.get("/metrics").text


def test_metrics_are_per_instance():
    a, b = Metrics(), Metrics()
    a.on_batch(2, 10)
    assert b"grserve_batch_size_count 1.0" in a.render()[0]
    assert b"grserve_batch_size_count 0.0" in b.render()[0]
    payload, ctype = b.render()
    assert ctype.startswith("text/plain") and b"grserve_queue_depth 0.0" in payload


def test_field_path():
    assert field_path(("body", "history_sids", 3, 1)) == "history_sids[3][1]"
    assert field_path(("body",)) is None
    assert field_path(("body", "timing", "queue_ms")) == "timing.queue_ms"


# ----------------------------------------------------------------------------------------------------------
# catalog reload
# ----------------------------------------------------------------------------------------------------------
ADMIN = {"Authorization": "Bearer adm"}


def _reload_client(engine, catalog_dir, metrics=None) -> TestClient:
    """A retrieval app with catalog reload on: an admin key and a catalog directory."""
    app = create_app(engine, ServerConfig(max_prompt_tokens=30, max_top_n=12), metrics,
                     EdgeConfig(admin_api_key="adm"), CatalogReloadConfig(catalog_dir=str(catalog_dir)))
    return TestClient(app, raise_server_exceptions=False, headers=ADMIN)


@pytest.mark.parametrize("ext", [".jsonl", ".csv", ".grcat"])
def test_catalog_reload(engine, tmp_path, ext):
    client = _reload_client(engine, tmp_path)
    new = generate_catalog(150, DEPTH, CODEBOOK, 7, OFFSET)
    save_catalog(new, tmp_path / f"new{ext}")
    old_item = int(engine.catalogs.current().item_ids[0])
    r = client.post("/v1/catalog", json={"name": f"new{ext}"})
    assert r.status_code == 200, r.text
    assert r.json() == {"previous_version": 1, "catalog": {"num_items": 150, "version": 2, "depth": DEPTH,
                                                           "codebook_sizes": [CODEBOOK] * DEPTH}}
    assert client.get("/health").json()["catalog"]["version"] == 2
    body = client.post("/v1/recommend", json={"history_tokens": [1], "top_n": 1}).json()
    assert body["catalog_version"] == 2 and body["items"][0]["item_id"] == int(new.item_ids[0])
    assert old_item is not None


def test_catalog_reload_bad_files_keep_old_catalog(engine, tmp_path):
    client = _reload_client(engine, tmp_path)
    before = client.get("/health").json()["catalog"]
    (tmp_path / "bad.jsonl").write_text('{"item_id": 1, "sid": [0, 0, 0]}\n{"item_id": 2, "sid": [0, 0, 0]}\n')
    err = _err(client.post("/v1/catalog", json={"name": "bad.jsonl"}), 400, "name", "catalog_load_failed")
    assert "line 2" in err["message"] and "duplicate SID" in err["message"]

    (tmp_path / "garbage.jsonl").write_text("this is not json\n")
    assert "line 1" in _err(client.post("/v1/catalog", json={"name": "garbage.jsonl"}), 400, "name")["message"]

    (tmp_path / "wide.jsonl").write_text('{"codebook_sizes": [8, 8, 8]}\n{"item_id": 1, "sid": [0, 0, 9]}\n')
    assert "code 9" in _err(client.post("/v1/catalog", json={"name": "wide.jsonl"}), 400, "name",
                            "catalog_load_failed")["message"]
    # no declared layout: sizes inferred as (1, 1, 10), not the served one
    (tmp_path / "inferred.jsonl").write_text('{"item_id": 1, "sid": [0, 0, 9]}\n')
    err = _err(client.post("/v1/catalog", json={"name": "inferred.jsonl"}), 400, "name", "catalog_incompatible")
    assert "[1, 1, 10]" in err["message"] and "[8, 8, 8]" in err["message"]

    save_catalog(generate_catalog(50, 4, CODEBOOK, 0, OFFSET), tmp_path / "deep.grcat")
    _err(client.post("/v1/catalog", json={"name": "deep.grcat"}), 400, "name")

    _err(client.post("/v1/catalog", json={"name": "missing.jsonl"}), 404, "name", "catalog_not_found")
    _err(client.post("/v1/catalog", json={"name": "x.parquet"}), 400, "name", "invalid_catalog_name")
    (tmp_path / "adir.jsonl").mkdir()
    _err(client.post("/v1/catalog", json={"name": "adir.jsonl"}), 400, "name", "not_a_regular_file")
    _err(client.post("/v1/catalog", json={}), 422, "name", "missing")
    _err(client.post("/v1/catalog", json={"name": 3}), 422, "name", "string_type")
    _err(client.post("/v1/catalog", json={"name": "a.jsonl", "path": "/etc/passwd"}), 422, "path", "extra_forbidden")

    assert client.get("/health").json()["catalog"] == before
    ids = [int(x) for x in engine.catalogs.current().item_ids[:3]]
    r = client.post("/v1/recommend", json={"history_items": ids, "top_n": 2})
    assert r.status_code == 200 and r.json()["catalog_version"] == before["version"]


def test_catalog_reload_vocab_too_small(catalog, tmp_path):
    eng = FakeEngine(catalog, vocab_size=40)  # exactly the SID range
    client = _reload_client(eng, tmp_path)
    save_catalog(generate_catalog(50, DEPTH, CODEBOOK, 1, OFFSET), tmp_path / "big.jsonl")
    assert client.post("/v1/catalog", json={"name": "big.jsonl"}).status_code == 200  # same layout fits
    err = _err(client.post("/v1/recommend", json={"history_tokens": [40]}), 400, "history_tokens[0]")
    assert "[0, 40)" in err["message"]


def test_in_flight_conversion_uses_one_snapshot(client, engine, catalog, tmp_path):
    """A request converted against catalog v1 is answered by the engine even if v2 lands meanwhile."""
    path = tmp_path / "v2.jsonl"
    save_catalog(generate_catalog(100, DEPTH, CODEBOOK, 3, OFFSET), path)
    ids = [int(catalog.item_ids[0])]
    seen = {}
    real = engine.submit

    def swap_then_answer(req):
        seen["tokens"] = req.prompt_tokens.tolist()
        engine.catalogs.load(path)  # the swap happens while this request is in flight
        return real(req)

    engine.submit = swap_then_answer
    r = client.post("/v1/recommend", json={"history_items": ids, "top_n": 1})
    assert r.status_code == 200 and r.json()["catalog_version"] == 2
    assert seen["tokens"] == catalog.layout.sids_to_tokens(catalog.sids_of_items(np.array(ids))).tolist()


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------
def test_cli_serve_help(capsys):
    assert cli_main(["serve", "retrieval", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--catalog", "--num-items", "--codebook-size", "--depth", "--device", "--dtype",
                 "--beam-width", "--token-capacity", "--slo-ms", "--host", "--port", "--seed"):
        assert flag in out, flag
    assert "default: tiny" in out and "default: 8000" in out


def test_cli_top_level_help(capsys):
    assert cli_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "catalog" in out and "bench" in out
    assert cli_main(["catalog", "generate", "--help"]) == 0
    assert cli_main([]) == 2  # no command: help on stderr


@pytest.mark.parametrize("ext", [".jsonl", ".csv", ".grcat"])
def test_cli_catalog_generate_validate_roundtrip(tmp_path, capsys, ext):
    out = tmp_path / f"cat{ext}"
    assert cli_main(["catalog", "generate", "--out", str(out), "--num-items", "300", "--depth", "2",
                     "--codebook-size", "32", "--seed", "4"]) == 0
    assert out.exists()
    capsys.readouterr()
    assert cli_main(["catalog", "validate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "300 items" in text and "depth 2" in text and "[32, 32]" in text


def test_cli_catalog_validate_bad(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("item_id,sid\n1,0-0\n2,x-1\n")
    assert cli_main(["catalog", "validate", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "line 3" in err and "Traceback" not in err
    assert cli_main(["catalog", "validate", str(tmp_path / "none.jsonl")]) == 1


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "abc"],
    ["serve", "--port", "70000"],
    ["serve", "--beam-width", "0"],
    ["serve", "--dtype", "int8"],
    ["serve", "--device", "tpu"],
    ["serve", "--model", "no-such-preset"],
    ["serve", "--catalog", "/definitely/not/here.jsonl"],
    ["serve", "--num-items", "100", "--codebook-size", "4", "--depth", "3"],
    ["serve", "--bogus"],
    ["catalog", "generate"],
    ["catalog", "generate", "--out", "x.parquet"],
    ["catalog", "generate", "--out", "/no/such/dir/x.jsonl"],
    ["catalog", "generate", "--out", "x.jsonl", "--num-items", "1000", "--codebook-size", "4", "--depth", "2"],
    ["catalog", "validate"],
    ["frobnicate"],
])
def test_cli_bad_args_exit_2(argv, capsys):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


def test_cli_one_line_errors(capsys):
    assert cli_main(["serve", "--model", "no-such-preset"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert cli_main(["serve", "--catalog", "/nope.csv"]) == 2
    assert capsys.readouterr().err.strip() == "grserve: error: catalog file not found: /nope.csv"


def test_cli_bench_builds_the_bench_config(monkeypatch):
    """`grserve bench retrieval FLAGS` hands the bench's run() its config built from the flags (was: argv forwarded)."""
    import grserve_bench.retrieval as bench

    seen = {}
    monkeypatch.setattr(bench, "run", lambda cfg: seen.setdefault("cfg", cfg) and 0)
    assert cli_main(["bench", "retrieval", "--batch", "8", "--beam-widths", "4,8"]) == 0
    assert seen["cfg"] == bench.RetrievalBenchConfig(batch=8, beam_widths="4,8")
    assert cli_main(["bench", "retrieval", "--batch", "8", "--help"]) == 0


def test_serve_until_exit_stops_the_engine_and_passes_uvicorns_exit_code(monkeypatch):
    """The one run-and-stop used by `grserve serve`, `serve ranking` and `serve llm`: uvicorn exits 1 when it
    cannot bind; the engine is stopped either way."""
    from grserve.server.launch import serving as core
    from grserve.server.launch.serving import serve_until_exit

    stopped = []

    def cannot_bind(app, host, port, log_level, stop, shutdown_timeout_s):
        raise SystemExit(1)

    monkeypatch.setattr(core, "run_uvicorn", cannot_bind)
    assert serve_until_exit(None, "127.0.0.1", 1, "info", lambda: stopped.append(1)) == 1
    monkeypatch.setattr(core, "run_uvicorn", lambda app, host, port, log_level, stop, timeout: None)
    assert serve_until_exit(None, "127.0.0.1", 1, "info", lambda: stopped.append(2)) == 0
    assert stopped == [1, 2]


def test_cli_serve_builds_and_runs(monkeypatch, capsys, tmp_path):
    """serve (the engine on a thread) wires config → engine.build(on_batch=metrics.on_batch) → create_app → uvicorn,
    then stops."""
    from grserve.server.launch import serving as core

    built = {}

    class Recorder(FakeEngine):
        @classmethod
        def build(cls, cfg, on_batch=None):
            eng = super().build(cfg, on_batch)
            built.update(cfg=cfg, engine=eng, on_batch=on_batch)
            return eng

    fake_mod = types.ModuleType("grserve.engine.retrieval_engine")
    fake_mod.RetrievalEngine = Recorder
    fake_mod.EngineOverloaded = EngineOverloaded
    monkeypatch.setitem(sys.modules, "grserve.engine.retrieval_engine", fake_mod)
    ran = {}

    def fake_run(app, host, port, log_level, stop, shutdown_timeout_s):
        ran.update(app=app, host=host, port=port)
        client = TestClient(app)
        assert client.get("/health").status_code == 200
        assert client.post("/v1/recommend", json={"history_tokens": [1], "top_n": 1}).status_code == 200

    monkeypatch.setattr(core, "run_uvicorn", fake_run)
    cat = tmp_path / "c.grcat"
    save_catalog(generate_catalog(N_ITEMS, DEPTH, CODEBOOK, 0, OFFSET), cat)
    assert cli_main(["serve", "--port", "9123", "--beam-width", "600", "--slo-ms", "50", "--catalog", str(cat),
                     "--seed", "3", "--token-capacity", "1024", "--no-engine-process"]) == 0  # the wiring in one
    cfg = built["cfg"]                                                                      # process (engine_core: its own tests)
    assert cfg.server.port == 9123 and cfg.search.beam_width == 600 and cfg.search.max_beam_width == 600
    assert cfg.scheduler.slo_ms == 50 and cfg.scheduler.token_capacity == 1024
    assert cfg.catalog.path == str(cat) and cfg.model.seed == 3 and cfg.model.source == "tiny"
    assert built["on_batch"] is not None and getattr(built["on_batch"], "__self__", None).__class__ is Metrics
    assert ran["port"] == 9123 and built["engine"].started and built["engine"].stopped
    out = capsys.readouterr().out
    assert "tiny" in out and f"{N_ITEMS:,} items" in out and "http://127.0.0.1:9123" in out


# ----------------------------------------------------------------------------------------------------------
# the real engine behind the app (small catalog, preset "tiny")
# ----------------------------------------------------------------------------------------------------------
def test_real_engine_end_to_end(tmp_path):
    engine_mod = pytest.importorskip("grserve.engine.retrieval_engine")
    from grserve.config import CatalogConfig, ServeConfig

    cfg = ServeConfig(catalog=CatalogConfig(num_items=500, depth=3, codebook_size=16),
                      search=SearchConfig(beam_width=16), scheduler=SchedulerConfig(slo_ms=20))
    metrics = Metrics()
    engine = engine_mod.RetrievalEngine.build(cfg, on_batch=metrics.on_batch)
    engine.start()
    try:
        client = TestClient(create_app(engine, cfg.server, metrics, EdgeConfig(admin_api_key="adm"),
                                       CatalogReloadConfig(catalog_dir=str(tmp_path))),
                            raise_server_exceptions=False, headers=ADMIN)
        cat = engine.catalogs.current()
        ids = [int(x) for x in cat.item_ids[:4]]
        sids = cat.sids_of_items(np.array(ids)).tolist()
        bodies = [{"history_items": ids}, {"history_sids": sids},
                  {"history_tokens": cat.layout.sids_to_tokens(np.array(sids)).tolist()}]
        answers = []
        for body in bodies:
            r = client.post("/v1/recommend", json=body | {"top_n": 5})
            assert r.status_code == 200, r.text
            out = r.json()
            assert len(out["items"]) == 5 and out["beam_width"] == 16 and out["catalog_version"] == 1
            for it in out["items"]:  # every answer is a catalog item with its own SID
                assert cat.sids_of_items(np.array([it["item_id"]]))[0].tolist() == it["sid"]
            scores = [it["score"] for it in out["items"]]
            assert scores == sorted(scores, reverse=True)
            answers.append([it["item_id"] for it in out["items"]])
        assert answers[0] == answers[1] == answers[2]  # three spellings of the same history
        _err(client.post("/v1/recommend", json={"history_sids": [[0, 16, 0]]}), 400, "history_sids[0][1]")
        _err(client.post("/v1/recommend", json={"history_tokens": [engine.vocab_size]}), 400, "history_tokens[0]")

        path = tmp_path / "v2.grcat"
        save_catalog(generate_catalog(300, 3, 16, 9), path)
        assert client.post("/v1/catalog", json={"name": path.name}).json()["catalog"]["version"] == 2
        r = client.post("/v1/recommend", json={"history_tokens": [1, 2, 3], "top_n": 3})
        assert r.status_code == 200 and r.json()["catalog_version"] == 2
        # the batch metrics are recorded after the batch's futures resolve: the last one may land just after its answer
        deadline = time.monotonic() + 10
        while "grserve_batch_size_count 4.0" not in (text := client.get("/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "grserve_batch_size_count 4.0" in text
    finally:
        engine.stop()


def test_catalog_file_scores_the_same_at_start_up_and_after_reload(tmp_path):
    """One loader for both paths: a catalog file served from start-up and the same file hot-reloaded answer a
    request identically; a file whose inferred layout is not the served one is refused, not silently re-laid."""
    engine_mod = pytest.importorskip("grserve.engine.retrieval_engine")
    from grserve.config import CatalogConfig, ServeConfig

    declared = tmp_path / "declared.jsonl"  # save_catalog writes the layout line: codebook_sizes [16, 16, 16]
    save_catalog(generate_catalog(300, 3, 16, 9), declared)
    small = Catalog.from_arrays(np.arange(40), np.random.default_rng(0).permutation(512)[:40, None] // [64, 8, 1] % 8)
    inferred = tmp_path / "inferred.jsonl"  # no layout line: codes < 8, so sizes are inferred as [8, 8, 8]
    inferred.write_text("".join(f'{{"item_id": {i}, "sid": {s}}}\n' for i, s in
                                zip(small.item_ids.tolist(), small.sids.tolist())))

    def serve(path):
        cfg = ServeConfig(catalog=CatalogConfig(path=path, num_items=500, depth=3, codebook_size=16),
                          search=SearchConfig(beam_width=8), scheduler=SchedulerConfig(slo_ms=5))
        engine = engine_mod.RetrievalEngine.build(cfg).start()
        app = create_app(engine, cfg.server, None, EdgeConfig(admin_api_key="adm"),
                         CatalogReloadConfig(catalog_dir=str(tmp_path)))
        return engine, TestClient(app, raise_server_exceptions=False, headers=ADMIN)

    def ask(client, items):
        r = client.post("/v1/recommend", json={"history_items": items, "top_n": 5})
        assert r.status_code == 200, r.text
        return [(it["item_id"], it["score"]) for it in r.json()["items"]]

    for path, items in ((declared, [3, 17, 42]), (inferred, [1, 2, 3])):
        at_start, start_client = serve(str(path))
        generated, reload_client = serve(None)
        try:
            layout = at_start.catalogs.current().layout
            r = reload_client.post("/v1/catalog", json={"name": path.name})
            if layout == generated.catalogs.current().layout:
                assert r.status_code == 200, r.text
                assert ask(reload_client, items) == ask(start_client, items)
            else:  # the inferred [8, 8, 8] is not the served [16, 16, 16]: refused, the old catalog serves on
                _err(r, 400, "name", "catalog_incompatible")
                before = ask(start_client, items)
                assert start_client.post("/v1/catalog", json={"name": path.name}).status_code == 200
                assert ask(start_client, items) == before
        finally:
            at_start.stop()
            generated.stop()
