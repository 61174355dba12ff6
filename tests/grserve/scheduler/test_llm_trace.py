"""``run_trace`` always terminates: idle policies let (virtual) time pass instead of spinning, a policy that never
schedules anything raises ``SchedulerStalled``, and every policy finishes random memory-bound traces — on the
simulated executor and on the real model (tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from grserve_bench.llm_workloads import TraceItem, make_trace
from grserve.engine.llm import LLMEngine, build_model_engine
from grserve_bench.simulator import (
    CostModel,
    SchedulerStalled,
    SimulatedExecutor,
    TimedExecutor,
    VirtualClock,
    run_trace,
)
from grserve.kvcache.blocks import BlockPool
from grserve.scheduler.fcfs import FCFSScheduler
from grserve.scheduler.llm_factory import make_llm_scheduler
from grserve.scheduler.llm_types import SchedulerOutput


class _Guard:
    """Wraps a policy; fails the test instead of hanging if it is asked too often."""

    def __init__(self, inner, limit: int = 200_000):
        self.inner, self.calls, self.limit = inner, 0, limit
        self.name = getattr(inner, "name", "guarded")

    def schedule(self, inp):
        self.calls += 1
        assert self.calls < self.limit, "run_trace did not terminate (livelock)"
        return self.inner.schedule(inp)


class _Patient:
    """Admits a waiting request only once it has waited ``delay`` seconds (time-dependent idling)."""

    name = "patient"

    def __init__(self, delay: float):
        self.delay = delay
        self.fcfs = FCFSScheduler()

    def schedule(self, inp):
        if inp.waiting and not inp.running and inp.now - inp.waiting[0].arrival < self.delay:
            return SchedulerOutput("idle")
        return self.fcfs.schedule(inp)


class _Never:
    name = "never"

    def schedule(self, inp):
        return SchedulerOutput("idle")


def _sim_engine(policy, num_blocks=64, clock=None):
    clock = clock or VirtualClock()
    pool = BlockPool(num_blocks, 16)
    return LLMEngine(_Guard(policy), pool, SimulatedExecutor(CostModel.opt13b_a100()), clock=clock), clock


def test_idle_policy_with_nothing_running_waits_for_time_not_spins():
    trace = [TraceItem(0.1 * i, 20, 5) for i in range(4)]  # the last request has no later arrival to jump to
    eng, clock = _sim_engine(_Patient(0.5))
    res = run_trace(eng, trace, clock)
    assert all(r.num_output == r.max_tokens for r in res.requests)
    assert res.requests[0].ttft >= 0.5 - 1e-9  # it really waited (time passed while idle)


def test_policy_that_never_schedules_raises():
    eng, clock = _sim_engine(_Never())
    with pytest.raises(SchedulerStalled):
        run_trace(eng, [TraceItem(0.0, 8, 4), TraceItem(1.0, 8, 4)], clock, max_stall_s=5.0)
    assert clock() >= 1.0  # it idled through the arrivals before giving up


@pytest.mark.parametrize("name", ["fcfs", "chunked", "aptserve", "aptserve-kv"])
@pytest.mark.parametrize("seed,cv", [(0, 1.0), (1, 3.0), (2, 1.0)])
def test_random_memory_bound_traces_terminate(name, seed, cv):
    trace = make_trace("sharegpt", 40, rate=8.0, cv=cv, seed=seed, scale=0.25)
    need = max(r.prompt_len + r.output_len for r in trace)
    pool = BlockPool(max(2 * -(-need // 16), 40), 16, kv_planes=2, hidden_planes=1)  # tight: memory binds
    clock = VirtualClock()
    pol = make_llm_scheduler(name, ttft_slo=0.5, tbt_slo=0.2, rho=1e-6, token_budget=64)
    eng = LLMEngine(_Guard(pol), pool, SimulatedExecutor(CostModel.opt13b_a100()), clock=clock)
    res = run_trace(eng, trace, clock)
    assert all(r.num_output == r.max_tokens for r in res.requests)
    if name == "aptserve-kv":
        assert res.stats["hidden_scheduled"] == 0
    pool.check()
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("name", ["fcfs", "chunked", "aptserve"])
def test_real_model_trace_terminates(name, one_thread, random_decoder):
    import dataclasses

    from grserve.model import PRESETS

    model = random_decoder(dataclasses.replace(PRESETS["tiny-mha"], vocab_size=512, num_hidden_layers=2), seed=0,
                           std=0.05)
    trace = make_trace("sharegpt", 6, rate=50.0, seed=3, scale=0.05)
    clock = VirtualClock()
    pol = make_llm_scheduler(name, ttft_slo=0.05, tbt_slo=0.01, rho=1e-7, token_budget=32)
    need = max(r.prompt_len + r.output_len for r in trace)
    real = build_model_engine(model, pol, num_blocks=2 * -(-need // 4) + 4, block_size=4)  # memory binds
    eng = LLMEngine(_Guard(pol), real.pool, TimedExecutor(real.executor), clock=clock)
    with torch.inference_mode():
        res = run_trace(eng, trace, clock)
    assert all(r.num_output == r.max_tokens for r in res.requests)
    assert real.pool.num_free == real.pool.num_blocks
