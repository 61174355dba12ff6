"""The PD simulation (bench/pd_simulator.py) and part 'sim' of ``grserve bench pd`` (bench/pd_sim.py)."""

from __future__ import annotations

import random

import pytest

from grserve_bench import pd_sim
from grserve_bench.pd_simulator import GPUCostModel, SimSetup, TraceShape, make_trace, simulate
from grserve.config import PDConfig, SLOConfig

COST = GPUCostModel.preset("llama2-13b", "a100-80gb")
SLO = SLOConfig(ttft_slo_s=1.5, tpot_slo_s=0.06)


def _setup(mode, p=2, n=4, dwell=2.0):
    return SimSetup(mode, n, p, pd=PDConfig(pd=True, prefill_instances=p, min_dwell_s=dwell), slo=SLO)


def test_cost_model_roofline_and_chunk_bound():
    # a decode step of 13B fp16 on an A100 reads the 26 GB of weights: memory-bound, ~16 ms + launch
    assert COST.decode_step_s(1, 100) == pytest.approx(0.003 + (26e9 + 100 * 819_200) / (0.8 * 2.039e12))
    # a long prefill is compute-bound: 2·params FLOP per token (+ attention)
    assert COST.prefill_s(4096) > 4096 * 26e9 / (0.6 * 312e12)
    assert COST.pd_cost().break_even_tokens() < 100  # a 25 GB/s link: splitting pays from tens of tokens
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 200)
        ctx, t = rng.randint(n, 3000 * n + 1), rng.uniform(0.005, 0.3)
        x = COST.max_chunk_within(n, ctx, t)
        assert x == 0 or COST.iteration_s(n, ctx, [(0, x)]) <= t
        assert COST.iteration_s(n, ctx, [(0, x + 1)]) > t


def test_traces_have_the_same_mix_and_bursts_are_bursts():
    shape = TraceShape()
    stable = make_trace("stable", 4.0, 240.0, shape, 1)
    bursty = make_trace("bursty", 4.0, 240.0, shape, 1)
    for tr in (stable, bursty):
        assert len(tr) == pytest.approx(960, rel=0.1)
        heavy = [r for r in tr if r.kind == "prompt_heavy"]
        assert len(heavy) / len(tr) == pytest.approx(0.5, abs=0.06)
        assert all(1500 <= r.prompt <= 4000 and 16 <= r.output <= 64 for r in heavy)
    on = shape.burst_duty * shape.burst_period_s
    assert all(r.arrival % shape.burst_period_s < on for r in bursty if r.kind == "prompt_heavy")


def test_static_pd_keeps_roles_and_every_request_finishes():
    reqs = make_trace("stable", 2.0, 30.0, TraceShape(), 3)
    res = simulate(_setup("static", p=1, n=3), COST, reqs, 200.0)
    assert not res.aborted and res.flips == {"p_to_d": 0, "d_to_p": 0}
    assert all(r.finish is not None for r in reqs)
    assert all(r.prefill_at == 0 and r.decode_at in (1, 2) for r in reqs)  # split: P prefills, D decodes
    assert res.transferred_tokens == sum(r.prompt for r in reqs)
    for r in reqs:  # no faster than alone on a GPU
        assert r.ttft >= COST.prefill_s(r.prompt) - 1e-9
        assert r.finish - r.first >= (r.output - 1) * COST.decode_step_s(1, r.prompt) - 1e-9


def test_dynamic_pd_flips_both_ways_within_pool_invariants():
    reqs = make_trace("bursty", 6.0, 90.0, TraceShape(), 0)  # past goodput: both pools under pressure
    res = simulate(_setup("dynamic", p=2, n=4, dwell=2.0), COST, reqs, 200.0, check_pools=True)
    assert res.flips["p_to_d"] >= 1 and res.flips["d_to_p"] >= 1
    assert res.pool_checks == res.flips["p_to_d"] + res.flips["d_to_p"]  # the invariants held after every flip
    assert all(r.finish is not None for r in reqs)
    # a request decodes on its prefill instance (no transfer) or its KV moved once
    moved = sum(r.prompt for r in reqs if r.decode_at != r.prefill_at and r.output > 1)
    assert res.transferred_tokens == moved


def test_colocated_never_transfers():
    reqs = make_trace("stable", 3.0, 30.0, TraceShape(), 2)
    res = simulate(_setup("colocated"), COST, reqs, 200.0)
    assert res.transferred_tokens == 0 and all(r.finish is not None for r in reqs)
    assert all(r.decode_at in (-1, r.prefill_at) for r in reqs)


def test_sim_part_runs_small():
    cfg = pd_sim.PartConfig(sim_instances=3, sim_duration_s=20.0, sim_drain_s=20.0, sim_grid_per_doubling=2,
                            sim_rate_lo=2.0)
    out = pd_sim.run_part(cfg)
    for key in ("goodput_dynamic_over_static_bursty", "goodput_dynamic_over_static_stable", "goodput_static_stable",
                "goodput_dynamic_bursty", "goodput_colocated_stable", "goodput_colocated_bursty",
                "sim_flips_bursty"):
        assert key in out
    assert out["sim_static_prefill_instances"] in (1, 2)
    best = out["goodput_static_by_prefill_instances"]["stable"]
    assert out["goodput_static_stable"] == max(best.values())
    assert out["sim_runs"] > 10
