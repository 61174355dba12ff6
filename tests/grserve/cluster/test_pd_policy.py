"""The PD policy (cluster/llm/pd_policy.py): pools and their invariants, the flip rules, the split threshold, the
prefill/decode choices and the online TTFT fit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.cluster.llm.pd_policy import (
    InstanceSignals,
    PDCostModel,
    Role,
    RolePools,
    TPOTPredictor,
    TTFTPredictor,
    decide_flip,
    pick_decode,
    pick_prefill,
    should_split,
)
from grserve.config import PDConfig, SLOConfig

SLO = SLOConfig(ttft_slo_s=1.0, tpot_slo_s=0.1)


def _sig(q=0, reqs=0, toks=0, tpot=None):
    return InstanceSignals(queued_prefill_tokens=q, running_decode_requests=reqs, running_decode_tokens=toks,
                           recent_tpot_s=tpot, idle=(q == 0 and reqs == 0))


def _pools(n=4, p=2, dwell=0.0, k=1):
    return RolePools(n, p, PDConfig(min_dwell_s=dwell, min_per_role=k), now=0.0)


def test_pools_start_and_flip_back_home():
    pools = _pools(4, 2)
    assert [pools.pool(i) for i in range(4)] == ["P", "P", "D", "D"]
    assert pools.members(Role.PREFILL) == [0, 1] and pools.members(Role.DECODE) == [2, 3]
    assert pools.flip(2, 1.0) is Role.PREFILL and pools.pool(2) == "D->P"
    assert pools.flip(0, 1.0) is Role.DECODE and pools.pool(0) == "P->D"
    assert pools.flip(2, 2.0) is Role.DECODE and pools.pool(2) == "D"  # back home
    assert pools.flips == {"p_to_d": 2, "d_to_p": 1}
    assert [e[1:] for e in pools.log] == [(2, "D", "D->P"), (0, "P", "P->D"), (2, "D->P", "D")]
    with pytest.raises(ValueError):
        RolePools(3, 3, PDConfig(min_per_role=1), 0.0)


def test_dead_instances_neither_flip_nor_count_toward_min_per_role():
    """P = {0, 1}, D = {2, 3}: with 1 dead, 0 is the last live prefill instance and may not leave P; a dead
    instance may not flip; once 1 is back (a restart keeps its pool), 0 may flip again."""
    pools = _pools(4, 2)
    pools.set_alive(1, False)
    assert pools.live_members(Role.PREFILL) == [0] and pools.members(Role.PREFILL) == [0, 1]
    assert not pools.can_flip(0, 1.0) and not pools.can_flip(1, 1.0) and pools.can_flip(2, 1.0)
    with pytest.raises(ValueError, match="live"):
        pools.flip(0, 1.0)
    sig = {0: _sig(q=0), 1: _sig(q=0), 2: _sig(reqs=4, toks=400, tpot=1.0), 3: _sig(reqs=4, toks=400, tpot=1.0)}
    slo = SLOConfig(ttft_slo_s=10.0, tpot_slo_s=0.1)  # TPOT broken, prefill idle: P->D wanted, none may go
    assert decide_flip(pools, sig, TTFTPredictor(0.0, 0.0, 0.0), slo, PDConfig(), 1.0) is None
    pools.set_alive(1, True)
    assert decide_flip(pools, sig, TTFTPredictor(0.0, 0.0, 0.0), slo, PDConfig(), 1.0) == (0, Role.DECODE)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 7), k=st.integers(1, 3), dwell=st.floats(0, 3),
       steps=st.lists(st.tuples(st.integers(0, 6), st.floats(0, 2)), max_size=40))
def test_min_per_role_and_dwell_always_kept(n, k, dwell, steps):
    if 2 * k > n:
        return
    pools = RolePools(n, k, PDConfig(min_dwell_s=dwell, min_per_role=k), now=0.0)
    entered = [0.0] * n
    now = 0.0
    for i, dt in steps:
        i %= n
        now += dt
        allowed = pools.can_flip(i, now)
        assert allowed == (now - entered[i] >= dwell and len(pools.members(pools.role(i))) > k)
        if allowed:
            pools.flip(i, now)
            entered[i] = now
        else:
            with pytest.raises(ValueError):
                pools.flip(i, now)
        assert len(pools.members(Role.PREFILL)) >= k and len(pools.members(Role.DECODE)) >= k
        assert sorted(pools.members(Role.PREFILL) + pools.members(Role.DECODE)) == list(range(n))


def test_break_even_formula():
    cost = PDCostModel(prefill_tokens_per_s=8000.0, kv_bytes_per_token=800_000, transfer_bytes_per_s=25e9,
                       transfer_overhead_s=0.005)
    L = cost.break_even_tokens()
    assert L == math.ceil(0.005 / (1 / 8000 - 800_000 / 25e9))
    # at L the prefill time covers the transfer, one token less it does not
    assert L / 8000 >= cost.transfer_s(L) and (L - 1) / 8000 < cost.transfer_s(L - 1)
    assert cost.transfer_s(1000) == pytest.approx(0.005 + 1000 * 800_000 / 25e9)
    slow_link = PDCostModel(8000.0, 800_000, 1e9, 0.005)  # transfer per token slower than prefill: never split
    assert not should_split(10 ** 9, PDConfig(), slow_link)
    assert should_split(L, PDConfig(), cost) and not should_split(L - 1, PDConfig(), cost)
    assert should_split(7, PDConfig(split_min_tokens=7), slow_link)  # the flag wins


def test_ttft_predictor_recovers_quadratic():
    t = TTFTPredictor()
    a, b, c = 0.02, 3e-5, 4e-9
    for L in (64, 300, 900, 2000, 4096, 8000):
        t.observe(L, a + b * L + c * L * L)
    assert t.coef == pytest.approx((a, b, c), rel=1e-6)
    assert t.predict(1000, 500) == pytest.approx(b * 1000 + a + b * 500 + c * 500 ** 2)
    fresh = TTFTPredictor(a=0.1, b=1e-3)  # too few points: the prior
    fresh.observe(100, 5.0)
    assert fresh.coef == (0.1, 1e-3, 0.0)


def test_tpot_predictor_recovers_linear():
    t = TPOTPredictor()
    for bs, ctx in ((1, 100), (8, 5000), (32, 20000), (16, 2000), (4, 30000)):
        t.observe(bs, ctx, 0.015 + 1e-4 * bs + 2e-7 * ctx)
    assert t.predict(10, 10000) == pytest.approx(0.015 + 1e-3 + 2e-3, rel=1e-6)


@settings(max_examples=80, deadline=None)
@given(queues=st.lists(st.integers(0, 30000), min_size=2, max_size=6), p=st.integers(1, 5),
       L=st.integers(1, 8000), allow=st.booleans())
def test_if_any_instance_meets_ttft_the_chosen_one_does(queues, p, L, allow):
    n = len(queues)
    p = min(p, n - 1)
    pools = _pools(n, p)
    sig = {i: _sig(q=q) for i, q in enumerate(queues)}
    ttft = TTFTPredictor(a=0.01, b=5e-5, c=5e-9)
    chosen = pick_prefill(pools, sig, ttft, L, SLO, allow_decode_instances=allow)
    pred = {i: ttft.predict(q, L) for i, q in enumerate(queues)}
    candidates = range(n) if allow else pools.members(Role.PREFILL)
    if any(pred[i] <= SLO.ttft_slo_s for i in candidates):
        assert pred[chosen] <= SLO.ttft_slo_s
    if pools.role(chosen) is Role.DECODE:  # only when the prefill pool cannot meet the SLO
        assert min(pred[i] for i in pools.members(Role.PREFILL)) > SLO.ttft_slo_s
    else:
        assert pred[chosen] == min(pred[i] for i in pools.members(Role.PREFILL))


def test_pick_decode_stays_home_then_first_meeting_then_min():
    pools = _pools(4, 1)  # 0 P; 1, 2, 3 D
    sig = {0: _sig(q=100), 1: _sig(reqs=4, toks=900, tpot=0.05), 2: _sig(reqs=2, toks=300, tpot=0.2),
           3: _sig(reqs=3, toks=500, tpot=0.08)}
    assert pick_decode(pools, sig, SLO, prefill_instance=1) == 1  # in D and meets: no transfer
    assert pick_decode(pools, sig, SLO, prefill_instance=2) == 3  # 2 breaks; lightest meeting is 3 (500 < 900)
    assert pick_decode(pools, sig, SLO, prefill_instance=0) == 3
    for s in sig.values():
        s.recent_tpot_s = 0.5 if s.recent_tpot_s else None
    sig[2].recent_tpot_s = 0.3
    assert pick_decode(pools, sig, SLO, prefill_instance=0) == 2  # none meets: the least TPOT
    tp = TPOTPredictor(d0=0.01, d1=0.0, d2=1e-4)  # with a model: predicted TPOT after admitting 200 tokens
    assert pick_decode(pools, sig, SLO, 0, tpot=tp, context_tokens=200) == 2  # 0.01 + 0.05 ok; 3 needs 0.08 too
    assert pick_decode(pools, sig, SLO, 0, tpot=tp, context_tokens=800) == 2  # none meets: the least predicted


def test_flip_d_to_p_on_ttft_break_takes_lightest_from_p_to_d_first():
    pools = _pools(5, 2)  # 0, 1 P; 2, 3, 4 D
    pools.flip(1, 0.0)  # 1 -> P->D
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(q=20000), 1: _sig(reqs=5, toks=4000, tpot=0.05), 2: _sig(reqs=1, toks=100, tpot=0.05),
           3: _sig(reqs=2, toks=200, tpot=0.05), 4: _sig(reqs=3, toks=300, tpot=0.05)}
    # predicted TTFT of the only prefill instance: 2 s > 1 s
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (1, Role.PREFILL)
    pools2 = _pools(5, 2)
    pools2.flip(1, 0.0)
    pools2.flip(1, 0.0)  # back to P: P->D empty, prefill = {0, 1}
    sig[1] = _sig(q=20000)
    assert decide_flip(pools2, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (2, Role.PREFILL)  # lightest D
    # dwell not elapsed for anyone: nothing flips
    pools3 = RolePools(5, 2, PDConfig(min_dwell_s=5.0), now=0.0)
    assert decide_flip(pools3, sig, ttft, SLO, PDConfig(min_dwell_s=5.0), 1.0) is None
    assert decide_flip(pools2, sig, ttft, SLO, PDConfig(role_flips=False), 1.0) is None


def test_flip_p_to_d_on_tpot_break_takes_from_d_to_p_first():
    pools = _pools(5, 2)  # 0, 1 P; 2, 3, 4 D
    pools.flip(3, 0.0)  # 3 -> D->P
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(q=100), 1: _sig(q=50), 3: _sig(q=3000), 2: _sig(reqs=10, toks=9000, tpot=0.15),
           4: _sig(reqs=10, toks=9000, tpot=0.12)}
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (3, Role.DECODE)
    pools.flip(3, 1.0)  # back to D; now from P, the lightest (1)
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (1, Role.DECODE)
    sig[2].recent_tpot_s = sig[4].recent_tpot_s = sig[3].recent_tpot_s = 0.05  # TPOT fine, prefill busy
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) is None
    sig[0] = _sig()  # idle prefill instance while decodes run
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (0, Role.DECODE)
    quiet = {i: _sig() for i in range(5)}  # an idle cluster does not flip
    assert decide_flip(pools, quiet, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) is None


def test_flip_keeps_min_per_role():
    pools = _pools(3, 1)  # one prefill instance: P->D impossible even if TPOT breaks
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(), 1: _sig(reqs=10, toks=9000, tpot=0.5), 2: _sig(reqs=10, toks=9000, tpot=0.5)}
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) is None
    pools = _pools(4, 2, k=2)  # two per role: D->P impossible even if TTFT breaks
    sig = {0: _sig(q=50000), 1: _sig(q=50000), 2: _sig(reqs=1, toks=10), 3: _sig(reqs=1, toks=10)}
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0, min_per_role=2), 1.0) is None


def test_ttft_break_with_decode_instances_allowed_counts_every_instance():
    pools = _pools(4, 1)  # 0 P; 1, 2, 3 D
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(q=20000), 1: _sig(reqs=1, toks=100), 2: _sig(q=15000), 3: _sig(reqs=1, toks=100)}
    cfg = PDConfig(min_dwell_s=0.0)
    assert decide_flip(pools, sig, ttft, SLO, cfg, 1.0) == (1, Role.PREFILL)  # the prefill pool breaks the SLO
    # ... but instance 1 (a decode instance with no queue) could take the prefill in time: no flip needed
    assert decide_flip(pools, sig, ttft, SLO, cfg, 1.0, allow_decode_instances=True) is None
    sig[1].queued_prefill_tokens = sig[3].queued_prefill_tokens = 12000
    assert decide_flip(pools, sig, ttft, SLO, cfg, 1.0, allow_decode_instances=True) == (1, Role.PREFILL)


def test_memory_shortage_in_decode_pool_flips_p_to_d():
    pools = _pools(4, 2)
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(q=100), 1: _sig(q=200), 2: _sig(reqs=5, toks=900, tpot=0.03), 3: _sig(reqs=5, toks=900, tpot=0.03)}
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) is None
    sig[3].waiting_decode_requests = 2  # decodes wait for KV space: resource shortage
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0) == (0, Role.DECODE)


def test_prefill_slowdown_steers_the_prefill_choice():
    pools = _pools(3, 1)  # 0 P; 1, 2 D
    ttft = TTFTPredictor(a=0.0, b=1e-4)
    sig = {0: _sig(q=9000), 1: _sig(reqs=50, toks=40000), 2: _sig(reqs=5, toks=2000)}
    assert pick_prefill(pools, sig, ttft, 2000, SLO) == 1  # P breaks (1.1 s): the first decode instance meeting it
    sig[1].prefill_slowdown = 8.0  # instance 1 would prefill in tiny chunks between its 50 decodes
    assert pick_prefill(pools, sig, ttft, 2000, SLO) == 2
    sig[2].prefill_slowdown = 8.0
    assert pick_prefill(pools, sig, ttft, 2000, SLO) == 0  # nobody meets it: the prefill pool's best
    assert decide_flip(pools, sig, ttft, SLO, PDConfig(min_dwell_s=0.0), 1.0, 2000,
                       allow_decode_instances=True) == (2, Role.PREFILL)  # and a decode instance converts
