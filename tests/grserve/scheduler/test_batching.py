"""GR batching by token capacity and SLO waiting quota: invariants under random arrivals."""

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.config import SchedulerConfig
from grserve.scheduler.gr_batching import GRBatcher


@dataclass
class Req:
    num_tokens: int
    beam_width: int
    arrival: float
    rid: int


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([16, 128]), st.floats(0, 0.01)), min_size=1, max_size=60))
def test_capacity_quota_and_exactly_once(reqs):
    cfg = SchedulerConfig(token_capacity=2048, max_batch_requests=8, slo_ms=100, wait_quota_fraction=0.1)
    b = GRBatcher(cfg, dispatch_when_idle=False)
    now, served = 0.0, []
    for i, (n, bw, gap) in enumerate(reqs):
        now += gap
        b.add(Req(n, bw, now, i))
        while (batch := b.pop_ready(now, idle_slots=1)) is not None:
            assert len(batch.requests) == 1 or batch.num_tokens <= cfg.token_capacity
            assert len(batch.requests) <= cfg.max_batch_requests
            assert {r.beam_width for r in batch.requests} == {batch.beam_width}
            if batch.reason == "quota":
                assert now - batch.requests[0].arrival >= cfg.wait_quota_ms / 1e3
            served += [r.rid for r in batch.requests]
    # drain: past every deadline everything leaves by quota
    now += 1.0
    while (batch := b.pop_ready(now, idle_slots=1)) is not None:
        served += [r.rid for r in batch.requests]
    assert sorted(served) == list(range(len(reqs)))
    assert len(b) == 0


def test_nothing_leaves_before_quota_without_idle_dispatch():
    cfg = SchedulerConfig(token_capacity=4096, slo_ms=200, wait_quota_fraction=0.1)
    b = GRBatcher(cfg, dispatch_when_idle=False)
    b.add(Req(100, 16, 0.0, 0))
    assert b.pop_ready(0.019, 1) is None
    assert abs(b.next_deadline() - 0.020) < 1e-9
    batch = b.pop_ready(0.020, 1)
    assert batch.reason == "quota" and len(batch.requests) == 1


def test_idle_dispatch_and_busy_slots():
    cfg = SchedulerConfig(token_capacity=4096)
    b = GRBatcher(cfg)
    b.add(Req(100, 16, 0.0, 0))
    assert b.pop_ready(0.0, idle_slots=0) is None  # no slot: keep waiting, batch grows
    b.add(Req(100, 16, 0.001, 1))
    batch = b.pop_ready(0.001, idle_slots=1)
    assert batch.reason == "idle" and [r.rid for r in batch.requests] == [0, 1]


def test_oversize_request_runs_alone():
    cfg = SchedulerConfig(token_capacity=1000)
    b = GRBatcher(cfg, dispatch_when_idle=False)
    b.add(Req(5000, 16, 0.0, 0))
    b.add(Req(10, 16, 0.0, 1))
    first = b.pop_ready(0.0, 1)
    assert [r.rid for r in first.requests] == [0] and first.reason == "capacity"
