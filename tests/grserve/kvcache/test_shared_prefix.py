"""Shared prefix blocks (kvcache/shared_prefix.py, block_hash.py, the pool's reference counts): greedy tokens are
HF transformers' with sharing under every scheduler, forced preemptions and eviction; copy-on-write of a partial
last block; no block is freed while a table or the cache holds it (Hypothesis); the schedulers' view of shared
blocks."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grserve.kvcache.block_hash import chained_block_hashes
from grserve.kvcache.blocks import BlockPool, HybridCacheStorage
from grserve.kvcache.shared_prefix import SharedPrefixCache

VOCAB, NEW = 300, 6


# ---- block hashes ------------------------------------------------------------------------------------------------
def test_chained_block_hashes_name_whole_prefixes_and_are_stable_across_processes():
    a = chained_block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial last block has no hash
    assert chained_block_hashes(list(range(8)) + [99, 98, 97, 96], 4)[:2] == a
    b = chained_block_hashes([1] + list(range(1, 10)), 4)
    assert b[0] != a[0] and b[1] != a[1]  # a different first block changes every later hash (chaining)
    assert chained_block_hashes(list(range(4, 8)), 4, parent=a[0]) == a[1:]
    code = "from grserve.kvcache.block_hash import chained_block_hashes as h; print(h(list(range(10)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PYTHONPATH": "src"})
    assert out.stdout.strip() == str(a)


# ---- the engine with a real model ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(hf_qwen3):
    pytest.importorskip("transformers")
    return hf_qwen3(kv_heads=2, seed=11)


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(37)]
    shots = [system + [rng.randrange(3, VOCAB) for _ in range(11)] for _ in range(2)]
    out = [head + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))]
           for head in (shots[i % 2] if i % 3 else system for i in range(8))]
    return out + [system[:36], list(system)]  # 36 = 9 full blocks of 4: its last block is copied, not shared


@pytest.fixture(scope="module")
def want(models):
    hf, _ = models
    out = []
    with torch.no_grad():
        for p in _prompts():
            g = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
            out.append(g[0, len(p):].tolist())
    return out


def _params():
    from grserve.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


def _engine(ours, sched, **kw):
    from grserve.engine.llm import build_model_engine

    eng = build_model_engine(ours, sched, num_blocks=kw.pop("num_blocks", 256), block_size=4,
                             prefix_cache_tokens=kw.pop("tokens", 1024), **kw)
    pc = eng.prefix_cache
    eng.on_iteration = lambda plan, dt: pc.check()  # pool + cache invariants after every iteration
    return eng


@pytest.mark.parametrize("sched", ["fcfs", "chunked", "aptserve", "preempting"])
def test_shared_blocks_match_hf_concurrently(models, want, sched):
    """One request warms the cache, then all the others run together: they attach the same blocks at once."""
    from grserve.scheduler.llm_factory import make_llm_scheduler

    _, ours = models
    inner = make_llm_scheduler("fcfs" if sched == "preempting" else sched, token_budget=16, ttft_slo=1e9,
                               tbt_slo=1e9)
    from llm_fixtures import Preempting

    eng = _engine(ours, Preempting(inner, every=3) if sched == "preempting" else inner)
    prompts = _prompts()
    got = eng.generate(prompts[:1], _params()) + eng.generate(prompts[1:], _params())
    assert got == want
    pc = eng.prefix_cache
    assert pc.stats["shared_groups"] >= 9 * (len(prompts) - 2) and pc.stats["cow_tokens"] > 0
    if sched == "preempting":
        assert eng.stats["preemptions"] > 0
    assert eng.pool.num_free == eng.pool.num_blocks  # everything left is the cache's, and reclaimable
    pc.check()


@pytest.mark.parametrize("policy", ["lru", "leader"])
def test_shared_blocks_under_eviction(models, want, policy):
    from grserve.scheduler.llm_factory import make_llm_scheduler

    _, ours = models
    eng = _engine(ours, make_llm_scheduler("fcfs"), tokens=60, prefix_cache_policy=policy)  # 15 groups
    got = []
    for p in _prompts():
        got += eng.generate([p], _params())
    assert got == want
    pc = eng.prefix_cache
    assert pc.stats["evicted_groups"] > 0 and len(pc.entries) <= 15 and pc.stats["shared_groups"] > 0


def test_pool_pressure_reclaims_cached_blocks(models, want):
    """A pool just big enough for one request at a time: admissions evict the cache's idle blocks."""
    from grserve.scheduler.llm_factory import make_llm_scheduler

    _, ours = models
    eng = _engine(ours, make_llm_scheduler("fcfs"), num_blocks=34)
    assert eng.generate(_prompts(), _params()) == want
    assert eng.prefix_cache.stats["evicted_groups"] > 0


# ---- bookkeeping without a model -------------------------------------------------------------------------------
def test_scheduler_view_of_shared_blocks():
    pool = BlockPool(40, 4)
    pool.reserve("a", 12, "kv")  # 3 groups = 6 blocks
    shared = [tuple(p[g] for p in pool.table("a").planes) for g in range(3)]
    pool.attach("b", shared)
    pool.reserve("b", 16, "kv")  # one private group more
    assert pool.shared_credit == 6 and pool.blocks_of("b") == 8
    assert pool.freeable_blocks("b") == 2 and pool.freeable_blocks("a") == 0
    assert pool.free("a") == 6 and pool.num_used == 8 and pool.shared_credit == 0
    pool.check()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 18), st.integers(0, 2)), min_size=1, max_size=40),
       st.integers(6, 40))
def test_no_block_is_freed_while_referenced(ops, cap):
    """Random admissions (prompts from a 2-letter alphabet: much sharing), prefill + save, growth, finishes and
    reclaim pressure: pool and cache invariants hold after every operation, and every row a request reads —
    shared or private — still holds the value written for its token prefix (a block freed while referenced and
    reused would be overwritten)."""
    B = 4
    pool = BlockPool(48, B)
    storage = HybridCacheStorage(pool, 1, 1, 1)
    cache = SharedPrefixCache(pool, cap, "lru")
    live: dict[int, list[int]] = {}
    rng = random.Random(len(ops) * 1000 + cap)

    def value(prefix):
        return float(hash(tuple(prefix)) % 9973)

    for sid, (op, length, extra) in enumerate(ops):
        if op == 0 and live:  # a request finishes
            pool.free(rng.choice(sorted(live)))
            live.pop(next(k for k in sorted(live) if k not in pool), None)
        elif op == 3:  # pressure: evict what the cache can
            cache.reclaim(rng.randint(1, 8))
        else:
            toks = [rng.randrange(2) for _ in range(length)]
            if pool.blocks_for(length + extra, "kv") > pool.num_free:
                continue
            m, n_after, _ = cache.attach(sid, toks, length, 10**6, storage)
            t = pool.table(sid)
            pool.reserve(sid, length + extra, "kv")
            for i in range(m, length):  # "compute" the rest of the prompt
                r = storage.row_index(t, i, i + 1)
                storage.data[:, r.flatten()] = value(toks[: i + 1])
            t.num_tokens = length
            cache.save(toks, storage, t)
            live[sid] = toks
        cache.check()
        for s, toks in live.items():  # every row a live request holds is still its own prefix's value
            rows = storage.row_index(pool.table(s), 0, len(toks))
            got = storage.data[0, rows[0], 0].tolist()
            assert got == [value(toks[: i + 1]) for i in range(len(toks))]
    for s in list(live):
        pool.free(s)
    cache.reclaim(10**6)
    assert pool.num_used == 0 and not cache.entries
    pool.check()


def test_openai_usage_reports_cached_prompt_tokens(tmp_path):
    """usage.prompt_tokens_details.cached_tokens: 0 on a cold cache, the shared whole blocks on a repeat."""
    from fastapi.testclient import TestClient

    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.llm import build_model_engine
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.model import load_model
    from grserve.scheduler.fcfs import FCFSScheduler
    from grserve.server.llm.app import create_llm_app

    model = load_model("tiny", seed=0)
    tok = load_tokenizer("tiny", model.spec.vocab_size, model.spec.max_position_embeddings, tmp_path)
    eng = build_model_engine(model, FCFSScheduler(), num_blocks=128, block_size=8, prefix_cache_tokens=256,
                             eos_token_id=None, detokenize=tok.decode)
    loop = AsyncLLMEngine(eng, tok).start()
    try:
        app = create_llm_app(loop, tok, "m", model.spec.max_position_embeddings, model.spec.vocab_size)
        prompt = "The same long system prompt, shared by both requests. " * 2
        n_prompt = len(tok.encode(prompt))
        with TestClient(app) as c:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2, "temperature": 0}
            first = c.post("/v1/completions", json=body).json()["usage"]
            second = c.post("/v1/completions", json=body).json()["usage"]
            lines = c.post("/v1/completions", json={**body, "stream": True,
                                                    "stream_options": {"include_usage": True}}).text.splitlines()
        assert first["prompt_tokens"] == n_prompt and first["prompt_tokens_details"]["cached_tokens"] == 0
        assert second["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 8 * 8 > 0
        import json as _json

        usage = _json.loads([ln for ln in lines if ln.startswith("data: {")][-1][6:])["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == (n_prompt - 1) // 8 * 8
    finally:
        loop.stop()
