"""The LLM engine's inbox (``engine/async_llm.py``): one thread — the step loop — owns the core; other threads hand
it requests, cancels and calls, applied in order between two steps. So a submit, a cancel or ``stats()`` never waits
for a step in progress, and a message is applied at the latest by the iteration after the one in progress (counted
in engine iterations, so a loaded machine cannot make it flake). This replaces the FIFO engine lock, whose tests
asked the same of it: a busy step loop must not starve other threads (the unfair RLock before it let the loop take
the lock back a mean of 24 steps and up to 140 steps per acquisition on the 2-core VM)."""

from __future__ import annotations

import threading
import time

import pytest

from grserve.engine.async_llm import AsyncLLMEngine
from grserve.engine.llm import build_model_engine
from grserve.engine.protocol import EngineStopped, RequestCancelled
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest
from grserve.scheduler.llm_factory import make_llm_scheduler

LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


class _SlowExecutor:
    """The real executor, each step held until the test lets it go (a step in progress, as long as needed)."""

    def __init__(self, inner):
        self.inner, self.storage = inner, inner.storage
        self.in_step, self.go = threading.Event(), threading.Event()

    def execute(self, items, pool):
        self.in_step.set()
        self.go.wait(30)
        return self.inner.execute(items, pool)


def _engine(tiny_model, num_blocks=256):
    return build_model_engine(tiny_model(0), make_llm_scheduler("fcfs"), num_blocks=num_blocks, block_size=8)


def test_messages_never_wait_for_a_step_in_progress(tiny_model):
    """While one step is held: submit, cancel, stats and a call all return at once; the requests are applied
    (queued, cancelled) right after that step, and the call ran between steps."""
    core = _engine(tiny_model)
    slow = core.executor = _SlowExecutor(core.executor)
    eng = AsyncLLMEngine(core).start()
    try:
        running = eng.submit(LLMRequest(list(range(20, 60)), LONG))
        assert slow.in_step.wait(30)
        t0 = time.perf_counter()
        queued = eng.submit(LLMRequest(list(range(70, 90)), LONG))
        dropped = eng.submit(LLMRequest(list(range(90, 99)), LONG))
        assert eng.cancel(dropped.request_id)
        stats = eng.stats()
        seen = eng.call(lambda c: (c.iterations, [s.seq_id for s in c.waiting]))
        assert time.perf_counter() - t0 < 0.5 and not seen.done()  # nothing waited for the held step
        assert stats["running"] == 1 and eng.queue_depth == 2  # the first is in the step; two in the inbox
        slow.go.set()
        with pytest.raises(RequestCancelled):
            dropped.future.result(timeout=30)
        iterations, waiting = seen.result(timeout=30)
        assert iterations <= 2 and len(waiting) == 1  # applied after the held step: queued is waiting, dropped gone
        assert not running.future.done() and not queued.future.done()
    finally:
        slow.go.set()
        eng.stop()


def test_a_busy_loop_applies_messages_within_one_step(tiny_model):
    """Long generations keep the loop stepping; another thread posts 30 calls, one at a time: each runs at most
    one iteration after it was posted (two: a thread can be descheduled between reading the count and posting)."""
    core = _engine(tiny_model)
    eng = AsyncLLMEngine(core).start()
    handles = [eng.submit(LLMRequest(list(range(20 + i, 100 + i)), LONG)) for i in range(4)]
    try:
        while core.iterations < 5:
            time.sleep(0.005)
        lags = []
        for _ in range(30):
            i0 = core.iterations
            lags.append(eng.call(lambda c: c.iterations).result(timeout=30) - i0)
            time.sleep(0.001)
        assert not any(h.future.done() for h in handles), "the engine went idle: not a busy-engine test"
    finally:
        eng.stop()
    assert len(lags) == 30 and max(lags) <= 2, lags


def test_stop_answers_what_is_still_in_the_inbox(tiny_model):
    eng = AsyncLLMEngine(_engine(tiny_model))
    eng._status = "ok"  # accepting, no loop: the messages stay in the inbox
    h = eng.submit(LLMRequest(list(range(20, 30)), SamplingParams(max_tokens=2)))
    call = eng.call(lambda c: c.iterations)
    assert eng.queue_depth == 1 and eng.health().queue_depth == 1
    eng.stop()
    with pytest.raises(EngineStopped):
        h.future.result(timeout=1)
    with pytest.raises(EngineStopped):
        call.result(timeout=1)
    with pytest.raises(EngineStopped):
        eng.submit(LLMRequest([1, 2], SamplingParams(max_tokens=1)))
    with pytest.raises(EngineStopped):  # a call after the stop is answered too, never left waiting
        eng.call(lambda c: c.iterations).result(timeout=1)
    with pytest.raises(ValueError, match="never fits"):  # the fit is checked in the caller's thread, at once
        AsyncLLMEngine(_engine(tiny_model, num_blocks=4)).start().submit(
            LLMRequest(list(range(40)), SamplingParams(max_tokens=1)))
