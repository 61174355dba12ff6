"""The engine lock is fair (engine/fair_lock.py): a busy engine's step loop cannot starve other threads."""

from __future__ import annotations

import threading
import time

import pytest

from grserve.engine.async_llm import AsyncLLMEngine
from grserve.engine.fair_lock import FairRLock
from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest
from grserve.scheduler.llm_factory import make_llm_scheduler


def test_reentrant_and_owned():
    lock = FairRLock()
    with lock:
        with lock:
            assert lock.locked()
        assert lock.locked()
        got = []
        for kw in ({"timeout": 0.05}, {"blocking": False}):
            t = threading.Thread(target=lambda kw=kw: got.append(lock.acquire(**kw)))
            t.start()
            t.join()
        assert got == [False, False] and not lock._waiters  # a timed-out waiter leaves the queue
    assert not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


def test_granted_in_arrival_order_and_the_releaser_queues_behind():
    lock = FairRLock()
    order: list[str] = []
    lock.acquire()
    threads = []
    for name in "abc":
        t = threading.Thread(target=lambda n=name: (lock.acquire(), order.append(n), lock.release()))
        t.start()
        threads.append(t)
        while len(lock._waiters) < len(threads):  # each waits before the next one starts: a known order
            time.sleep(0.001)
    lock.release()
    lock.acquire()  # the releaser asks again at once: it comes after every thread already waiting
    order.append("owner")
    lock.release()
    for t in threads:
        t.join()
    assert order == ["a", "b", "c", "owner"]


def test_busy_engine_does_not_starve_other_threads(tiny_model):
    """Long generations keep the engine thread stepping; another thread takes the engine lock 30 times. Each
    acquisition waits for at most the step in progress (counted in engine iterations, so a loaded machine cannot
    make it flake) and for at most a few step times (measured here). The unfair RLock let the step loop take the
    lock back over and over (a mean of 24 steps per acquisition, 140 at worst, on the 2-core VM)."""
    core = build_model_engine(tiny_model(0), make_llm_scheduler("fcfs"), num_blocks=256, block_size=8)
    steps: list[float] = []
    step = core.step

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            steps.append(time.perf_counter() - t0)

    core.step = timed_step
    eng = AsyncLLMEngine(core).start()
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    handles = [eng.submit(LLMRequest(list(range(20 + i, 100 + i)), params)) for i in range(4)]
    try:
        while core.iterations < 5:
            time.sleep(0.005)
        waits: list[tuple[float, int]] = []

        def other_thread():
            for _ in range(30):
                i0, t0 = core.iterations, time.perf_counter()
                with core.lock:
                    waits.append((time.perf_counter() - t0, core.iterations - i0))
                time.sleep(0.001)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert not any(h.future.done() for h in handles), "the engine went idle: not a busy-engine test"
    finally:
        eng.stop()
    longest_step = max(steps[1:])  # the first step includes start-up work
    assert len(waits) == 30
    # at most the step in progress as it asked (2: a thread can be descheduled between reading the count and asking)
    assert max(n for _, n in waits) <= 2, waits
    assert max(w for w, _ in waits) <= 3 * longest_step, (waits, longest_step)


def test_stats_answer_while_a_step_holds_the_lock(tiny_model):
    """``stats()`` (``/health``, ``/metrics``, a cluster instance's poll = its heartbeat, all on an event loop)
    does not wait for the engine lock, which a step holds for a whole forward pass (a long prefill: seconds)."""
    core = build_model_engine(tiny_model(0), make_llm_scheduler("fcfs"), num_blocks=64, block_size=8)
    eng = AsyncLLMEngine(core)  # not started: nothing steps, the counts are exact
    eng._status = "ok"
    eng.submit(LLMRequest(list(range(20, 40)), SamplingParams(max_tokens=4)))
    held, done = threading.Event(), threading.Event()

    def step_in_progress():
        with core.lock:
            held.set()
            done.wait(30)

    holder = threading.Thread(target=step_in_progress)
    holder.start()
    held.wait(30)
    got: list[dict] = []
    asker = threading.Thread(target=lambda: got.append(eng.stats()), daemon=True)
    asker.start()
    asker.join(5)
    done.set()
    holder.join()
    assert got and got[0]["waiting"] == 1 and got[0]["waiting_online"] == 1 and got[0]["running_online"] == 0
