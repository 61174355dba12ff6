"""Issue 14 review as a hostile-but-fair client: each finding of the review is reproduced here as a test."""

from __future__ import annotations

import threading
import time

from grserve.config import EdgeConfig
from test_security_limits import llm, ranking_engine  # noqa: F401 - shared fixtures


def test_streamed_request_that_expires_in_the_queue_is_a_503_not_an_empty_200(llm):  # noqa: F811
    """Leftover 1: a streamed request dropped at its queue deadline came back as a 200 stream that ended without
    a token. Its status line now waits for its first event: it is a 503 ``queue_timeout`` in OpenAI's shape."""
    eng, client = llm(EdgeConfig(request_timeout=0.05))
    eng._status = "ok"  # accepting, no engine thread: the request stays queued

    def expire_later():  # once the request is queued (a loaded machine may take long to get it there)
        deadline = time.monotonic() + 30
        while eng.queue_depth == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        eng._expire()

    t = threading.Thread(target=expire_later)
    t.start()
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True})
    t.join()
    eng._status = "stopped"
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text  # before: 200 and no token
    assert r.json()["error"]["code"] == "queue_timeout" and r.json()["error"]["type"] == "server_error"


def _asgi_call(app, method: str, path: str, headers: list, body_chunks: list[bytes]):
    """One raw ASGI request; returns (status, body, how many body messages the app asked for)."""
    import asyncio

    sent, asked = [], [0]
    chunks = list(body_chunks)

    async def receive():
        asked[0] += 1
        if chunks:
            return {"type": "http.request", "body": chunks.pop(0), "more_body": bool(chunks)}
        await asyncio.sleep(3600)  # pragma: no cover - nothing more arrives

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": headers, "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": ""}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), asked[0]


def test_a_full_queue_is_refused_at_the_edge_before_the_body_is_read(llm):  # noqa: F811
    """Leftover 2: under a burst, a 429 cost seconds (body parsed, prompt tokenized, then refused by the engine).
    With the queue at its bound the edge answers 429 before reading one byte of the body — an unparseable body
    included — and counts it under the route it targeted (leftover 4: not "unmatched")."""
    import json

    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    eng, client = llm(EdgeConfig(max_waiting=1))
    eng._status = "ok"  # accepting, no engine thread: the request stays queued
    try:
        eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2)))
        status, body, asked = _asgi_call(client.app, "POST", "/v1/chat/completions",
                                         [(b"content-type", b"application/json")], [b"{not json"])
        assert status == 429 and asked == 0, body
        err = json.loads(body)["error"]
        assert err["code"] == "overloaded" and err["type"] == "invalid_request_error"
        assert client.get("/health").status_code == 200  # open routes are not queued routes
        metrics = client.get("/metrics").text
        assert 'grserve_requests_total{route="/v1/chat/completions",status="429"} 1.0' in metrics, metrics
    finally:
        eng._status = "stopped"


def test_edge_refusals_are_counted_under_the_route_they_targeted(llm):  # noqa: F811
    eng, client = llm(EdgeConfig(api_key="k", max_body_bytes=100))
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert client.get("/v1/models/m").status_code == 401
    r = client.post("/v1/completions", headers={"Authorization": "Bearer k"}, content=b"x" * 200)
    assert r.status_code == 413
    assert client.get("/no/such/route").status_code == 401
    metrics = client.get("/metrics").text
    assert 'grserve_requests_total{route="/v1/completions",status="401"} 1.0' in metrics, metrics
    assert 'grserve_requests_total{route="/v1/completions",status="413"} 1.0' in metrics, metrics
    assert 'grserve_requests_total{route="/v1/models/{model_id:path}",status="401"} 1.0' in metrics, metrics
    assert 'grserve_requests_total{route="unmatched",status="401"} 1.0' in metrics, metrics


def test_a_failed_forward_fails_the_running_requests_only_the_queued_ones_are_served_after(llm):  # noqa: F811
    """Leftover 3: a failing step failed every request, the ones still waiting in the queue included (never
    part of the step). Now only the step's running requests fail (an error, never a normal finish)."""
    import pytest

    from grserve.engine.async_llm import EngineStepFailed
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    eng, _ = llm(EdgeConfig())
    eng.core.scheduler.max_num_seqs = 1
    eng._status = "ok"  # driven by hand, one iteration at a time
    try:
        a = eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0)))
        eng._iterate()  # a runs
        b = eng.submit(LLMRequest([4, 5, 6], SamplingParams(max_tokens=2, temperature=0.0)))
        real = eng.core.executor.execute
        eng.core.executor.execute = lambda *args, **kw: (_ for _ in ()).throw(RuntimeError("device fault"))
        eng._iterate()
        eng.core.executor.execute = real
        with pytest.raises(EngineStepFailed, match="RuntimeError"):
            a.future.result(timeout=1)
        assert eng.errors == 1 and not b.future.done()
        for _ in range(20):
            if b.future.done():
                break
            eng._iterate()
        assert b.future.result(timeout=1).finish_reason == "length"
        assert eng.core.pool.num_free == eng.core.pool.num_blocks
    finally:
        eng._status = "stopped"


def test_a_streaming_client_that_leaves_while_queued_has_its_request_cancelled(llm):  # noqa: F811
    """The stream's status line now waits for the first token: a client that disconnects in that wait must
    still have its request cancelled (it leaves the queue, nothing computed), and nothing is answered."""
    import asyncio
    import json

    eng, client = llm(EdgeConfig())
    eng._status = "ok"  # accepting, no engine thread: the request stays queued
    body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stream": True}).encode()
    sent: list[dict] = []

    async def call():
        state = {"n": 0}

        async def receive():
            state["n"] += 1
            if state["n"] == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            while not eng.queue_depth:  # the request is queued: now the client goes away
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        await asyncio.wait_for(client.app(scope, receive, send), 5)

    try:
        asyncio.run(call())
        eng._expire()  # the step loop's turn (there is no loop thread): the inbox's submit, then its cancel
        assert not eng.core.waiting and not eng._live and eng.core.iterations == 0
        starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
        assert starts in ([], [499]), starts
    finally:
        eng._status = "stopped"


# ----------------------------------------------------------------------------------------------------------
# the hostile-input pass, kept as a guard: every route of the three servers, each field replaced by absurd
# values, raw bodies that are not JSON or are nested 100k deep, wrong content types, missing and extra fields
# ----------------------------------------------------------------------------------------------------------
HOSTILE = [None, True, -1, -0.0, 1e-300, 2**80, -2**80, 2**64, 1e308, "NaN", "16", float("nan"), float("inf"), "",
           "\ud800", [], {}, [None], ["a"], [2**80], [-1], [float("nan")], [[2**80]], [["\ud800"]], [{}]]
RAW = [b"", b"{", b"[" * 100_000, b'{"a":' * 50_000, b"null", b"[]", b"1e999", b"\xff\xfe", b'"\\ud800"', b"NaN"]


def _hostile_pass(client, path: str, base: dict, headers: dict | None = None) -> list:
    """Every answer to a hostile variant of ``base``; returns the ones that are a 5xx or took over 5 s."""
    import json

    bad = []

    def send(raw: bytes, ctype: str = "application/json") -> None:
        t = time.perf_counter()
        r = client.post(path, content=raw, headers={"content-type": ctype, **(headers or {})})
        if r.status_code >= 500 or time.perf_counter() - t > 5:
            bad.append((path, r.status_code, raw[:120], r.text[:200]))

    variants = [{**base, k: v} for k in [*base, "extra_field"] for v in HOSTILE]
    variants += [{k: v for k, v in base.items() if k != drop} for drop in base]
    for body in variants:
        send(json.dumps(body, allow_nan=True).encode())
    for raw in RAW:
        send(raw)
    for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
        send(json.dumps(base).encode(), ctype)
    return bad


def test_hostile_inputs_on_every_llm_route_are_never_a_5xx(llm):  # noqa: F811
    eng, client = llm(EdgeConfig())
    eng.start()
    try:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}).status_code == 200
        bad = _hostile_pass(client, "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "top_p": 0.9,
                                                        "temperature": 0.7, "seed": 3, "logprobs": 2, "n": 1,
                                                        "logit_bias": {"5": 1.0}, "stop": ["x"]})
        bad += _hostile_pass(client, "/v1/chat/completions", {"model": "m", "max_tokens": 2, "stream": True,
                                                             "messages": [{"role": "user", "content": "hi"}]})
        bad += _hostile_pass(client, "/tokenize", {"model": "m", "prompt": "hi"})
        bad += _hostile_pass(client, "/detokenize", {"model": "m", "tokens": [1, 2]})
        for path in ("/v1/models/m", "/v1/models/%ff", "/v1/models/" + "a" * 5000, "/version"):
            r = client.get(path)
            bad += [(path, r.status_code)] if r.status_code >= 500 else []
    finally:
        eng.stop()
    assert not bad, bad


def test_hostile_inputs_on_every_retrieval_and_ranking_route_are_never_a_5xx(tiny_model, ranking_engine):  # noqa: F811
    from fastapi.testclient import TestClient

    from grserve.catalog import CatalogStore, generate_catalog
    from grserve.config import RankingLimits, SchedulerConfig, SearchConfig, ServerConfig
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.ranking.app import create_ranking_app
    from grserve.server.retrieval.app import create_app

    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(generate_catalog(300, 3, 8, 1), vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=4), SchedulerConfig(max_batch_requests=4), edge=EdgeConfig()).start()
    admin = {"Authorization": "Bearer adm"}
    retrieval = TestClient(create_app(eng, ServerConfig(), edge=EdgeConfig(admin_api_key="adm")),
                           raise_server_exceptions=False)
    ranking = TestClient(create_ranking_app(ranking_engine, RankingLimits(), edge=EdgeConfig(admin_api_key="adm")),
                         raise_server_exceptions=False)
    try:
        bad = _hostile_pass(retrieval, "/v1/recommend", {"history_tokens": [20, 30], "top_n": 2, "beam_width": 4,
                                                         "exclude_items": [1, 2]})
        bad += _hostile_pass(retrieval, "/v1/recommend", {"history_sids": [[1, 2, 3]], "top_n": 2})
        bad += _hostile_pass(retrieval, "/v1/catalog", {"name": "a.jsonl"}, admin)
        bad += _hostile_pass(ranking, "/v1/rank", {"user_tokens": [5, 6, 7], "candidate_tokens": [[8, 9], [10, 11]],
                                                   "top_k": 2})
        bad += _hostile_pass(ranking, "/v1/rank", {"user_id": 0, "candidates": [0, 1, 2]})
        bad += _hostile_pass(ranking, "/v1/users", {"users": [{"user_id": 900, "tokens": [5, 6]}]}, admin)
        bad += _hostile_pass(ranking, "/v1/items", {"items": [{"item_id": 900, "tokens": [5, 301]}]}, admin)
    finally:
        eng.stop()
    assert not bad, bad
