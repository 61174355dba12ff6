"""Issue 14 review as a hostile-but-fair client: each finding of the review is reproduced here as a test."""

from __future__ import annotations

import threading
import time

from grserve.config import EdgeConfig
from tests.test_security_limits import llm  # noqa: F401 - the shared small-LLM fixture


def test_streamed_request_that_expires_in_the_queue_is_a_503_not_an_empty_200(llm):  # noqa: F811
    """Leftover 1: a streamed request dropped at its queue deadline came back as a 200 stream that ended without
    a token. Its status line now waits for its first event: it is a 503 ``queue_timeout`` in OpenAI's shape."""
    eng, client = llm(EdgeConfig(request_timeout=0.05))
    eng._status = "ok"  # accepting, no engine thread: the request stays queued

    def expire_later():
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
            while not eng.core.waiting:  # the request is queued: now the client goes away
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
        assert not eng.core.waiting and not eng._live and eng.core.iterations == 0
        starts = [m["status"] for m in sent if m["type"] == "http.response.start"]
        assert starts in ([], [499]), starts
    finally:
        eng._status = "stopped"
