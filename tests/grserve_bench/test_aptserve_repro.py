"""Issue 17, the paper-scale reconstruction: the authors' length filter, the client's attainment rule, the cost
models' anchor and shapes, the OPT-13B/A100 KV memory, vLLM FCFS's watermark and the hybrid FCFS, the pending
time since last scheduling (engine bookkeeping + iteration type), the thread-CPU timer, and the effective-
throughput search (deterministic). All small: 30-request traces."""

from __future__ import annotations

import time

import numpy as np
import pytest

from grserve_bench.aptserve_repro import Runner, Setting, kv_blocks_opt13b_a100, trace_for
from grserve_bench.llm_workloads import LENGTH_DISTRIBUTIONS, attainment, make_trace, p99, sample_lengths
from grserve_bench.simulator import (
    CostModel,
    RequestRecord,
    SimulatedExecutor,
    TimedExecutor,
    VirtualClock,
)
from grserve.engine.llm import LLMEngine
from grserve.engine.sampling import SamplingParams
from grserve.kvcache.blocks import BlockPool
from grserve.scheduler.aptserve import AptServeScheduler
from grserve.scheduler.fcfs import FCFSScheduler
from grserve.scheduler.llm_types import PoolView, SchedulerInput, SeqView


@pytest.mark.parametrize("dataset", ["sharegpt", "humaneval", "longbench"])
def test_lengths_obey_the_authors_filter(dataset):
    rng = np.random.default_rng(0)
    p, o = sample_lengths(lambda k, g: LENGTH_DISTRIBUTIONS.create(dataset, k, g), 20_000, rng)
    assert len(p) == len(o) == 20_000
    assert p.min() >= 4 and o.min() >= 4 and (p + o).max() <= 2048


def test_sharegpt_filtered_means_match_vllm_filter_totals():
    # vLLM's filter on ShareGPT_V3, 1,000 requests: ≈ 230-246 prompt / 196-203 output tokens per request
    rng = np.random.default_rng(1)
    p, o = sample_lengths(lambda k, g: LENGTH_DISTRIBUTIONS.create("sharegpt", k, g), 50_000, rng)
    assert 225 <= p.mean() <= 265 and 185 <= o.mean() <= 210
    assert np.median(o) < o.mean()  # right-skewed, as chat answers are


def test_trace_lengths_do_not_depend_on_rate():
    a, b = make_trace("sharegpt", 50, 1.0, seed=3), make_trace("sharegpt", 50, 7.0, seed=3)
    assert [(x.prompt_len, x.output_len) for x in a] == [(x.prompt_len, x.output_len) for x in b]
    assert a[-1].arrival > b[-1].arrival


def test_client_attainment_rule():
    one = RequestRecord(0.0, 10, 1, token_times=[0.5])  # ≤ 1 output token: P99 = 0
    tied = RequestRecord(0.0, 10, 3, token_times=[1.0, 1.5, 2.0])  # TTFT exactly at the SLO
    slow = RequestRecord(0.0, 10, 3, token_times=[0.2, 0.3, 1.9])  # a 1.6 s gap
    assert p99(one.tbts) == 0.0
    assert attainment([one, tied, slow], 1.0, 1.0)["attainment"] == pytest.approx(2 / 3)
    strict = attainment([one, tied, slow], 1.0, 1.0, strict=True)  # TTFT < SLO and P99 < SLO
    assert strict["attainment"] == pytest.approx(1 / 3) and strict["tbt_attainment"] == pytest.approx(2 / 3)


class _It:
    def __init__(self, start, num_new, kind="kv"):
        self.start, self.num_new, self.kind = start, num_new, kind


def test_cost_models_share_the_anchor_and_differ_in_shape():
    batch = lambda b: [_It(349, 1)] * b  # noqa: E731 - 50 decodes at 350 tokens of context
    lin, roof, phys = (CostModel.preset(n) for n in ("linear", "roofline", "physical"))
    assert roof.iteration_time(batch(50)) == pytest.approx(0.120, abs=1e-6)
    assert 0.10 < lin.iteration_time(batch(50)) < 0.13
    assert 0.03 < phys.iteration_time(batch(50)) < 0.06
    # linear grows with the batch almost proportionally; roofline and physical are memory-bound
    assert lin.iteration_time(batch(100)) / lin.iteration_time(batch(50)) > 1.6
    assert roof.iteration_time(batch(100)) / roof.iteration_time(batch(50)) < 1.2
    assert phys.iteration_time(batch(100)) / phys.iteration_time(batch(50)) < 1.5
    # physical overlaps compute with the weight read: one short hidden request is nearly free, a long one is not
    base = batch(10)
    short = phys.iteration_time(base + [_It(60, 1, "hidden")]) - phys.iteration_time(base + [_It(60, 1)])
    long = phys.iteration_time(base + [_It(1900, 1, "hidden")]) - phys.iteration_time(base)
    assert short <= 1e-6 and long > 0.01


def test_kv_memory_of_opt13b_on_a100():
    # (0.9 × 39.59 GiB − 26 GB − 0.75 GB) / 819,200 B per token = 14,038 tokens → 877 vLLM blocks → 1,754 planes
    assert kv_blocks_opt13b_a100() == 1754
    assert kv_blocks_opt13b_a100(utilization=0.8) < 1754


def _view(sid, *, arrival=0.0, last=None, n=32, cache=None, held=0, sched=None):
    return SeqView(sid, arrival, last, n, 0 if cache is None else n - 1, 0 if last is None else 1, cache, held,
                   last_scheduled=sched)


def test_fcfs_watermark_and_hybrid_admission():
    pool = PoolView(total_blocks=100, free_blocks=5, block_size=16)
    w = (_view(0, n=64),)  # KV needs 8 blocks, hidden 4
    assert FCFSScheduler().schedule(SchedulerInput(1.0, w, (), pool)).kind == "idle"
    plan = FCFSScheduler(cache="hybrid").schedule(SchedulerInput(1.0, w, (), pool))
    assert [(x.seq_id, x.cache) for x in plan.scheduled] == [(0, "hidden")]
    roomy = PoolView(total_blocks=100, free_blocks=9, block_size=16)
    assert FCFSScheduler(cache="hybrid").schedule(SchedulerInput(1.0, w, (), roomy)).scheduled[0].cache == "kv"
    assert FCFSScheduler(watermark=0.02).schedule(SchedulerInput(1.0, w, (), roomy)).kind == "idle"  # 9 − 2 < 8


def test_pending_since_scheduled_iteration_type():
    pool = PoolView(total_blocks=100, free_blocks=50, block_size=16)
    # right after a 40 ms decode: last token at now (p = 0), last scheduled 40 ms ago
    running = tuple(_view(i, last=10.0, cache="kv", held=4, sched=9.96) for i in range(10))
    waiting = (_view(99, arrival=9.9),)  # waited 100 ms
    inp = SchedulerInput(10.0, waiting, running, pool)
    assert AptServeScheduler.iteration_type(inp, "last_token") == "prefill"  # Σ_R p = 0 loses to anything
    assert AptServeScheduler.iteration_type(inp, "last_scheduled") == "decode"  # 10 × 40 ms > 100 ms
    late = (_view(99, arrival=9.0),)  # waited 1 s: now the prefill is more urgent
    assert AptServeScheduler.iteration_type(SchedulerInput(10.0, late, running, pool), "last_scheduled") == "prefill"


def test_engine_records_last_scheduling_time():
    clock = VirtualClock()
    cost = CostModel.preset("physical")
    eng = LLMEngine(AptServeScheduler(pending="last_scheduled"), BlockPool(64, 16), SimulatedExecutor(cost),
                    clock=clock)
    sid = eng.add_request([5] * 40, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), arrival=0.0)
    eng.step()  # prefill
    seq = eng.seqs[sid]
    t_prefill_end = clock()
    assert seq.last_scheduled == 0.0 and seq.token_times == [t_prefill_end]
    eng.step()  # decode
    view = eng.scheduler_input().running[0]
    assert view.last_scheduled == t_prefill_end
    assert view.pending(clock()) == 0.0  # the paper's words: time since the last token
    assert clock() > t_prefill_end
    assert view.pending_since_scheduled(clock()) == pytest.approx(clock() - t_prefill_end)


class _Sleepy:
    storage = None

    def execute(self, items, pool):
        time.sleep(0.05)
        return None, None


def test_thread_timer_ignores_time_off_cpu():
    assert TimedExecutor(_Sleepy(), "wall").execute([], None)[1] >= 0.05
    assert TimedExecutor(_Sleepy(), "thread").execute([], None)[1] < 0.02


def test_effective_throughput_search_is_deterministic_and_ordered():
    s = Setting(num_requests=30)
    a, b = Runner(), Runner()
    ra = a.crossings(s, "longbench", "fcfs", steps=1)
    rb = b.crossings(s, "longbench", "fcfs", steps=1)
    assert ra == rb and ra[0.9] <= ra[0.6]
    assert a.cache == b.cache
    early = trace_for(s.replace(eos_scale=0.5), "longbench", 1.0, 1.0)
    full = trace_for(s, "longbench", 1.0, 1.0)
    assert all(e.output_len <= f.output_len for e, f in zip(early, full))
    assert sum(e.output_len for e in early) < sum(f.output_len for f in full)
