"""Issue 14, the API edge (findings 2, 3, 7): every reproduction of the issue is a test here.

Authentication and admin routes on the three servers, the request-body limit, bounded admission (429), the queue
deadline (dropped uncomputed, 503), the draining SIGTERM shutdown, ranking registration limits and identifier
collisions, and ``exclude_items`` masked inside the beam search (= a search over the catalog without them).
Catalog reload by name has its own file (``test_catalog_reload.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from grserve.catalog import Catalog, CatalogStore, generate_catalog
from grserve.config import (
    EdgeConfig,
    RankingConfig,
    RankingLimits,
    SchedulerConfig,
    SearchConfig,
    ServerConfig,
)
from grserve.engine.batching import BatchingCore
from grserve.engine.protocol import EngineHealth, RequestHandle, RequestTimedOut
from grserve.engine.types import RetrievalRequest, RetrievalResult
from grserve.server.http.edge import EdgeMiddleware
from grserve.server.http.errors import house_error
from grserve.server.retrieval.app import create_app

KEY, ADMIN_KEY = "k-123", "adm-456"
BEARER, ADMIN = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}


# ----------------------------------------------------------------------------------------------------------
# small engines
# ----------------------------------------------------------------------------------------------------------
class HangingEngine:
    """The Engine protocol with RetrievalEngine's extras; every request waits until ``release()`` or ``stop()``
    (which fails the rest with ``EngineStopped``, as a real engine does)."""

    def __init__(self) -> None:
        self.catalogs = CatalogStore(generate_catalog(100, 3, 8, 0, 16), vocab_size=64)
        self.vocab_size = 64
        self.search = SearchConfig(beam_width=8, max_beam_width=16)
        self.handles: list[RequestHandle] = []
        self.status = "ok"
        self.drained_for: float | None = None

    def start(self):
        return self

    def submit(self, req):
        from grserve.engine.protocol import EngineStopped

        if self.status != "ok":
            raise EngineStopped(self.status)
        h: RequestHandle = RequestHandle(req.request_id, self.cancel)
        self.handles.append(h)
        return h

    def cancel(self, request_id: str) -> bool:
        return True

    def drain(self, timeout_s=None) -> bool:
        self.status, self.drained_for = "draining", timeout_s
        time.sleep(timeout_s or 0)
        return False

    def stop(self) -> None:
        from grserve.engine.protocol import EngineStopped

        self.status = "stopped"
        for h in self.handles:
            if not h.future.done():
                h.future.set_exception(EngineStopped("engine stopped"))

    def health(self) -> EngineHealth:
        return EngineHealth(self.status, 0, 0)  # type: ignore[arg-type]

    def stats(self) -> dict:
        return {}

    @property
    def queue_depth(self) -> int:
        return 0


def _retrieval_client(edge: EdgeConfig, engine=None) -> TestClient:
    return TestClient(create_app(engine or HangingEngine(), ServerConfig(), edge=edge), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def ranking_engine(tiny_model):
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.ranking.registry import synthetic_registry

    model = tiny_model(seed=4)  # the model test_ranking_api loads (cached per session)
    reg = synthetic_registry(model.spec.vocab_size, 20, (3, 5), [10, 12], seed=1)
    eng = RankingEngine(RankingRunner(model, reg, RankingConfig(policy="bat", user_cache_bytes=1 << 20))).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A small LLM engine (random weights) and its app factory; the engine is not started (requests queue)."""
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.llm import build_model_engine
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.model import ModelSpec
    from grserve.model.decoder import Decoder
    from grserve.model.loader import _random_init
    from grserve.scheduler.fcfs import FCFSScheduler
    from grserve.server.llm.app import create_llm_app

    spec = ModelSpec(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=256)
    model = Decoder(spec)
    _random_init(model, 0)
    tok = load_tokenizer("preset", spec.vocab_size, spec.max_position_embeddings,
                         tmp_path_factory.mktemp("tok"))

    def build(edge: EdgeConfig):
        core = build_model_engine(model, FCFSScheduler(), num_blocks=64, block_size=8, eos_token_id=None,
                                  detokenize=tok.decode)
        eng = AsyncLLMEngine(core, tok, model, edge)
        app = create_llm_app(eng, tok, "m", spec.max_position_embeddings, spec.vocab_size, edge=edge)
        return eng, TestClient(app, raise_server_exceptions=False)

    return build


# ----------------------------------------------------------------------------------------------------------
# finding 2: authentication; state-changing routes need the admin key and are off without it
# ----------------------------------------------------------------------------------------------------------
def test_api_key_on_the_retrieval_server():
    client = _retrieval_client(EdgeConfig(api_key=KEY), HangingEngine())
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        r = client.post("/v1/recommend", json={"history_tokens": [1]}, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"]["type"] == "invalid_api_key" and set(r.json()["error"]) == {"message", "field",
                                                                                              "type"}
    assert client.get("/no/such/route").status_code == 401  # routes are not revealed without the key
    assert client.get("/openapi.json").status_code == 401
    assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200  # open
    r = client.post("/v1/recommend", json={"history_tokens": [1], "beam_width": 0}, headers=BEARER)
    assert r.status_code == 400  # past the edge: the route's own validation


def test_admin_routes_are_off_without_an_admin_key_and_need_it(tmp_path):
    off = _retrieval_client(EdgeConfig(api_key=KEY))
    for headers in ({}, BEARER):
        r = off.post("/v1/catalog", json={"name": "x.jsonl"}, headers=headers)
        assert r.status_code == 403 and r.json()["error"]["type"] == "admin_disabled"
    on = _retrieval_client(EdgeConfig(api_key=KEY, admin_api_key=ADMIN_KEY))
    assert on.post("/v1/catalog", json={"name": "x.jsonl"}).status_code == 401
    assert on.post("/v1/catalog", json={"name": "x.jsonl"}, headers={"Authorization": "Bearer no"}).status_code == 401
    r = on.post("/v1/catalog", json={"name": "x.jsonl"}, headers=BEARER)
    assert r.status_code == 403 and r.json()["error"]["type"] == "admin_key_required"
    r = on.post("/v1/catalog", json={"name": "x.jsonl"}, headers=ADMIN)
    assert r.status_code == 403 and r.json()["error"]["type"] == "reload_disabled"  # past the edge: no --catalog-dir
    assert on.get("/health", headers=ADMIN).status_code == 200


def test_ranking_registration_needs_the_admin_key(ranking_engine):
    from grserve.server.ranking.app import create_ranking_app

    users = {"users": [{"user_id": 500, "tokens": [20, 21]}]}
    items = {"items": [{"item_id": 500, "tokens": [20, 21, 22]}]}
    open_app = TestClient(create_ranking_app(ranking_engine), raise_server_exceptions=False)
    for path, body in (("/v1/users", users), ("/v1/items", items)):
        assert open_app.post(path, json=body).json()["error"]["type"] == "admin_disabled"
    keyed = TestClient(create_ranking_app(ranking_engine, edge=EdgeConfig(api_key=KEY, admin_api_key=ADMIN_KEY)),
                       raise_server_exceptions=False)
    assert keyed.post("/v1/users", json=users, headers=BEARER).status_code == 403
    assert keyed.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1]}).status_code == 401
    assert keyed.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1]}, headers=BEARER).status_code == 200
    assert keyed.post("/v1/users", json=users, headers=ADMIN).status_code == 200
    assert ranking_engine.registry.has_user(500) and not ranking_engine.registry.has_item(500)


def test_api_key_on_the_llm_server_in_openai_shape(llm):
    _, client = llm(EdgeConfig(api_key=KEY))
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions", "/nowhere"):
        r = client.post(path, json={}) if "completions" in path else client.get(path)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err == {"message": err["message"], "type": "invalid_request_error", "param": None,
                       "code": "invalid_api_key"}
    assert client.get("/v1/models", headers=BEARER).status_code == 200
    assert client.get("/health").status_code in (200, 503) and client.get("/metrics").status_code == 200


def test_keys_come_from_the_environment_and_are_checked():
    import argparse

    from grserve.flags import ConfigError
    from grserve.server.launch.startup import add_edge_flags, edge_from_args

    p = argparse.ArgumentParser()
    add_edge_flags(p, "POST /v1/catalog")
    env = {"GRSERVE_API_KEY": "from-env", "GRSERVE_ADMIN_API_KEY": "adm-env"}
    assert edge_from_args(p.parse_args([]), env) == EdgeConfig(api_key="from-env", admin_api_key="adm-env")
    assert edge_from_args(p.parse_args(["--api-key", "flag"]), env).api_key == "flag"  # the flag wins
    assert edge_from_args(p.parse_args([]), {}) == EdgeConfig()
    from grserve.flags import UsageError

    with pytest.raises(UsageError, match=r"\$GRSERVE_API_KEY"):  # set but empty: fail closed
        edge_from_args(p.parse_args([]), {"GRSERVE_API_KEY": ""})
    for bad in ("", " k", "k\n"):
        with pytest.raises(ConfigError, match="--api-key"):
            EdgeConfig(api_key=bad)


# ----------------------------------------------------------------------------------------------------------
# finding 3 (+4's 20 MB body): the request-body limit, checked while the body streams in
# ----------------------------------------------------------------------------------------------------------
def test_a_20_mb_body_is_413_on_every_server(llm, ranking_engine):
    from grserve.server.ranking.app import create_ranking_app

    big = b'{"history_tokens": [' + b"1," * (10 << 20) + b"1]}"
    edge = EdgeConfig(max_body_bytes=1 << 20)
    _, llm_client = llm(edge)
    clients = {"/v1/recommend": _retrieval_client(edge),
               "/v1/rank": TestClient(create_ranking_app(ranking_engine, edge=edge), raise_server_exceptions=False),
               "/v1/chat/completions": llm_client}
    for path, client in clients.items():
        r = client.post(path, content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, (path, r.text)
        kind = r.json()["error"].get("code") or r.json()["error"]["type"]
        assert kind == "body_too_large"


def test_a_chunked_body_is_cut_off_at_the_limit_without_reading_the_rest():
    """No Content-Length: the middleware counts while receiving and answers 413 after the chunk that crosses the
    limit; the rest of the body is never read and the app never runs."""
    reached = []

    async def app(scope, receive, send):  # pragma: no cover - must not be reached
        reached.append(scope)

    mw = EdgeMiddleware(app, EdgeConfig(max_body_bytes=1000), house_error)
    chunks = [{"type": "http.request", "body": b"x" * 300, "more_body": True} for _ in range(100)]
    read, sent = [], []

    async def receive():
        read.append(1)
        return chunks[len(read) - 1]

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/recommend", "headers": []}
    asyncio.run(mw(scope, receive, send))
    assert not reached and len(read) == 4  # 4 x 300 > 1000
    assert sent[0]["status"] == 413


# ----------------------------------------------------------------------------------------------------------
# finding 3: bounded admission (429), queue deadline (dropped uncomputed), everywhere
# ----------------------------------------------------------------------------------------------------------
def test_batching_core_bounds_the_queue_and_drops_expired_requests_uncomputed():
    from grserve.engine.protocol import EngineOverloaded

    gate, executed = threading.Event(), []

    def execute(batch):
        executed.extend(r.request_id for r in batch)
        gate.wait(5)
        return [r.request_id for r in batch]

    core = BatchingCore(execute, SchedulerConfig(max_batch_requests=1, max_inflight_batches=1), "t",
                        max_waiting=3, request_timeout_s=0.1)
    core.start()
    try:
        cancel = lambda rid: core.cancel(rid)  # noqa: E731
        first = core.submit(RetrievalRequest(np.arange(4), 4, 1, request_id="first"), cancel)
        while not executed:
            time.sleep(0.005)
        queued = [core.submit(RetrievalRequest(np.arange(4), 4, 1, request_id=f"q{i}"), cancel) for i in range(3)]
        with pytest.raises(EngineOverloaded, match="max_waiting=3"):
            core.submit(RetrievalRequest(np.arange(4), 4, 1), cancel)
        for h in queued:  # answered at their deadline, while the executor is still busy
            with pytest.raises(RequestTimedOut):
                h.future.result(timeout=2)
        gate.set()
        assert first.future.result(timeout=5) == "first"
        late = core.submit(RetrievalRequest(np.arange(4), 4, 1, request_id="late"), cancel)
        assert late.future.result(timeout=5) == "late"
    finally:
        gate.set()
        core.stop()
    assert executed == ["first", "late"] and core.requests_expired == 3  # the expired ones never ran


def test_llm_engine_queue_is_bounded_and_expires(llm):
    eng, client = llm(EdgeConfig(max_waiting=2, request_timeout=0.05))
    eng._status = "ok"  # accepting, but no engine thread: requests stay queued (deterministic)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    handles = [eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2))) for _ in range(2)]
    r = client.post("/v1/completions", json=body)  # the issue: 1,500 requests, no 429 ever
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["code"] == "overloaded"
    time.sleep(0.1)
    eng._expire()
    for h in handles:
        with pytest.raises(RequestTimedOut):
            h.future.result(timeout=1)
    assert not eng.core.waiting and eng.core.iterations == 0 and eng.requests_expired == 2  # nothing computed
    eng._status = "stopped"


def test_queue_timeout_and_overload_answers(llm):
    """A request dropped at its deadline is a 503 ``queue_timeout`` with Retry-After (OpenAI shape on the LLM
    server), never a 200; the LLM engine thread drops it itself."""
    eng, client = llm(EdgeConfig(request_timeout=0.05))
    eng._status = "ok"  # accepting, no engine thread yet
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    h = eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    time.sleep(0.08)
    eng._status = "stopped"
    eng.start()  # the loop expires it before its first step
    try:
        with pytest.raises(RequestTimedOut):
            h.future.result(timeout=5)
        r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200, r.text  # a fresh request is served
    finally:
        eng.stop()


def test_burst_past_capacity_is_429_never_5xx(tiny_model):
    """300 concurrent requests against max_waiting 8: every answer is a 200 or a 429, the queue never holds more
    than 8, and the server serves afterwards."""
    from grserve.engine.retrieval_engine import RetrievalEngine

    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(generate_catalog(300, 3, 8, 1), vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=4), SchedulerConfig(max_batch_requests=4),
                          edge=EdgeConfig(max_waiting=8)).start()
    app = create_app(eng, ServerConfig(), edge=EdgeConfig(max_waiting=8))
    depth = []

    async def burst():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            async def one(i):
                depth.append(eng.queue_depth)
                r = await c.post("/v1/recommend", json={"history_tokens": [20 + i % 50, 30], "top_n": 2})
                return r.status_code, r.headers.get("retry-after")
            return await asyncio.gather(*(one(i) for i in range(300)))

    try:
        answers = asyncio.run(burst())
        after = TestClient(app).post("/v1/recommend", json={"history_tokens": [21, 30], "top_n": 2})
    finally:
        eng.stop()
    codes = [a[0] for a in answers]
    assert set(codes) <= {200, 429} and codes.count(429) > 0 and codes.count(200) >= 8, codes
    assert all(ra == "1" for code, ra in answers if code == 429) and max(depth) <= 8
    assert after.status_code == 200


# ----------------------------------------------------------------------------------------------------------
# finding 3: SIGTERM drains, then ends what is left with a clean error
# ----------------------------------------------------------------------------------------------------------
def test_shutdown_drains_then_answers_503_stopped(tmp_path, monkeypatch):
    """SIGTERM: stop accepting, drain for --shutdown-timeout, then the waiting client gets a clean 503 — and a
    catalog reload stuck in its parse does not keep the server from stopping (the issue: SIGTERM could not)."""
    import uvicorn

    from grserve.config import CatalogReloadConfig
    from grserve.server.retrieval import catalog_reload
    from grserve.server.launch import serving as core

    monkeypatch.setattr(core, "SHUTDOWN_GRACE_S", 0.5)
    stuck = threading.Event()
    monkeypatch.setattr(catalog_reload, "load_for_serving", lambda *a, **k: stuck.wait(30))
    engine = HangingEngine()
    app = create_app(engine, ServerConfig(), edge=EdgeConfig(shutdown_timeout=0.3, admin_api_key=ADMIN_KEY),
                     reload=CatalogReloadConfig(catalog_dir=str(tmp_path)))
    port = 18231
    server = core.draining_server(app, uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"),
                                  engine.stop, 0.3)
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    answer = {}

    def ask():
        r = httpx.post(f"http://127.0.0.1:{port}/v1/recommend", json={"history_tokens": [1], "top_n": 2},
                       timeout=10)
        answer.update(status=r.status_code, body=r.json(), retry=r.headers.get("retry-after"))

    def reload():
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/catalog", json={"name": "x.jsonl"}, headers=ADMIN, timeout=10)
        except httpx.HTTPError:
            pass  # the server cancels it when it stops

    clients = [threading.Thread(target=ask), threading.Thread(target=reload)]
    for c in clients:
        c.start()
    for _ in range(500):
        if engine.handles and app.state.reloader._slot.locked():
            break
        time.sleep(0.01)
    assert engine.handles and app.state.reloader._slot.locked(), answer
    t0 = time.perf_counter()
    server.should_exit = True  # what uvicorn's SIGTERM handler does
    th.join(10)
    for c in clients:
        c.join(10)
    stuck.set()
    assert not th.is_alive() and time.perf_counter() - t0 < 5
    assert engine.drained_for == 0.3
    assert answer["status"] == 503 and answer["body"]["error"]["type"] == "stopped" and answer["retry"] == "1"


def test_a_client_that_leaves_while_queued_is_never_computed():
    """Abandoned requests are not computed: the client disconnects while its request waits behind a running batch;
    it leaves the queue and the executor never sees it."""
    gate, executed = threading.Event(), []

    def execute(batch):
        executed.extend(r.request_id for r in batch)
        gate.wait(5)
        return [RetrievalResult(r.request_id, []) for r in batch]

    engine = HangingEngine()
    batching = BatchingCore(execute, SchedulerConfig(max_batch_requests=1, max_inflight_batches=1), "t")
    engine.submit = lambda req: batching.submit(req, batching.cancel)
    engine.cancel = batching.cancel
    batching.start()
    app = create_app(engine, ServerConfig())
    try:
        batching.submit(RetrievalRequest(np.arange(4), 4, 1, request_id="running"), batching.cancel)
        while not executed:
            time.sleep(0.005)
        sent = []

        async def call():
            messages = [{"type": "http.request", "body": b'{"history_tokens": [1], "top_n": 2, "request_id": "gone"}',
                         "more_body": False}]

            async def receive():
                if messages:
                    return messages.pop()
                while batching.queue_depth == 0:  # leave once the request is queued
                    await asyncio.sleep(0.005)
                return {"type": "http.disconnect"}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/recommend", "raw_path": b"/v1/recommend",
                     "query_string": b"", "headers": [(b"content-type", b"application/json")],
                     "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
            await app(scope, receive, send)

        asyncio.run(call())
        assert batching.queue_depth == 0
        gate.set()
        time.sleep(0.1)
    finally:
        gate.set()
        batching.stop()
    assert executed == ["running"] and sent[0]["status"] == 499


# ----------------------------------------------------------------------------------------------------------
# finding 7: ranking registration limits and identifier collisions
# ----------------------------------------------------------------------------------------------------------
def test_ranking_limits_and_identifier_collisions(ranking_engine):
    from grserve.server.ranking.app import create_ranking_app

    reg = ranking_engine.registry
    limits = RankingLimits(max_users=reg.num_users + 1, max_items=reg.num_items + 2)
    client = TestClient(create_ranking_app(ranking_engine, limits, edge=EdgeConfig(admin_api_key=ADMIN_KEY)),
                        raise_server_exceptions=False, headers=ADMIN)
    n_items = reg.num_items
    taken = reg.identifier(0)
    # the issue: an item whose identifier token is another's was accepted, and both then scored 0.5/0.5
    r = client.post("/v1/items", json={"items": [{"item_id": 900, "tokens": [20, 21, taken]}]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "identifier_collision", r.text
    assert r.json()["error"]["field"] == "items[0].tokens" and "item 0" in r.json()["error"]["message"]
    r = client.post("/v1/items", json={"items": [{"item_id": 901, "tokens": [20, 30990]},
                                                 {"item_id": 902, "tokens": [21, 30990]}]})
    assert r.status_code == 409 and r.json()["error"]["field"] == "items[1].tokens"
    assert reg.num_items == n_items and not reg.has_item(901)  # all or nothing
    assert client.post("/v1/items", json={"items": [{"item_id": 0, "tokens": [20, taken]}]}).status_code == 200
    # limits: users and items past --max-users / --max-items are refused, replacements are not new
    r = client.post("/v1/items", json={"items": [{"item_id": 910 + k, "tokens": [20, 31900 + k]} for k in range(3)]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "too_many_items" and reg.num_items == n_items
    assert client.post("/v1/items", json={"items": [{"item_id": 910, "tokens": [20, 31900]}]}).status_code == 200
    r = client.post("/v1/users", json={"users": [{"user_id": 800 + k, "tokens": [20]} for k in range(2)]})
    assert r.status_code == 409 and r.json()["error"]["type"] == "too_many_users"
    # raw candidates sharing an identifier token would tie: 400
    r = client.post("/v1/rank", json={"user_id": 0, "candidate_tokens": [[20, 31000], [21, 31000]]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "identifier_collision"
    r = client.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1, 910]})
    assert r.status_code == 200 and len({it["score"] for it in r.json()["items"]}) == 3


def test_registry_refuses_identifier_collisions_at_start_up(tmp_path):
    from grserve.ranking.registry import IdentifierCollision, RankingRegistry, RegistryError

    reg = RankingRegistry(1000, [5, 6])
    reg.add_item(1, [10, 500])
    reg.add_item(1, [10, 501])  # replacing an item frees its old identifier
    reg.add_item(2, [11, 500])
    with pytest.raises(IdentifierCollision):
        reg.add_item(3, [12, 501])
    p = tmp_path / "items.jsonl"
    p.write_text('{"item_id": 7, "tokens": [1, 700]}\n{"item_id": 8, "tokens": [2, 700]}\n')
    with pytest.raises(RegistryError, match="items.jsonl:2: item 8: identifier token 700"):
        RankingRegistry(1000, [5]).load_jsonl(p, "item")


# ----------------------------------------------------------------------------------------------------------
# exclude_items: masked inside the beam search
# ----------------------------------------------------------------------------------------------------------
def test_exclude_items_equals_a_search_over_the_catalog_without_them(tiny_model):
    """Excluded items never come back, and every result (ids and scores) equals the same search over a catalog
    from which they were removed — the mask is exactly that catalog's mask, so no beam is spent on them. One
    request excludes its whole first-level branch of best items (dead inner trie nodes)."""
    from grserve.engine.retrieval import RetrievalRunner

    model = tiny_model(seed=0)
    cat = generate_catalog(300, 3, 8, seed=1, token_offset=16)
    runner = RetrievalRunner(model, SearchConfig(beam_width=16, max_beam_width=64))
    prompts = [np.random.default_rng(s).integers(16, 400, size=12) for s in range(3)]
    try:
        base = runner.run(prompts, 16, [16] * 3, cat)
        best = base.hits[2][0].sid[0]
        exclude = [np.array([h.item_id for h in base.hits[0][:6]]),
                   np.array([h.item_id for h in base.hits[1][::2]] + [10 ** 15]),  # + an unknown id: no-op
                   cat.item_ids[cat.sids[:, 0] == best]]  # a whole level-0 branch
        out = runner.run(prompts, 16, [16] * 3, cat, exclude=exclude)
        for i in range(3):
            keep = ~np.isin(cat.item_ids, exclude[i])
            smaller = Catalog.from_arrays(cat.item_ids[keep], cat.sids[keep].astype(np.int64), cat.codebook_sizes, 16)
            ref = runner.run([prompts[i]], 16, [16], smaller).hits[0]
            # the reference runs alone, the excluded run in a batch of 3: fp32 sums differ in the last bits
            assert [(h.item_id, h.sid) for h in out.hits[i]] == [(h.item_id, h.sid) for h in ref]
            np.testing.assert_allclose([h.score for h in out.hits[i]], [h.score for h in ref], rtol=0, atol=1e-5)
            assert len(ref) == 16
            assert not set(exclude[i].tolist()) & {h.item_id for h in out.hits[i]}
        everything = runner.run(prompts[:1], 16, [16], cat, exclude=[cat.item_ids])
        assert everything.hits == [[]]
    finally:
        runner.close()


def test_exclude_items_over_http(tiny_model):
    from grserve.engine.retrieval_engine import RetrievalEngine

    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(generate_catalog(300, 3, 8, 1), vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=8)).start()
    client = TestClient(create_app(eng, ServerConfig(max_exclude_items=50)), raise_server_exceptions=False)
    try:
        body = {"history_tokens": [20, 30, 40], "top_n": 8}
        first = [it["item_id"] for it in client.post("/v1/recommend", json=body).json()["items"]]
        r = client.post("/v1/recommend", json=body | {"exclude_items": first[:5] + [-1, 2 ** 70]})
        assert r.status_code == 200, r.text
        again = [it["item_id"] for it in r.json()["items"]]
        assert len(again) == 8 and not set(again) & set(first[:5])
        r = client.post("/v1/recommend", json=body | {"exclude_items": list(range(51))})
        assert r.status_code == 413 and r.json()["error"]["type"] == "too_many_excluded"
        assert client.post("/v1/recommend", json=body | {"exclude_items": ["1"]}).status_code == 422
    finally:
        eng.stop()


def test_quality_bench_excludes_seen_items_in_the_search(tiny_model, monkeypatch):
    """``grserve bench quality``'s "history excluded" row comes from the served search with ``exclude_items``:
    K items per user, none of them in the user's history (the client-side filter it replaces could return fewer)."""
    pd = pytest.importorskip("pandas")
    from grserve_bench import quality
    from grserve.movielens.split import leave_one_out

    cat = generate_catalog(200, 3, 8, seed=1, token_offset=16)
    rng = np.random.default_rng(0)
    rows = [(u, int(i), 5, t) for u in range(3) for t, i in enumerate(rng.choice(cat.item_ids, 12, replace=False))]
    split = leave_one_out(pd.DataFrame(rows, columns=["user_id", "movie_id", "rating", "timestamp"]))
    seen_rows = {}

    def record(ranked, targets, k):
        seen_rows[len(seen_rows)] = [list(r) for r in ranked]
        return 0.0

    monkeypatch.setattr(quality, "recall_at_k", record)
    monkeypatch.setattr(quality, "unconstrained_beam_search",  # not tested here
                        lambda *a: np.zeros((0, 3), dtype=np.int64))
    quality.evaluate(tiny_model(seed=0), cat, split, max_items=6, beam_width=10, k=10, batch=3, progress=False)
    excluded = seen_rows[1]  # the rows dict's order: served, served_seen_excluded, popularity, random
    for u, items in enumerate(excluded):
        history = set(split.test_history(u).tolist())
        assert len(items) == 10 and not history & set(items)
