"""Apt-Serve decode iterations: a running request is kept in the cache kind it holds or preempted, never
"switched" — a switch is a preemption (discard + re-prefill), so the decode greedy must not value it as if the
request ran. Before the fix, every freshly prefilled hidden request (p = 0 < 2Nρm, so hidden "forbidden") was
preempted by the very next decode, re-prefilled, got one token, and was preempted again (docs/llm.md)."""

from __future__ import annotations

import random

from grserve.scheduler.aptserve import AptServeScheduler
from grserve.scheduler.llm_types import PoolView, SchedulerInput, SeqView


def _running(i, now, tokens, last, cache, pool):
    return SeqView(i, 0.0, last, tokens, tokens - 1, 1, cache, pool.blocks_for(tokens - 1, cache))


def test_fresh_hidden_request_is_kept_by_the_next_decode():
    pool = PoolView(100, 60, 16)
    pol = AptServeScheduler(ttft_slo=1.0, tbt_slo=1.0, rho=1e-3)
    now = 5.0
    r = (_running(0, now, 100, now - 0.05, "kv", pool), _running(1, now, 100, now - 0.05, "kv", pool),
         _running(2, now, 160, now, "hidden", pool))  # 2 was just (re-)prefilled into hidden cache: p = 0
    out = pol.schedule(SchedulerInput(now, (), r, pool))
    assert out.kind == "decode" and out.preempted == []
    assert {(s.seq_id, s.cache) for s in out.scheduled} == {(0, "kv"), (1, "kv"), (2, "hidden")}


def test_hidden_holder_costs_hidden_blocks_under_pressure():
    # 3 KV requests of 4 tokens (2 blocks each) + a hidden one of 4 tokens (1 block); 7 blocks total: keeping all
    # needs 7 (fits) — as KV the hidden one would need 8 and one request would be dropped.
    pool = PoolView(7, 0, 4)
    pol = AptServeScheduler(ttft_slo=10.0, tbt_slo=10.0, rho=1e-3)
    now = 1.0
    r = tuple(_running(i, now, 4, 0.5, "kv", pool) for i in range(3)) + (_running(3, now, 4, 0.5, "hidden", pool),)
    out = pol.schedule(SchedulerInput(now, (), r, pool))
    assert out.preempted == [] and len(out.scheduled) == 4


def test_decode_never_switches_kinds_random():
    rng = random.Random(1)
    for _ in range(300):
        pool = PoolView(rng.randint(4, 80), 0, 4)
        pol = AptServeScheduler(ttft_slo=1.0, tbt_slo=rng.choice([0.05, 1.0]), rho=rng.choice([0.0, 1e-4, 1e-2]),
                                demotion=rng.choice(["near_zero", "decay"]))
        now = 10.0
        r = tuple(_running(i, now, rng.randint(2, 40), now - rng.uniform(0, 0.2), rng.choice(["kv", "hidden"]),
                           pool) for i in range(rng.randint(1, 8)))
        out = pol.schedule(SchedulerInput(now, (), r, pool))
        held = {s.seq_id: s.cache for s in r}
        assert out.kind == "decode"
        assert all(x.cache == held[x.seq_id] for x in out.scheduled)
        assert {x.seq_id for x in out.scheduled} | set(out.preempted) == set(held)
        kept = [s for s in r if s.seq_id not in out.preempted]
        assert sum(pool.blocks_for(s.num_tokens, s.cache) for s in kept) <= pool.total_blocks


def test_decode_does_not_keep_one_request_by_preempting_the_rest():
    """Algorithm 1's double check (V′: the break request alone) belongs to the prefill greedy only (Repo). In a
    decode it preempted every running request but one whenever that one's pending time outweighed the rest:
    in the OPT-13B simulation 20 such decodes made 44 % of all preemptions (docs/llm.md)."""
    pool = PoolView(20, 0, 4)  # KV: 2 blocks (K, V) per 4 tokens
    pol = AptServeScheduler(ttft_slo=100.0, tbt_slo=100.0, rho=0.0)
    now = 10.0
    big = _running(0, now, 32, now - 0.35, "kv", pool)  # 16 blocks, value 0.35, θ = 0.022 per block
    small = tuple(_running(i, now, 8, now - 0.1, "kv", pool) for i in range(1, 4))  # 4 blocks, θ = 0.025 each
    # greedy: the three small ones (12 blocks, value 0.3), then the big one does not fit (28 > 20) and alone it
    # is worth more (0.35 > 0.3): the prefill rule would keep it and preempt the three others
    out = pol.schedule(SchedulerInput(now, (), (big,) + small, pool))
    assert out.kind == "decode"
    assert out.preempted == [0]
    assert sorted(x.seq_id for x in out.scheduled) == [1, 2, 3]


def test_decode_keeps_a_maximal_set_random():
    """Nobody is preempted who would still fit next to the kept ones (no break in the keeping greedy)."""
    rng = random.Random(7)
    for _ in range(300):
        pool = PoolView(rng.randint(4, 60), 0, 4)
        pol = AptServeScheduler(ttft_slo=1.0, tbt_slo=rng.choice([0.05, 1.0]), rho=rng.choice([0.0, 1e-4]),
                                demotion=rng.choice(["near_zero", "decay"]))
        now = 10.0
        r = tuple(_running(i, now, rng.randint(2, 40), now - rng.uniform(0, 2.0), rng.choice(["kv", "hidden"]),
                           pool) for i in range(rng.randint(1, 10)))
        out = pol.schedule(SchedulerInput(now, (), r, pool))
        kept = [s for s in r if s.seq_id not in out.preempted]
        used = sum(pool.blocks_for(s.num_tokens, s.cache) for s in kept)
        assert used <= pool.total_blocks
        for s in r:
            if s.seq_id in out.preempted:
                assert used + pool.blocks_for(s.num_tokens, s.cache) > pool.total_blocks


def test_keeping_greedy_accounts_like_its_choices_random():
    """``greedy(keeping=True)`` skips what does not fit; an upgrade is only taken on top of its own hidden step,
    so the booked memory and value are exactly those of the chosen kinds."""
    from grserve.scheduler.knapsack import Candidate, greedy

    rng = random.Random(3)
    for _ in range(500):
        cands = []
        for i in range(rng.randint(1, 8)):
            c_kv = 2 * rng.randint(1, 8)
            p = rng.uniform(0, 2)
            if rng.random() < 0.5:
                cands.append(Candidate(i, p, c_kv, p - rng.uniform(0, 1), c_kv // 2))
            else:
                cands.append(Candidate(i, p, c_kv))
        budget = rng.randint(1, 40)
        sol = greedy(cands, budget, keeping=True)
        by = {c.req: c for c in cands}
        cost = sum(by[r].cost_kv if k == "kv" else by[r].cost_hidden for r, k in sol.choice.items())
        value = sum(by[r].value_kv if k == "kv" else by[r].value_hidden for r, k in sol.choice.items())
        assert cost == sol.used <= budget
        assert abs(value - sol.value) < 1e-9
