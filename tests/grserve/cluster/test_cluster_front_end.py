"""The cluster front end with fake instances (no Ray: the front end's calls to an instance are
``actor.submit.remote(...)`` / ``actor.cancel.remote(...)``; the tests play the pollers by handing the front end
poll answers). Admission (``cluster/llm/admission.py``): ``--max-waiting`` bounds the requests waiting for their first
token (429 with Retry-After beyond it), ``--request-timeout`` fails the ones that wait too long (503
``queue_timeout``), through the real ``ClusterLLMEngine`` and LLM app. Restart: a death triggers a respawn only
with ``--restart-instances`` (the respawn itself runs on Ray: ``test_cluster_ray.py``)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import pytest

from grserve.cluster.llm.front_end import ClusterLLMEngine
from grserve.cluster.wire import LLMInstanceInfo, LLMPoll, TokenReport
from grserve.config import ClusterConfig, EdgeConfig
from grserve.engine.protocol import EngineOverloaded, RequestTimedOut
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest


class _Call:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def remote(self, *args):
        self.log.append((self.name, args))


class FakeActor:
    """Records what the front end sends; never answers by itself."""

    def __init__(self):
        self.calls: list = []
        self.submit, self.cancel = _Call(self.calls, "submit"), _Call(self.calls, "cancel")


def _engine(max_waiting: int, timeout_s: float, instances: int = 2,
            restart: bool = False) -> tuple[ClusterLLMEngine, list[FakeActor]]:
    actors = [FakeActor() for _ in range(instances)]
    infos = [LLMInstanceInfo(i, f"inc{i}", host="h", max_model_len=256, vocab_size=300, num_blocks=64)
             for i in range(instances)]
    eng = ClusterLLMEngine(actors, infos, ClusterConfig(instances=instances, routing="round_robin",
                                                         restart_instances=restart),
                           edge=EdgeConfig(max_waiting=max_waiting, request_timeout=timeout_s))
    eng._status = "ok"  # no pollers: the test delivers the poll answers
    return eng, actors


def _poll(eng: ClusterLLMEngine, inst: int, tokens: list[TokenReport]) -> None:
    eng._on_poll(eng.instances[inst], LLMPoll(tokens))


def _req(rid: str) -> LLMRequest:
    return LLMRequest([5, 6, 7, 8], SamplingParams(max_tokens=3, temperature=0), request_id=rid)


def test_max_waiting_bounds_the_front_end_and_a_first_token_frees_a_slot():
    eng, actors = _engine(max_waiting=3, timeout_s=60)
    handles = [eng.submit(_req(f"r{k}")) for k in range(3)]
    assert eng.queue_depth == 3 and eng.max_waiting == 3
    with pytest.raises(EngineOverloaded):
        eng.submit(_req("r3"))
    assert "r3" not in eng.records and sum(len(a.calls) for a in actors) == 3  # refused before routing
    _poll(eng, eng.records["r0"].instance, [TokenReport("r0", 0, 0, [11])])  # r0's first token: no longer waits
    assert eng.queue_depth == 2
    eng.submit(_req("r3"))
    with pytest.raises(EngineOverloaded):
        eng.submit(_req("r4"))
    eng.cancel("r1")  # a cancel frees its slot too
    eng.submit(_req("r4"))
    _poll(eng, eng.records["r0"].instance, [TokenReport("r0", 0, 1, [12, 13], finished=True, finish_reason="length")])
    assert handles[0].future.result(timeout=1).output_ids == [11, 12, 13]


def test_request_timeout_applies_while_waiting_at_the_front_end():
    eng, actors = _engine(max_waiting=8, timeout_s=0.2)
    slow, started = eng.submit(_req("slow")), eng.submit(_req("started"))
    _poll(eng, eng.records["started"].instance, [TokenReport("started", 0, 0, [11])])
    eng._expire()
    assert not slow.future.done()  # not yet past the deadline
    time.sleep(0.25)
    eng._expire()
    with pytest.raises(RequestTimedOut):
        slow.future.result(timeout=1)
    assert ("cancel", ("slow",)) in actors[0].calls + actors[1].calls  # its instance drops it
    assert not started.future.done() and eng.queue_depth == 0  # one with a first token is not timed out
    assert eng.counters["expired"] == 1


def test_http_429_with_retry_after_and_503_queue_timeout():
    from fastapi.testclient import TestClient

    from grserve.server.llm.app import create_llm_app

    eng, _ = _engine(max_waiting=1, timeout_s=0.3)
    app = create_llm_app(eng, None, "m", 256, 300, edge=EdgeConfig(max_waiting=1, request_timeout=0.3))
    eng.submit(_req("held"))  # fills the front end's queue
    with TestClient(app) as client:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        eng.cancel("held")

        def expire_soon():
            for _ in range(50):
                time.sleep(0.05)
                eng._expire()

        t = threading.Thread(target=expire_soon)
        t.start()
        r = client.post("/v1/completions", json=body)
        t.join()
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"


@pytest.mark.parametrize("restart", [True, False])
def test_a_death_triggers_a_restart_only_when_asked(monkeypatch, restart):
    from grserve.cluster.core import respawn

    asked: list[int] = []
    monkeypatch.setattr(respawn, "respawn_later", lambda engine, index: asked.append(index))
    eng, actors = _engine(max_waiting=8, timeout_s=60, restart=restart)
    eng.serve_cfg = object()  # launch sets it: what a new actor is built from
    h = eng.submit(_req("r0"))
    victim = eng.records["r0"].instance
    eng.instance_down(victim, "actor died", fence=False)
    assert asked == ([victim] if restart else [])
    assert eng.records["r0"].instance != victim and not h.future.done()  # its request moved first
    live = 1 - victim
    assert not eng.instance_up(live, FakeActor(), LLMInstanceInfo(live, "x"))  # a live index is not replaced


def test_sigterm_after_ray_is_down_dies_by_the_signal():
    """The front end's SIGTERM handler (``ray_runtime.on_sigterm``, installed by ``start_ray`` in place of Ray's
    ``sys.exit(15)``): once the drain has shut Ray down, the process dies by SIGTERM (143 in a shell) like a
    one-instance server; it exited with status 15 (``test_cluster_ray.py`` checks the handler is installed)."""
    import subprocess
    import sys

    code = ("import os, signal, time\nfrom grserve.cluster.core.ray_runtime import on_sigterm\n"
            "signal.signal(signal.SIGTERM, on_sigterm)\nos.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, r.stderr


def test_the_front_end_refuses_what_no_instance_can_hold_by_the_engines_rule():
    """One fit check (``engine.types.LLMFit``): the front end refused a request only when its tokens needed more
    block *groups* than the pool's blocks, while an instance's engine counts both K and V planes — a request between
    the two passed the front end and failed on its instance. Now both use the instances' own ``LLMFit``."""
    from grserve.engine.types import LLMFit

    actors = [FakeActor()]
    info = LLMInstanceInfo(0, "inc0", max_model_len=4096, num_blocks=64, block_size=16, kv_planes=2)
    eng = ClusterLLMEngine(actors, [info], ClusterConfig(instances=1))
    eng._status = "ok"
    assert eng.fit == LLMFit(4096, 64, 16, 2)
    with pytest.raises(ValueError, match="never fits the KV pool"):  # 38 groups: 76 blocks of 64
        eng.submit(LLMRequest(list(range(400)), SamplingParams(max_tokens=200)))
    with pytest.raises(ValueError, match="exceeds the model length 4096"):
        eng.submit(LLMRequest([1], SamplingParams(max_tokens=5000)))
    with pytest.raises(ValueError, match="at least one token"):
        eng.submit(LLMRequest([], SamplingParams(max_tokens=1)))
    assert actors[0].calls == [] and not eng.records
    eng.submit(LLMRequest(list(range(400)), SamplingParams(max_tokens=112)))  # 32 groups: the whole pool
    assert [c[0] for c in actors[0].calls] == ["submit"]


def test_the_text_is_the_instances_and_never_decoded_again():
    """One output path: the client's text is the instance engines' text deltas, in order, across a move; the front
    end decodes nothing (it re-decoded the whole output on every report)."""

    class NoDecode:
        eos_token_id = None

        def decode(self, ids):
            raise AssertionError("the front end decoded tokens")

    eng, actors = _engine(max_waiting=8, timeout_s=60)
    eng.tokenizer = NoDecode()
    h = eng.submit(_req("r0"))
    first = eng.records["r0"].instance
    _poll(eng, first, [TokenReport("r0", 0, 0, [11], "he")])
    eng.instance_down(first, "test", fence=False)  # moved: its next attempt continues after the delivered token
    moved = eng.records["r0"].instance
    name, (attempt,) = actors[moved].calls[-1]
    assert name == "submit" and attempt.attempt == 1 and attempt.delivered == [11]
    _poll(eng, moved, [TokenReport("r0", 1, 0, [12], "ll"), TokenReport("r0", 1, 1, [13], "o", True, "stop")])
    r = h.future.result(timeout=1)
    assert (r.output_ids, r.text, r.finish_reason, r.num_preemptions) == ([11, 12, 13], "hello", "stop", 1)


def test_results_carry_the_engine_phases_the_instances_report():
    """Cluster mode reported no phase times (the queue/prefill/decode histograms stayed empty): the report that ends
    an attempt carries its engine's phases. A request that ran in one attempt has its engine's three; a moved one
    the queue and prefill of the attempt that delivered its first token (gone with a dead instance) and the front
    end's first token → last token as its decode."""
    eng, actors = _engine(max_waiting=8, timeout_s=60)
    h = eng.submit(_req("r0"))
    inst = eng.records["r0"].instance
    phases = {"queue_s": 0.25, "prefill_s": 0.5, "decode_s": 1.5}
    _poll(eng, inst, [TokenReport("r0", 0, 0, [11], "a"), TokenReport("r0", 0, 1, [12], "b", True, "stop", phases)])
    r = h.future.result(timeout=1)
    assert (r.queue_s, r.prefill_s, r.decode_s) == (0.25, 0.5, 1.5)
    h = eng.submit(_req("r1"))
    first = eng.records["r1"].instance
    _poll(eng, first, [TokenReport("r1", 0, 0, [11], "a")])
    eng.instance_down(first, "test", fence=False)
    moved = eng.records["r1"].instance
    _poll(eng, moved, [TokenReport("r1", 1, 0, [12], "b", True, "stop", {"queue_s": 9.0, "decode_s": 9.0})])
    r = h.future.result(timeout=1)
    assert r.queue_s is None and r.prefill_s is None and 0.0 <= r.decode_s < 9.0


def test_an_instance_sends_an_attempts_phases_with_its_end():
    import asyncio

    from grserve.cluster.llm.instance import EngineInstance, TokenInterval
    from grserve.engine.llm import TokenEvent
    from grserve.engine.protocol import RequestHandle
    from grserve.engine.types import LLMResult

    inst = EngineInstance.__new__(EngineInstance)  # no engine: _forward reads only the attempt's handle
    inst._out, inst._snapshots, inst._wake, inst._live, inst.token_interval = [], [], None, {}, TokenInterval()
    handle: RequestHandle = RequestHandle("r0#0")
    handle.push(TokenEvent(0, [11], "a", False))
    handle.push(TokenEvent(0, [12], "b", True, "stop"))
    handle.future.set_result(LLMResult("r0#0", [11, 12], "ab", "stop", 4, queue_s=0.25, prefill_s=0.5, decode_s=1.0))
    asyncio.run(inst._forward("r0", 0, handle))
    assert [r.phases for r in inst._out] == [None, {"queue_s": 0.25, "prefill_s": 0.5, "decode_s": 1.0}]


def test_the_front_end_loads_the_tokenizer_the_instances_use(monkeypatch, tmp_path):
    """``--tokenizer`` and ``--tokenizer-cache`` were ignored by the front end (it loaded the model's own, or a
    preset's under the default cache with another context length than the instances wrote there)."""
    from grserve.cluster.llm import front_end
    from grserve.config import LLMApiConfig, LLMServeConfig, ModelConfig
    from grserve.engine.tokenizer import load_tokenizer

    infos = [LLMInstanceInfo(0, "inc0", max_model_len=256, vocab_size=300, num_blocks=64)]
    monkeypatch.setattr(front_end, "launch_actors", lambda spawn, cluster: ([FakeActor()], infos, False))
    cfg = LLMServeConfig(model=ModelConfig(source="tiny"), api=LLMApiConfig(tokenizer_cache=str(tmp_path / "c")))
    eng = ClusterLLMEngine.launch(cfg, ClusterConfig(instances=1))
    assert eng.tokenizer.name_or_path.startswith(str((tmp_path / "c").resolve()))
    written = json.loads((Path(eng.tokenizer.name_or_path) / "tokenizer_config.json").read_text())
    assert written["model_max_length"] == 256  # as the instances' engines write it
    own = load_tokenizer("preset", 300, 256, tmp_path / "own")
    cfg = LLMServeConfig(model=ModelConfig(source="tiny"), api=LLMApiConfig(tokenizer=own.name_or_path))
    assert ClusterLLMEngine.launch(cfg, ClusterConfig(instances=1)).tokenizer.name_or_path == own.name_or_path


def test_usage_cached_tokens_are_the_prefilling_instances():
    """``usage.prompt_tokens_details.cached_tokens`` of a cluster request: the prompt tokens the instance that
    produced its first token took from its prefix cache (it was always 0: issue 25). A request recomputed elsewhere
    before its first token reports the new attempt's; tokens after a move never change it."""
    eng, actors = _engine(max_waiting=8, timeout_s=60)
    h = eng.submit(_req("a"))
    first = eng.records["a"].instance
    eng.instance_down(first, "actor died", fence=False)  # no token yet: attempt 1 runs on the other instance
    _poll(eng, 1 - first, [TokenReport("a", 1, 0, [11], cached_tokens=32)])
    _poll(eng, 1 - first, [TokenReport("a", 1, 1, [12, 13], finished=True, finish_reason="length", cached_tokens=0)])
    assert h.future.result(timeout=1).cached_tokens == 32
    g = eng.submit(_req("b"))
    _poll(eng, eng.records["b"].instance, [TokenReport("b", 0, 0, [11, 12, 13], finished=True, finish_reason="length")])
    assert g.future.result(timeout=1).cached_tokens == 0
