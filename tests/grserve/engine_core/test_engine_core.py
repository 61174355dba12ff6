"""The engine in its own process (engine_core/): the same answers as the engine on a thread (greedy, seeded
sampling, stop strings, logprobs, streamed events), cancel frees blocks, the core's death fails its requests with
an error (never a finish, never a hang) and a new core serves, bounded restarts, drain and stop, and a core whose
server is killed exits by itself."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from grserve.config import LLMApiConfig, LLMConfig, LLMServeConfig, ModelConfig
from grserve.engine.async_llm import AsyncLLMEngine
from grserve.engine.protocol import EngineStopped, RequestCancelled
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest
from grserve.server.launch.processes import start_core
from grserve.engine_core.builders import llm_precheck
from grserve.engine_core.client import pid_alive
from grserve.engine_core.messages import EngineCoreDied, decode_out, encode_out, event_row, token_event

PROMPTS = [list(range(20, 40)), list(range(50, 62)), [7, 300, 12, 99, 5]]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7),
    SamplingParams(max_tokens=10, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=30, temperature=0.0, stop=("e",)),
]


def _cfg(tmp_path_factory) -> LLMServeConfig:
    cache = str(tmp_path_factory.mktemp("tok"))
    return LLMServeConfig(model=ModelConfig(source="tiny", seed=0),
                          llm=LLMConfig(scheduler="fcfs", num_blocks=512, block_size=8, threads=1),
                          api=LLMApiConfig(tokenizer_cache=cache))


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return _cfg(tmp_path_factory)


@pytest.fixture(scope="module")
def split(cfg):
    sup, client, info = start_core("llm", cfg, max_restarts=2, max_waiting=None)
    client.precheck = llm_precheck(info)
    yield sup, client
    client.stop()


def _run(engine, req: LLMRequest):
    async def go():
        h = engine.submit(req)
        events = [e async for e in h.events()]
        return events, await h.result()

    return asyncio.run(go())


def _wait(cond, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_token_rows_round_trip():
    from grserve.engine.llm import TokenEvent

    ev = TokenEvent(3, [17], "ab", False, None, cached_tokens=4)
    row = decode_out(encode_out([event_row("r1", ev)]))[0]
    assert row[0] == "t" and token_event(row) == ev
    ev2 = TokenEvent(3, [17], "ab", True, "error", error="boom")
    assert decode_out(encode_out([event_row("r1", ev2)]))[0][0] == "e"  # anything beyond the hot path: pickled


def test_same_answers_as_the_engine_on_a_thread(cfg, split):
    _, client = split
    ref = AsyncLLMEngine.build(cfg).start()
    try:
        for p in PROMPTS:
            for params in PARAMS:
                want_events, want = _run(ref, LLMRequest(p, params))
                got_events, got = _run(client, LLMRequest(p, params))
                assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.text,
                                                                           want.finish_reason)
                assert [(e.token_ids, e.text, e.finished, e.logprobs) for e in got_events] == \
                    [(e.token_ids, e.text, e.finished, e.logprobs) for e in want_events]
    finally:
        ref.stop()


def test_refusals_and_cancel_frees_blocks(split):
    _, client = split
    with pytest.raises(ValueError):  # never fits the 512 x 8 pool: refused here, before the core
        client.submit(LLMRequest(list(range(10, 20)), SamplingParams(max_tokens=5000)))
    h = client.submit(LLMRequest(list(range(20, 40)), SamplingParams(max_tokens=400, temperature=0.0,
                                                                   ignore_eos=True)))
    _wait(lambda: not client.queue_depth)  # its first token came back
    assert client.cancel(h.request_id)
    with pytest.raises(RequestCancelled):
        h.future.result(timeout=30)
    _wait(lambda: client.stats()["free_blocks"] == client.stats()["total_blocks"] and not client.stats()["running"])


def test_core_death_fails_its_requests_and_a_new_core_serves(cfg, split):
    sup, client = split
    old = client.core.pid
    h = client.submit(LLMRequest(list(range(20, 40)), SamplingParams(max_tokens=800, temperature=0.0,
                                                                   ignore_eos=True)))
    _wait(lambda: not client.queue_depth)
    os.kill(old, signal.SIGKILL)
    with pytest.raises(EngineCoreDied):  # an error at once, never a normal finish, never a hang
        h.future.result(timeout=10)
    assert client.health().status in ("restarting", "ok")
    _wait(lambda: client.state == "ok" and client.core.pid != old, 120)
    assert client.health().detail["engine_core_restarts"] == 1
    _, res = _run(client, LLMRequest(PROMPTS[0], PARAMS[0]))
    ref = AsyncLLMEngine.build(cfg)
    assert res.output_ids == ref.core.generate([PROMPTS[0]], PARAMS[0])[0]


def test_gives_up_after_its_restarts(cfg):
    sup, client, _ = start_core("llm", cfg, max_restarts=0, max_waiting=None)
    try:
        os.kill(client.core.pid, signal.SIGKILL)
        _wait(lambda: client.state == "stopped")
        with pytest.raises(EngineStopped, match="not restarting"):
            client.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2)))
        h = client.health()
        assert h.status == "stopped" and "not restarting" in h.detail["engine_core_error"]
    finally:
        client.stop()


def test_drain_finishes_then_stop_ends_the_process(cfg):
    sup, client, _ = start_core("llm", cfg, max_restarts=1, max_waiting=None)
    pid = client.core.pid
    h = client.submit(LLMRequest(list(range(20, 30)), SamplingParams(max_tokens=20, temperature=0.0,
                                                                   ignore_eos=True)))
    assert client.drain(60)
    assert h.future.result(timeout=1).finish_reason == "length"  # drained: finished, not cut
    with pytest.raises(EngineStopped):
        client.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    client.stop()
    assert not pid_alive(pid)


def test_a_core_whose_server_is_killed_exits(tmp_path):
    """kill -9 of the server process: its engine process must not live on holding the model."""
    code = ("import sys, time; from grserve.config import *; from grserve.server.launch.processes import start_core\n"
            f"cfg = LLMServeConfig(model=ModelConfig(source='tiny'), llm=LLMConfig(num_blocks=32, threads=1), "
            f"api=LLMApiConfig(tokenizer_cache={str(tmp_path)!r}))\n"
            "sup, client, _ = start_core('llm', cfg, 1, None)\n"
            "print(client.core.pid, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(proc.stdout.readline())
        assert pid_alive(core_pid)
        proc.kill()
        proc.wait(10)
        _wait(lambda: not pid_alive(core_pid), 20)
    finally:
        proc.kill()


def test_a_hung_core_is_fenced_and_replaced(cfg):
    """A core that stops answering (SIGSTOP: alive, silent) is killed after SILENT_AFTER_S and a new one serves."""
    sup, client, info = start_core("llm", cfg, max_restarts=1, max_waiting=None)
    try:
        client.precheck = llm_precheck(info)
        old = client.core.pid
        h = client.submit(LLMRequest(list(range(20, 40)), SamplingParams(max_tokens=800, temperature=0.0,
                                                                       ignore_eos=True)))
        _wait(lambda: not client.queue_depth)
        os.kill(old, signal.SIGSTOP)
        with pytest.raises(EngineCoreDied, match="no heartbeat"):
            h.future.result(timeout=30)
        _wait(lambda: client.state == "ok" and client.core.pid != old, 120)
        assert not pid_alive(old)
        _, res = _run(client, LLMRequest(PROMPTS[1], PARAMS[0]))
        assert res.finish_reason == "length"
    finally:
        client.stop()


def test_sigterm_to_the_core_drains_it_and_it_is_not_restarted(cfg):
    """A service manager's SIGTERM to every process: the core finishes what runs, exits 0, and is not restarted
    (the front end answers 503 saying so)."""
    sup, client, info = start_core("llm", cfg, max_restarts=2, max_waiting=None)
    try:
        pid = client.core.pid
        h = client.submit(LLMRequest(list(range(20, 30)), SamplingParams(max_tokens=60, temperature=0.0,
                                                                       ignore_eos=True)))
        _wait(lambda: not client.queue_depth)
        os.kill(pid, signal.SIGTERM)
        assert h.future.result(timeout=60).finish_reason == "length"  # drained: finished, not cut
        _wait(lambda: client.state == "stopped")
        assert not pid_alive(pid) and sup.proc.exitcode == 0 and sup.incarnation == 1
        with pytest.raises(EngineStopped, match="SIGTERM"):
            client.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2)))
    finally:
        client.stop()
