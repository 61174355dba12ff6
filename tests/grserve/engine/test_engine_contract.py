"""The Engine contract (engine/protocol.py) on all three engines: submit → result equals the direct path,
overload, cancel, drain, per-batch failure isolation, an LLM step failure is an error (never a finish)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from grserve.catalog import CatalogStore, generate_catalog
from grserve.config import EdgeConfig, RankingConfig, SchedulerConfig, SearchConfig
from grserve.engine.async_llm import AsyncLLMEngine, EngineStepFailed
from grserve.engine.llm import build_model_engine
from grserve.engine.protocol import Engine, EngineOverloaded, EngineStopped, RequestCancelled
from grserve.engine.ranking_engine import RankingEngine
from grserve.engine.ranking_runner import RankingRequest, RankingRunner
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest, RetrievalRequest
from grserve.model import load_model
from grserve.ranking.registry import synthetic_registry
from grserve.scheduler.llm_factory import make_llm_scheduler


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


def _retrieval(model, edge=None, **sched):
    store = CatalogStore(generate_catalog(500, 3, 16, seed=1), vocab_size=model.spec.vocab_size)
    return RetrievalEngine(model, store, SearchConfig(beam_width=8), SchedulerConfig(**sched), edge=edge)


def _prompt(n, seed):
    return np.random.default_rng(seed).integers(16, 400, size=n)


def test_retrieval_engine_matches_the_runner(model):
    eng = _retrieval(model)
    assert isinstance(eng, Engine)
    with eng:
        handles = [eng.submit(RetrievalRequest(_prompt(30, s), 8, 5)) for s in range(3)]
        results = [h.future.result(timeout=120) for h in handles]
        direct = eng.runner.run([_prompt(30, s) for s in range(3)], 8, [5] * 3, eng.catalogs.current())
    for res, hits in zip(results, direct.hits):
        assert [i.item_id for i in res.items] == [h.item_id for h in hits]
    assert eng.health().status == "stopped"


def test_overload_cancel_and_stop(model):
    eng = _retrieval(model, EdgeConfig(max_waiting=2))
    # not started: requests stay queued, so the bound and cancel are deterministic
    eng._core._status = "ok"
    a = eng.submit(RetrievalRequest(_prompt(10, 0), 8, 2))
    eng.submit(RetrievalRequest(_prompt(10, 1), 8, 2))
    with pytest.raises(EngineOverloaded):
        eng.submit(RetrievalRequest(_prompt(10, 2), 8, 2))
    assert eng.cancel(a.request_id) and not eng.cancel(a.request_id)
    with pytest.raises(RequestCancelled):
        a.future.result(timeout=1)
    assert eng.queue_depth == 1
    eng.stop()
    with pytest.raises(EngineStopped):
        eng.submit(RetrievalRequest(_prompt(10, 3), 8, 2))


def test_drain_finishes_work_then_refuses(model):
    eng = _retrieval(model).start()
    hs = [eng.submit(RetrievalRequest(_prompt(20, s), 8, 3)) for s in range(4)]
    assert eng.drain(timeout_s=120)
    assert all(h.future.done() and len(h.future.result().items) == 3 for h in hs)
    with pytest.raises(EngineStopped):
        eng.submit(RetrievalRequest(_prompt(20, 9), 8, 3))
    assert eng.health().status == "draining"
    eng.stop()


def test_a_failing_batch_fails_only_its_requests(model):
    eng = _retrieval(model, max_inflight_batches=1)
    real = eng.runner.run
    calls = []

    def flaky(prompts, *a, **k):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(prompts, *a, **k)

    eng.runner.run = flaky
    with eng:
        bad = eng.submit(RetrievalRequest(_prompt(10, 0), 8, 2))
        with pytest.raises(RuntimeError, match="boom"):
            bad.future.result(timeout=60)
        good = eng.submit(RetrievalRequest(_prompt(10, 1), 8, 2))
        assert len(good.future.result(timeout=120).items) == 2


def test_ranking_engine_matches_the_runner(model):
    reg = synthetic_registry(model.spec.vocab_size, 40, (2, 4), [20, 30, 25, 35], seed=0)

    def req(k):
        items = [reg.item_tokens(i) for i in (k, k + 1, k + 2)]
        return RankingRequest(reg.user_tokens(k % 4), items, user_id=k % 4, item_ids=[k, k + 1, k + 2], now=0.0)

    cfg = RankingConfig(policy="recompute")
    with RankingEngine(RankingRunner(model, reg, cfg)) as eng:
        assert isinstance(eng, Engine)
        got = [eng.submit(req(k)).future.result(timeout=120) for k in range(3)]
    direct = RankingRunner(model, reg, cfg).run([req(k) for k in range(3)])
    assert [g.order for g in got] == [d.order for d in direct]
    assert eng.stats()["requests"] == 3


def _llm(model, **kw):
    core = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=64, block_size=8, **kw)
    return AsyncLLMEngine(core)


def test_llm_engine_streams_the_same_greedy_tokens(model):
    prompts = [list(range(20, 40)), list(range(50, 62))]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = _llm(model).core.generate(prompts, params)
    eng = _llm(model)
    assert isinstance(eng, Engine)

    async def go(p):
        h = eng.submit(LLMRequest(p, params))
        streamed = [t for ev in [e async for e in h.events()] for t in ev.token_ids]
        return streamed, await h.result()

    with eng:
        outs = [asyncio.run(go(p)) for p in prompts]
    for (streamed, res), w in zip(outs, want):
        assert streamed == res.output_ids == w and res.finish_reason == "length"


def test_llm_cancel_frees_blocks_and_step_failure_is_an_error(model):
    eng = _llm(model)
    with eng:
        h = eng.submit(LLMRequest(list(range(20, 40)), SamplingParams(max_tokens=200, temperature=0.0)))
        assert eng.cancel(h.request_id)
        with pytest.raises(RequestCancelled):
            h.future.result(timeout=30)
        assert eng.core.pool.num_free == eng.core.pool.num_blocks
        eng.core.executor.execute = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("step"))
        h2 = eng.submit(LLMRequest(list(range(20, 30)), SamplingParams(max_tokens=4, temperature=0.0)))
        with pytest.raises(EngineStepFailed):
            h2.future.result(timeout=30)
        assert eng.stats()["errors"] >= 1
