"""Issue 25 (hardening II), the server half: no request stalls the others (item 2), the LLM server sheds load at
the edge (3), no client can cancel another's request and no client text reaches a log line raw (4). Each test
fails on the code before its fix (the notes say how)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import threading
import time

import pytest
from fastapi.testclient import TestClient

from conftest import live_server
from grserve.config import EdgeConfig, RankingLimits, SchedulerConfig, SearchConfig, ServerConfig
from grserve.engine.batching import BatchedEngine, BatchingCore
from grserve.engine.types import RetrievalResult, RetrievedItem
from grserve.server.retrieval.app import create_app
from test_security_limits import HangingEngine, llm, ranking_engine  # noqa: F401 - shared fixtures

JSON = {"content-type": "application/json"}


# ----------------------------------------------------------------------------------------------------------
# item 2: /health answers while huge requests are refused or processed, on all three servers
# ----------------------------------------------------------------------------------------------------------
def _set_nice(values: dict[int, int], default: int) -> dict[int, int]:
    """Set each thread of this process to ``values[tid]`` (``default`` for a thread not in it); returns what each
    had. A thread that ended meanwhile, or a priority this process may not take, is skipped."""
    before: dict[int, int] = {}
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, values.get(tid, default))
        except OSError:  # ended, or raising the priority needs CAP_SYS_NICE: left as it is
            pass
    return before


@contextlib.contextmanager
def _cpu_priority(nice: int = -10):
    """This process and its children ahead of the machine's other load, where that is allowed (CAP_SYS_NICE;
    elsewhere nothing changes): the nice value of its autogroup — with autogroups on, CPU time is shared between
    sessions first, so a thread's own nice value counts only within this session — and of each of its threads
    (threads started inside inherit it). Undone after."""
    group = "/proc/self/autogroup"
    try:
        with open(group) as f:
            old_group = int(f.read().split()[-1])  # "/autogroup-29 nice 0"
        with open(group, "w") as f:
            f.write(str(nice))
    except (OSError, ValueError, IndexError):
        old_group = None
    threads = os.path.isdir("/proc/self/task") and hasattr(os, "setpriority")
    before = _set_nice({}, nice) if threads else {}
    try:
        yield
    finally:
        if threads:
            _set_nice(before, before.get(threading.get_native_id(), 0))  # new threads: the caller's old priority
        if old_group is not None:
            with open(group, "w") as f:
                f.write(str(old_group))


@contextlib.contextmanager
def _as_served():
    """Time ``/health`` as the server runs when it is served, apart from the machine's other load. The heap is
    settled as ``grserve serve`` settles it before serving (``serving.settle_heap``: ``gc.freeze``) — else a full
    collection triggered by a hostile body walks the whole test session's heap (models, transformers: 0.32 s once
    at load 9, seen with a gc callback), a stall the server never has; and the test runs ahead of the other
    processes of a busy shared machine (``_cpu_priority``: on 2 cores at load 12-17 the same run took 0.15-0.7 s
    without it, 0.08-0.17 s with it). The bound asserted is unchanged."""
    from grserve.server.launch.serving import settle_heap

    settle_heap()
    try:
        with _cpu_priority():
            yield
    finally:
        gc.unfreeze()


_CLIENTS = """
import json, sys, threading, time
import httpx

url, rounds, hostile = sys.argv[1], int(sys.argv[2]), [a.split("=", 1) for a in sys.argv[3:]]
latencies, statuses, stop = [], [], threading.Event()

def poll():
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t = time.perf_counter()
            r = c.get(url + "/health")
            latencies.append(time.perf_counter() - t if r.status_code == 200 else float("inf"))
            time.sleep(0.02)

def fire(path, file):
    body = open(file, "rb").read()
    with httpx.Client(timeout=120) as c:
        for _ in range(rounds):
            statuses.append(c.post(url + path, content=body, headers={"content-type": "application/json"}).status_code)

poller = threading.Thread(target=poll)
poller.start()
time.sleep(0.2)
firers = [threading.Thread(target=fire, args=hb) for hb in hostile]
for t in firers:
    t.start()
for t in firers:
    t.join()
stop.set()
poller.join()
print(json.dumps({"worst": max(latencies), "statuses": statuses}))
"""


def _health_while(url: str, hostile: list[tuple[str, bytes]], rounds: int = 2) -> tuple[float, list[int]]:
    """Poll ``/health`` while each hostile body is posted ``rounds`` times (one thread a body, all at once);
    returns the slowest ``/health`` answer and the hostile requests' statuses. The clients run in a process of
    their own, as real clients do (in the server's process their threads would queue for its GIL with the event
    loop: ~0.2 s of a /health answer was theirs), against the server as served (``_as_served``)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d, _as_served():
        args = []
        for k, (path, body) in enumerate(hostile):
            with open(f"{d}/{k}.json", "wb") as f:
                f.write(body)
            args.append(f"{path}={d}/{k}.json")
        out = subprocess.run([sys.executable, "-c", _CLIENTS, url, str(rounds), *args], capture_output=True,
                             text=True, timeout=600, check=True)
    answer = json.loads(out.stdout)
    return float(answer["worst"]), [int(s) for s in answer["statuses"]]


def _ints(n: int) -> list[int]:
    return list(range(1, n + 1))


def test_llm_health_stays_fast_while_huge_prompts_are_refused(llm):  # noqa: F811
    """The issue: one 7.9 MB prompt blocked /health for 22 s (tokenized on the event loop before the length check),
    /tokenize 11 s, a chat of 100k messages 5.5 s. Now the prompt's characters, the message count and token-id
    lengths are checked on the raw JSON, off the loop, before anything is validated or tokenized."""
    eng, client = llm(EdgeConfig())
    text = "hello world, " * 600_000  # 7.8 MB
    hostile = [("/v1/completions", json.dumps({"model": "m", "prompt": text, "max_tokens": 4}).encode()),
               ("/tokenize", json.dumps({"model": "m", "prompt": text}).encode()),
               ("/v1/chat/completions", json.dumps({"model": "m", "max_tokens": 4, "messages": [
                   {"role": "user", "content": "hi"}] * 100_000}).encode()),
               ("/v1/completions", json.dumps({"model": "m", "prompt": _ints(700_000)}).encode())]
    eng.start()
    try:
        with live_server(client.app) as url:
            worst, statuses = _health_while(url, hostile)
    finally:
        eng.stop()
    assert worst < 0.5, f"/health took {worst:.2f} s"
    assert sorted(set(statuses)) == [400], statuses


def test_retrieval_health_stays_fast_while_huge_histories_are_refused():
    """Before: FastAPI parsed and validated each 7 MB body on the event loop (~0.25 s each), one after another."""
    client = TestClient(create_app(HangingEngine(), ServerConfig(), edge=EdgeConfig()))
    hostile = [("/v1/recommend", json.dumps({"history_tokens": _ints(1_000_000)}).encode()),
               ("/v1/recommend", json.dumps({"history_tokens": [1], "exclude_items": _ints(1_000_000)}).encode()),
               ("/v1/recommend", json.dumps({"history_items": _ints(1_000_000)}).encode()),
               ("/v1/recommend", json.dumps({"history_tokens": [1] * 1_400_000}).encode())]
    with live_server(client.app) as url:
        worst, statuses = _health_while(url, hostile)
    assert worst < 0.5, f"/health took {worst:.2f} s"
    assert sorted(set(statuses)) == [413], statuses


def test_ranking_health_stays_fast_while_huge_requests_are_refused(ranking_engine):  # noqa: F811
    from grserve.server.ranking.app import create_ranking_app

    client = TestClient(create_ranking_app(ranking_engine, RankingLimits(), edge=EdgeConfig()))
    hostile = [("/v1/rank", json.dumps({"user_tokens": _ints(1_000_000), "candidates": [0]}).encode()),
               ("/v1/rank", json.dumps({"user_id": 0, "candidates": _ints(1_000_000)}).encode()),
               ("/v1/rank", json.dumps({"user_id": 0, "candidate_tokens": [[5, 6]] * 100_000}).encode()),
               ("/v1/rank", json.dumps({"user_tokens": [1] * 1_400_000, "candidates": [0]}).encode())]
    with live_server(client.app) as url:
        worst, statuses = _health_while(url, hostile)
    assert worst < 0.5, f"/health took {worst:.2f} s"
    assert sorted(set(statuses)) == [413], statuses


def test_prompts_are_tokenized_off_the_event_loop_and_never_past_the_character_bound(llm, monkeypatch):  # noqa: F811
    """Tokenization and chat templates run on a heavy-work thread; a prompt with more characters than the window
    can hold (max_model_len x the tokenizer's longest token) is refused without being tokenized."""
    eng, client = llm(EdgeConfig())
    tok = eng.tokenizer
    threads: list[str] = []
    real = tok.encode

    def spy(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", spy)
    for path, body in (("/tokenize", {"model": "m", "prompt": "hello"}),
                       ("/tokenize", {"model": "m", "messages": [{"role": "user", "content": "hello"}]})):
        assert client.post(path, json=body).status_code == 200
    assert len(threads) == 2 and all(t.startswith("grserve-heavy") for t in threads), threads
    bound = 256 * tok.max_token_chars  # the fixture's context window x the longest token
    r = client.post("/v1/completions", json={"model": "m", "prompt": "a" * (bound + 1), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == "prompt" and len(threads) == 2  # never tokenized
    r = client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "a"}] * 257})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text
    assert r.json()["error"]["param"] == "messages" and len(threads) == 2
    r = client.post("/detokenize", json={"model": "m", "tokens": [5] * 257})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_max_chat_messages_is_a_flag_and_bounds_chats_below_the_window():
    import argparse

    from grserve.server.llm.command import add_command, config_from_args
    from grserve.inputs.limits import PromptLimits

    parser = argparse.ArgumentParser()
    add_command(parser.add_subparsers())
    assert config_from_args(parser.parse_args(["llm", "--max-chat-messages", "3"])).api.max_chat_messages == 3
    limits = PromptLimits(max_model_len=256, max_token_chars=5, max_messages=3)
    limits.check_messages([{"role": "user", "content": "x"}] * 3)
    with pytest.raises(Exception, match="4 messages, more than the limit of 3"):
        limits.check_messages([{"role": "user", "content": "x"}] * 4)


def test_a_body_of_a_million_empty_arrays_is_refused_unparsed():
    """Millions of containers make the garbage collector hold every thread for seconds while they are built:
    more '[' and '{' than MAX_BRACKETS is a 413 before parsing (before: parsed on the loop, then a 422)."""
    client = TestClient(create_app(HangingEngine(), ServerConfig(), edge=EdgeConfig()))
    r = client.post("/v1/recommend", content=b'{"history_tokens": [' + b"[]," * 1_000_000 + b"[]]}", headers=JSON)
    assert r.status_code == 413 and r.json()["error"]["type"] == "body_too_complex", r.text


# ----------------------------------------------------------------------------------------------------------
# item 3: every accepted request counts against --max-waiting, from the edge on
# ----------------------------------------------------------------------------------------------------------
def _burst(app, requests: list[tuple[str, bytes]]) -> list[tuple[int, float]]:
    """Raw ASGI requests started at once on one event loop; (status, seconds) of each answer, in order."""
    out: list[tuple[int, float]] = [(0, 0.0)] * len(requests)

    async def one(k: int, path: str, body: bytes) -> None:
        sent: list[dict] = []
        chunks = [body]

        async def receive() -> dict:
            if chunks:
                return {"type": "http.request", "body": chunks.pop(), "more_body": False}
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            if message["type"] == "http.response.start":
                out[k] = (int(message["status"]), time.perf_counter() - t0)

        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
                 "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        await app(scope, receive, send)

    async def all_of_them() -> None:
        tasks = [asyncio.ensure_future(one(k, p, b)) for k, (p, b) in enumerate(requests)]
        await asyncio.wait(tasks, timeout=60)
        for t in tasks:
            t.cancel()

    t0 = time.perf_counter()
    asyncio.run(all_of_them())
    return out


def test_a_burst_past_max_waiting_is_refused_before_tokenizing(llm, monkeypatch):  # noqa: F811
    """The issue: with --max-waiting 64, 300 and 500 concurrent requests never got a 429 — requests being parsed
    and tokenized were not counted, the engine's queue looked short. Now a request counts from the edge on:
    12 at once against --max-waiting 4 (engine not stepping, tokenization slow) are 4 accepted and 8 refused at
    once, and only the 4 are tokenized (before: all 12 tokenized, the 429s came from the engine seconds later)."""
    eng, client = llm(EdgeConfig(max_waiting=4, request_timeout=60))
    tok = eng.tokenizer
    encoded: list[str] = []
    real = tok.encode

    def slow(text, *args, **kwargs):
        encoded.append(text)
        time.sleep(0.2)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", slow)
    eng._status = "ok"  # accepting, no engine thread: the accepted requests stay queued
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()
    try:
        threading.Timer(3.0, eng.stop).start()  # ends the accepted ones (503 stopped)
        answers = _burst(client.app, [("/v1/completions", body)] * 12)
    finally:
        eng._status = "stopped"
    refused = [t for s, t in answers if s == 429]
    assert len(refused) == 8 and len(encoded) == 4, (answers, len(encoded))
    assert max(refused) < 0.15, refused  # answered before one tokenization would have ended
    assert client.app.state.admission.pending == 0


def test_admission_counts_requests_until_the_engine_queue_takes_them(llm):  # noqa: F811
    eng, client = llm(EdgeConfig(max_waiting=2))
    adm = client.app.state.admission
    eng._status = "ok"
    try:
        assert adm.refusal() is None
        adm.admit({})
        adm.admit(scope := {})
        assert adm.refusal() is not None and adm.refusal(holding=True) is None
        from grserve.server.http.edge import hand_over

        hand_over(scope)
        hand_over(scope)  # once only
        assert adm.pending == 1 and adm.refusal() is None
    finally:
        eng._status = "stopped"
        adm.pending = 0


# ----------------------------------------------------------------------------------------------------------
# item 4: engine keys are the server's; a client's request_id is only echoed, never a control character
# ----------------------------------------------------------------------------------------------------------
class GatedEngine(BatchedEngine):
    """A retrieval engine on the real batching core whose batches wait for ``gate``."""

    def __init__(self) -> None:
        base = HangingEngine()
        self.catalogs, self.vocab_size, self.search = base.catalogs, base.vocab_size, SearchConfig(beam_width=4)
        self.gate = threading.Event()
        self._core = BatchingCore(self._execute, SchedulerConfig(max_batch_requests=1, max_inflight_batches=1),
                                  "gated", max_waiting=16, request_timeout_s=60)

    def _execute(self, requests: list) -> list:
        self.gate.wait(30)
        return [RetrievalResult(r.request_id, [RetrievedItem(1, (0, 0, 0), 0.0)]) for r in requests]


def test_a_client_reusing_another_clients_request_id_cancels_only_its_own():
    """The issue: retrieval and ranking used the client's request_id as the engine's cancel key; a second client
    with the same id that disconnected cancelled the first (503 to an innocent client, 5/5). Now: A waits in the
    queue behind a running batch, B (same id) joins the queue and leaves; A is answered 200 with its id."""
    engine = GatedEngine().start()
    app = create_app(engine, ServerConfig(), edge=EdgeConfig())
    body = json.dumps({"history_tokens": [20, 21], "top_n": 1, "request_id": "same"}).encode()
    results: dict[str, tuple[int, bytes]] = {}

    async def call(name: str, leave: bool) -> None:
        sent: list[dict] = []
        state = {"n": 0}

        async def receive() -> dict:
            state["n"] += 1
            if state["n"] == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            while not (leave and engine.queue_depth >= 2):  # B leaves once A and B both wait in the queue
                await asyncio.sleep(0.01)
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/recommend", "raw_path": b"/v1/recommend",
                 "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                 "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        await app(scope, receive, send)
        status = next((m["status"] for m in sent if m["type"] == "http.response.start"), 0)
        results[name] = (status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))

    async def scenario() -> None:
        blocker = asyncio.ensure_future(call("blocker", False))  # runs first, holds the one executor
        while engine._core.batches_run == 0 and not engine._core._running_ids:
            await asyncio.sleep(0.01)
        a = asyncio.ensure_future(call("A", False))
        while engine.queue_depth < 1:
            await asyncio.sleep(0.01)
        b = asyncio.ensure_future(call("B", True))
        await asyncio.wait_for(b, 10)
        engine.gate.set()
        await asyncio.wait_for(asyncio.gather(a, blocker), 20)

    try:
        asyncio.run(scenario())
    finally:
        engine.gate.set()
        engine.stop()
    assert results["B"][0] in (0, 499)
    status, answer = results["A"]
    assert status == 200, answer
    assert json.loads(answer)["request_id"] == "same"


@pytest.mark.parametrize("rid", ["a\r\nINFO forged line", "a\nb", "\x1b[31mred", "a\u2028b", "a\x00", "a\u202eb"])
def test_a_request_id_with_control_characters_is_a_400_naming_it(rid, ranking_engine):  # noqa: F811
    """CR/LF in a request id reached the logs: a forged log line. Control, format and line-separator characters
    are refused (400 naming request_id) on both routes that take one."""
    from grserve.server.ranking.app import create_ranking_app

    engine = GatedEngine().start()
    engine.gate.set()  # answers at once (before the fix: a 200 echoing the id)
    try:
        retrieval = TestClient(create_app(engine, ServerConfig(), edge=EdgeConfig()))
        r = retrieval.post("/v1/recommend", json={"history_tokens": [20], "top_n": 1, "request_id": rid})
    finally:
        engine.stop()
    assert r.status_code == 400 and r.json()["error"]["field"] == "request_id", r.text
    ranking = TestClient(create_ranking_app(ranking_engine, RankingLimits(), edge=EdgeConfig()))
    r = ranking.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1], "request_id": rid})
    assert r.status_code == 400 and r.json()["error"]["field"] == "request_id", r.text


def test_ranking_keys_its_requests_itself_and_echoes_the_clients_id(ranking_engine):  # noqa: F811
    from grserve.server.ranking.app import create_ranking_app

    keys: list[str] = []
    real = ranking_engine.submit

    def record(req):
        keys.append(req.request_id)
        return real(req)

    ranking_engine.submit = record
    try:
        client = TestClient(create_ranking_app(ranking_engine, RankingLimits(), edge=EdgeConfig()))
        r = client.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1], "request_id": "mine é 1"})
        assert r.status_code == 200 and r.json()["request_id"] == "mine é 1", r.text
        assert keys and keys[0] != "mine é 1"
        r = client.post("/v1/rank", json={"user_id": 0, "candidates": [0, 1]})
        assert r.json()["request_id"] == keys[1]  # no id given: the server's own is the answer's
    finally:
        del ranking_engine.submit


def test_an_unhandled_error_logs_the_path_escaped(caplog):
    """The one log line that names a client's path (an unhandled error's): the path is percent-decoded, and a
    terminal escape (ESC, %1b) in it would reach the log raw (CR/LF are dropped by URL parsing); it is shown
    escaped."""
    client = TestClient(create_app(HangingEngine(), ServerConfig(), edge=EdgeConfig()), raise_server_exceptions=False)

    @client.app.get("/boom/{rest}")
    async def boom(rest: str) -> None:
        raise RuntimeError("boom")

    with caplog.at_level("ERROR", logger="grserve.server"):
        assert client.get("/boom/x%1b[2K%1b[1GINFO forged").status_code == 500
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("\x1b" not in m for m in lines), lines


# ----------------------------------------------------------------------------------------------------------
# the retrieval server's text routes (issue 27: the OpenAI beam routes, /v1/recommend's prompt / messages) get the
# same hardening: cheap checks first, templates and the tokenizer off the loop, admission, server-made keys
# ----------------------------------------------------------------------------------------------------------
class TextEngine(HangingEngine):
    """HangingEngine with a tokenizer (text prompts accepted) and a queue bound. With ``answer`` every request is
    answered at once with one item and a three-token thought; else it waits until ``stop()``."""

    def __init__(self, tokenizer, answer: bool = True, max_waiting: int | None = None) -> None:
        super().__init__()
        self.tokenizer, self.vocab_size, self.max_waiting = tokenizer, tokenizer.vocab_size, max_waiting
        self.answer = answer
        self.keys: list[str] = []

    def submit(self, req):
        handle = super().submit(req)
        self.keys.append(req.request_id)
        if self.answer:
            handle.future.set_result(RetrievalResult(req.request_id, [RetrievedItem(1, (0, 0, 0), 0.0)],
                                                     thought=[72, 105, 0]))
        return handle


@pytest.fixture(scope="module")
def preset_tok(tmp_path_factory):
    from grserve.engine.tokenizer import load_tokenizer

    return load_tokenizer("preset", 512, 256, tmp_path_factory.mktemp("tok"))


def _text_client(tok, server: ServerConfig | None = None, edge: EdgeConfig | None = None, **engine) -> TestClient:
    from grserve.config import BeamApiConfig

    app = create_app(TextEngine(tok, **engine), server or ServerConfig(), edge=edge or EdgeConfig(),
                     beams=BeamApiConfig(max_chat_messages=3), model_name="gr")
    return TestClient(app, raise_server_exceptions=False)


def test_retrieval_health_stays_fast_while_huge_prompts_and_chats_are_refused(preset_tok):
    """Before: the OpenAI beam routes and /v1/recommend's prompt / messages were parsed and validated by FastAPI on
    the event loop, then the chat template rendered and the tokenizer encoded there — a 7.8 MB prompt or a chat of
    100k messages held /health for seconds. Now the raw JSON is checked first (characters vs --max-prompt-tokens x
    the longest token, messages vs --max-chat-messages, token-id lengths, brackets), off the loop."""
    client = _text_client(preset_tok)
    text = "hello world, " * 600_000  # 7.8 MB
    chat = [{"role": "user", "content": "hi"}]
    hostile = [("/v1/completions", json.dumps({"model": "gr", "prompt": text}).encode()),
               ("/v1/completions", json.dumps({"model": "gr", "prompt": _ints(700_000)}).encode()),
               ("/v1/chat/completions", json.dumps({"model": "gr", "messages": chat * 100_000}).encode()),
               ("/v1/chat/completions", json.dumps({"model": "gr", "messages": chat * 20_000}).encode()),
               ("/v1/recommend", json.dumps({"prompt": text, "top_n": 2}).encode()),
               ("/v1/recommend", json.dumps({"messages": chat * 20_000, "top_n": 2}).encode())]
    with live_server(client.app) as url:
        worst, statuses = _health_while(url, hostile)
    assert worst < 0.5, f"/health took {worst:.2f} s"
    assert sorted(set(statuses)) == [400, 413], statuses  # too_many_messages; prompt_too_long, body_too_complex


def test_text_histories_are_tokenized_off_the_event_loop_and_never_past_the_character_bound(preset_tok, monkeypatch):
    """The SID text check, the chat template, the tokenizer and the thought's decoding run on a heavy-work thread;
    a prompt with more characters than --max-prompt-tokens can hold, more messages than --max-chat-messages or more
    token ids than --max-prompt-tokens is refused before it is validated or tokenized, on all three text routes."""
    client = _text_client(preset_tok, ServerConfig(max_prompt_tokens=64))
    threads: list[tuple[str, str]] = []
    for name in ("encode", "apply_chat_template", "decode"):
        real = getattr(preset_tok, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            threads.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        monkeypatch.setattr(preset_tok, name, spy)
    messages = [{"role": "user", "content": "hello"}]
    for path, body in (("/v1/completions", {"model": "gr", "prompt": "hello"}),
                       ("/v1/chat/completions", {"model": "gr", "messages": messages}),
                       ("/v1/recommend", {"prompt": "hello", "top_n": 1}),
                       ("/v1/recommend", {"messages": messages, "top_n": 1})):
        r = client.post(path, json=body)
        assert r.status_code == 200, (path, r.text)
    assert {n for n, _ in threads} == {"encode", "apply_chat_template", "decode"}
    assert all(t.startswith("grserve-heavy") for _, t in threads), threads
    seen = len(threads)
    bound = 64 * preset_tok.max_token_chars
    r = client.post("/v1/completions", json={"model": "gr", "prompt": "a" * (bound + 1)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text
    assert r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"model": "gr", "prompt": [5] * 65})
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt", r.text
    r = client.post("/v1/recommend", json={"prompt": "a" * (bound + 1), "top_n": 1})
    assert r.status_code == 413 and r.json()["error"] == {"message": r.json()["error"]["message"],
                                                          "field": "prompt", "type": "prompt_too_long"}, r.text
    r = client.post("/v1/chat/completions", json={"model": "gr", "messages": messages * 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_messages", r.text
    r = client.post("/v1/recommend", json={"messages": messages * 4, "top_n": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "too_many_messages", r.text
    assert len(threads) == seen  # none of them tokenized


def test_the_text_routes_bound_brackets_by_what_a_valid_prompt_can_quote(preset_tok):
    """A tokenizer makes text prompts possible, and text may quote '[' and '{': the bracket bound grows to the
    characters a prompt can hold (at most the LLM's MAX_BRACKETS); without one it stays --max-prompt-tokens + 64."""
    from grserve.server.http.bodies import MAX_BRACKETS
    from grserve.inputs.limits import PromptTokenLimits
    from grserve.server.retrieval.app import max_brackets

    server = ServerConfig(max_prompt_tokens=64, max_history_entries=64)  # a truncated history holds up to 64 entries
    assert max_brackets(server, PromptTokenLimits(64, None, 3)) == 128
    assert max_brackets(server, PromptTokenLimits(64, preset_tok.max_token_chars, 3)) == \
        64 * preset_tok.max_token_chars + 9 + 64
    assert max_brackets(ServerConfig(max_history_entries=64), PromptTokenLimits(8192, 100, 2048)) == MAX_BRACKETS
    assert max_brackets(ServerConfig(max_prompt_tokens=64), PromptTokenLimits(64, None, 3)) == 16384 + 64
    client = _text_client(preset_tok, server)
    quoted = "[" * (64 * preset_tok.max_token_chars // 2)  # more brackets than 128, fewer characters than the bound
    r = client.post("/v1/recommend", json={"prompt": quoted, "top_n": 1})  # before: 413 body_too_complex
    assert r.status_code == 413 and r.json()["error"]["type"] == "prompt_too_long", r.text  # tokenized: too long
    r = client.post("/v1/completions", json={"model": "gr", "prompt": quoted})
    assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long", r.text


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": "gr", "messages": [{"role": "user", "content": "hello"}]}),
    ("/v1/completions", {"model": "gr", "prompt": "hello"}),
    ("/v1/recommend", {"prompt": "hello", "top_n": 1}),
])
def test_a_burst_on_a_text_route_is_refused_before_tokenizing(preset_tok, monkeypatch, path, body):
    """As on the LLM server: 12 at once against --max-waiting 4 while the tokenizer is slow are 4 accepted and 8
    refused at once (429), and only the 4 are tokenized (before: all 12 parsed and tokenized, none refused while
    the engine's queue looked empty)."""
    client = _text_client(preset_tok, edge=EdgeConfig(max_waiting=4, request_timeout=60), answer=False,
                          max_waiting=4)
    engine = client.app.state.engine
    encoded: list[str] = []
    real = preset_tok.encode

    def slow(text, *args, **kwargs):
        encoded.append(text)
        time.sleep(0.5)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(preset_tok, "encode", slow)
    threading.Timer(3.0, engine.stop).start()  # ends the accepted ones (503 stopped)
    answers = _burst(client.app, [(path, json.dumps(body).encode())] * 12)
    refused = [t for s, t in answers if s == 429]
    assert len(refused) == 8 and len(encoded) == 4, (answers, len(encoded))
    assert max(refused) < 0.4, refused  # answered before one tokenization would have ended
    assert sorted(s for s, _ in answers if s != 429) == [503] * 4
    assert client.app.state.admission.pending == 0


def test_the_text_routes_key_their_requests_themselves(preset_tok):
    """/v1/recommend with a text history echoes the client's request_id, never uses it as the engine's key (before:
    main's /v1/recommend keyed prompt / messages histories by it); the OpenAI beam routes take no client id, and
    each request gets its own server key."""
    client = _text_client(preset_tok)
    engine = client.app.state.engine
    r = client.post("/v1/recommend", json={"prompt": "hello", "top_n": 1, "request_id": "mine"})
    assert r.status_code == 200 and r.json()["request_id"] == "mine", r.text
    assert engine.keys[-1] != "mine"
    r = client.post("/v1/recommend", json={"prompt": "hello", "top_n": 1, "request_id": "a\r\nINFO forged"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "request_id", r.text
    for _ in range(2):
        r = client.post("/v1/chat/completions", json={"model": "gr", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200, r.text
    assert len(set(engine.keys)) == len(engine.keys) == 3
