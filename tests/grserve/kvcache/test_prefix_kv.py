"""Prompt-prefix KV cache in the LLM engine (kvcache/prefix_kv.py): cached tokens are not recomputed, outputs are
HF transformers' greedy tokens with and without the cache, under every scheduler, chunked prefills, memory
pressure (preemption + re-prefill) and eviction (LRU and LARU), and the store's slot bookkeeping stays exact."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from grserve.engine.llm import build_model_engine  # noqa: E402
from grserve.engine.sampling import SamplingParams  # noqa: E402
from grserve.kvcache.prefix_kv import PrefixKVStore  # noqa: E402
from grserve.scheduler.llm_factory import make_llm_scheduler  # noqa: E402

VOCAB, NEW = 300, 6  # VOCAB: the hf_qwen3 fixture's vocabulary (tests/conftest.py)


@pytest.fixture(scope="module")
def models(hf_qwen3):
    return hf_qwen3(kv_heads=2, seed=11)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Requests sharing prefixes of several lengths (a system prompt, and two few-shot headers on top of it)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(37)]
    shots = [system + [rng.randrange(3, VOCAB) for _ in range(11)] for _ in range(2)]
    out = []
    for i in range(8):
        head = system if i % 3 == 0 else shots[i % 2]
        out.append(head + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 9))])
    out.append(list(system))  # a prompt that is exactly a cached prefix: its last token is still computed
    return out


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
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("sched", ["fcfs", "chunked", "aptserve"])
def test_prefix_cache_matches_hf_one_request_at_a_time(models, want, sched):
    _, ours = models
    prompts = _prompts()
    eng = build_model_engine(ours, make_llm_scheduler(sched, token_budget=16, ttft_slo=1e9, tbt_slo=1e9),
                             num_blocks=256, block_size=4, prefix_cache_tokens=1024)
    got = [eng.generate([p], _params())[0] for p in prompts]  # sequential: every later request can hit
    assert got == want
    # cached tokens are not computed: every prompt after the first hits at least the 37-token system prompt
    assert eng.stats["prefix_hit_tokens"] >= 37 * (len(prompts) - 1)
    assert eng.stats["prefill_tokens"] + eng.stats["prefix_hit_tokens"] == sum(len(p) for p in prompts)
    eng.prefix_cache.check()
    assert eng.pool.num_free == eng.pool.num_blocks


def test_prefix_cache_batched_under_memory_pressure(models, want):
    """All at once in a pool too small for them: preempted requests re-prefill through the cache too (copy: the
    store is outside the pool). Sharing needs so few blocks here that FCFS never preempts: see
    test_shared_prefix.py for forced preemptions with sharing."""
    _, ours = models
    eng = build_model_engine(ours, make_llm_scheduler("fcfs"), num_blocks=60, block_size=4,
                             prefix_cache_tokens=1024, prefix_cache_mode="copy")
    got = eng.generate(_prompts(), _params())
    assert got == want
    assert eng.stats["preemptions"] > 0 and eng.stats["prefix_hit_tokens"] > 0
    eng.prefix_cache.check()


@pytest.mark.parametrize("policy", ["lru", "laru", "leader"])
def test_prefix_cache_under_eviction(models, want, policy):
    _, ours = models
    eng = build_model_engine(ours, make_llm_scheduler("fcfs"), num_blocks=256, block_size=4,
                             prefix_cache_tokens=60, prefix_cache_policy=policy,
                             prefix_cache_mode="copy")  # < two prompts' worth
    store = eng.prefix_cache
    got = []
    for p in _prompts():
        got += eng.generate([p], _params())
        store.check()
    assert got == want
    assert store.tree.stats["evicted_tokens"] > 0 and store.tree.size <= 60


def test_stored_kv_equals_recomputation(models):
    """The K/V copied into a request's blocks are the K/V it would have computed (fp32, 1e-5)."""
    _, ours = models
    p = _prompts()[1]
    rows = {}
    for cap in (0, 512):
        eng = build_model_engine(ours, make_llm_scheduler("fcfs"), num_blocks=128, block_size=4,
                                 prefix_cache_tokens=cap)
        if cap:
            eng.generate([p[:-3] + [5, 6, 7]], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        sid = eng.add_request(p, _params())
        eng.step()  # the prefill
        st = eng.executor.storage
        rows[cap] = st.data[:, st.row_index(eng.pool.table(sid), 0, len(p) - 3).flatten()].clone()
    torch.testing.assert_close(rows[512], rows[0], atol=1e-5, rtol=1e-5)


def test_hidden_requests_bypass_the_store(models):
    _, ours = models

    class AllHidden:
        name = "hidden"

        def schedule(self, inp):
            from grserve.scheduler.llm_types import ScheduledSeq, SchedulerOutput
            if inp.waiting:
                s = inp.waiting[0]
                return SchedulerOutput("prefill", [ScheduledSeq(s.seq_id, s.num_tokens, "hidden")])
            return SchedulerOutput("decode", [ScheduledSeq(s.seq_id, 1, s.cache) for s in inp.running])

    for mode in ("copy", "share"):
        eng = build_model_engine(ours, AllHidden(), num_blocks=256, block_size=4, prefix_cache_tokens=512,
                                 prefix_cache_mode=mode)
        eng.generate(_prompts()[:3], _params())
        pc = eng.prefix_cache
        assert eng.stats["prefix_hit_tokens"] == 0 and (pc.tree.size if mode == "copy" else len(pc.entries)) == 0


def test_store_slot_accounting_random():
    """Random inserts and matches on a bare store: tree invariants, no slot twice, free + used = capacity, and a
    matched prefix's values are exactly the K/V rows that were saved for it."""
    from grserve.kvcache.blocks import BlockPool, HybridCacheStorage

    rng = random.Random(5)
    pool = BlockPool(400, 4, kv_planes=2, hidden_planes=1)
    storage = HybridCacheStorage(pool, 2, 3, 3)
    store = PrefixKVStore.for_storage(storage, 50, "lru")
    bases = [[rng.randrange(0, 5) for _ in range(rng.randint(1, 20))] for _ in range(4)]
    for step in range(200):
        toks = rng.choice(bases) + [rng.randrange(0, 5) for _ in range(rng.randint(0, 10))]
        t = pool.reserve(("req", step), len(toks), "kv")
        for i in range(len(toks)):  # a token's K/V is a function of its prefix, as in a real model
            r = storage.row_index(t, i, i + 1)
            v = float(hash(tuple(toks[: i + 1])) % 997)
            storage.data[:, r[0]] = v
            storage.data[:, r[1]] = v + 0.5
        store.save(toks, storage, t)
        store.check()
        t2 = pool.reserve(("probe", step), len(toks), "kv")
        m = store.copy_in(store.match(toks + [0]), storage, t2)
        assert m <= len(toks)
        if m:  # what was just saved is (at least partly) there and copies back identically
            a = storage.data[:, storage.row_index(t, 0, m).flatten()]
            b = storage.data[:, storage.row_index(t2, 0, m).flatten()]
            assert torch.equal(a, b)
        pool.free(("req", step))
        pool.free(("probe", step))


def test_serve_llm_flags_build_a_prefix_cache():
    from grserve.cli import build_parser
    from grserve.cli import main as cli_main
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.server.llm.command import config_from_args

    cfg = config_from_args(build_parser().parse_args(["serve", "llm", "--model", "tiny", "--scheduler", "fcfs",
                                                      "--num-blocks", "64", "--prefix-cache-tokens", "256",
                                                      "--prefix-cache-policy", "laru"]))
    engine = AsyncLLMEngine.build(cfg)
    assert engine.prefix_cache is not None and engine.prefix_cache.capacity == 256
    assert engine.prefix_cache.policy.name == "laru"  # the default mode shares blocks
    assert cli_main(["serve", "llm", "--prefix-cache-tokens", "-1"]) == 2


def test_prefix_bench_reports_the_saving():
    from grserve_bench.serve import prefix_vs_none

    r = prefix_vs_none(requests=4, system_len=64, user_len=8, new_tokens=2, batch=2, repeats=1)
    assert r["same_tokens"]
    assert r["none"]["prefill_tokens"] == 4 * 72
    # the first wave's two requests are admitted together (nothing cached yet); the second wave hits 64 each
    assert r["prefix"]["prefill_tokens"] == 2 * 72 + 2 * 8
    assert r["prefix"]["prefix_hit_tokens"] == 2 * 64
    # the copying store holds its own copy of the prompt; shared blocks are the requests' own
    assert r["copy"]["prefix_hit_tokens"] == 2 * 64 and r["prefix"]["peak_blocks"] < r["copy"]["peak_blocks"]
