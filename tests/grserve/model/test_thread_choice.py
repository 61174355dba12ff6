"""``--threads 0``: the engine's torch thread count is measured at start-up (model/thread_choice.py) -- more
threads only when they are faster by more than the margin; an explicit count is kept; the probe runs the model's
own layer; ``serve llm`` builds its engine that way and names the choice."""

from __future__ import annotations

import pytest
import torch

from grserve.model.thread_choice import ThreadChoice, candidates, choose_threads, engine_threads, layer_probe


@pytest.fixture(autouse=True)
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


class FakeClock:
    """A probe whose duration depends on the thread count torch is set to; the timer reads this clock."""

    def __init__(self, cost: dict[int, float]):
        self.cost, self.now, self.seen = cost, 0.0, []

    def probe(self) -> None:
        n = torch.get_num_threads()
        self.seen.append(n)
        self.now += self.cost[n]

    def timer(self) -> float:
        return self.now


@pytest.mark.parametrize("cost,expected", [
    ({1: 1.0, 2: 0.5}, 2),    # twice as fast: worth its core
    ({1: 1.0, 2: 0.95}, 1),   # within the 10 % margin: the front end keeps its core
    ({1: 1.0, 2: 6.0}, 1),    # a loaded machine: the barrier waits for a descheduled thread
])
def test_more_threads_must_earn_their_core(cost, expected):
    clock = FakeClock(cost)
    choice = choose_threads(clock.probe, [2, 1], timer=clock.timer)
    assert choice.threads == expected
    assert torch.get_num_threads() == expected
    assert choice.probe_ms == pytest.approx({n: 1e3 * c for n, c in cost.items()})
    assert f"{expected} torch threads (measured" in choice.describe()


def test_candidates_are_timed_interleaved_and_alike():
    clock = FakeClock({1: 0.004, 2: 0.003})
    choose_threads(clock.probe, [1, 2], rounds=3, sample_s=0.012, timer=clock.timer)
    timed = clock.seen[4:]  # after the warm-up: 2 calls per count
    assert clock.seen[:4] == [1, 1, 2, 2]
    # one sample repeats the probe ~sample_s / fastest call (4 calls), the counts alternate round by round
    assert timed == ([1] * 4 + [2] * 4) * 3


def test_an_llm_engine_keeps_the_front_ends_core_unless_a_step_has_work_to_split(monkeypatch):
    """``serve llm`` passes ``FRONT_END_STEP_MS``: the probes measured on the dev VM -- the tiny preset at bf16
    (0.41 / 0.31 ms) and fp32 (0.69 / 0.43), 4 layers, and the medium shape (4.45 / 2.49 and 4.57 / 2.86 ms, the
    latter only 1.6x), 8 layers -- give tiny one thread and medium two; without the rule every one of them takes
    two (the plain 10 % margin), and a ratio threshold that rejects tiny's 1.6x rejects medium's 1.6x too."""
    from types import SimpleNamespace

    from grserve.model import thread_choice as tc

    monkeypatch.setattr(tc, "layer_probe", lambda model, packed: "probe")
    for layers, cost, served in ((4, {1: 0.41, 2: 0.31}, 1), (4, {1: 0.69, 2: 0.43}, 1),
                                 (8, {1: 4.45, 2: 2.49}, 2), (8, {1: 4.57, 2: 2.86}, 2)):
        model = SimpleNamespace(device=torch.device("cpu"), spec=SimpleNamespace(num_hidden_layers=layers))
        def fake(probe, counts, margin=0.1, c=cost):  # the 10 % margin's answer for these probes, as it sets it
            torch.set_num_threads(2)
            return ThreadChoice(2, c)

        monkeypatch.setattr(tc, "choose_threads", fake)
        assert tc.engine_threads(0, model, cores=2).threads == 2
        choice = tc.engine_threads(0, model, cores=2, min_step_ms=tc.FRONT_END_STEP_MS)
        assert choice.threads == served and torch.get_num_threads() == served
        assert ("the front end keeps its core" in choice.describe()) == (served == 1)
        # kept on one thread by the rule, its wide steps (prefill chunks) still take the cores the probe chose
        assert choice.wide_threads == (2 if served == 1 else 0)
    seen = []
    monkeypatch.setattr(tc, "engine_threads",
                        lambda *a, **kw: seen.append(kw) or ThreadChoice(1, {1: 1.0}, wide_threads=2))
    from grserve.config import LLMServeConfig, ModelConfig
    from grserve.engine.async_llm import AsyncLLMEngine

    eng = AsyncLLMEngine.build(LLMServeConfig(model=ModelConfig(source="tiny")), pick_threads=True)
    assert seen and seen[0].get("min_step_ms") == tc.FRONT_END_STEP_MS
    assert eng.core.executor.wide_threads == 2


def test_a_wide_step_runs_on_the_wide_threads_and_gives_them_back(tiny, monkeypatch):
    """A step of >= WIDE_STEP_TOKENS new tokens runs its forward on ``wide_threads``, a shorter one (and every
    step of a batch-invariant engine) on the engine's count, which every step leaves as it found it."""
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import thread_choice as tc
    from grserve.scheduler.fcfs import FCFSScheduler

    monkeypatch.setattr(tc, "WIDE_STEP_TOKENS", 24)
    monkeypatch.setattr("grserve.engine.llm.WIDE_STEP_TOKENS", 24)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 33)), list(range(5, 15))]  # a 30-token prefill (wide), a 10-token one
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for invariant in (False, True):
            def engine():
                return build_model_engine(tiny, FCFSScheduler(max_num_seqs=1), num_blocks=64, block_size=16,
                                          batch_invariant=invariant)

            want = engine().generate(prompts, sp)  # every step on one thread
            eng = engine()
            eng.executor.wide_threads = 2
            seen = []
            forward = tiny.forward

            def spy(ids, *a, **kw):
                seen.append((ids.shape[0], torch.get_num_threads()))
                return forward(ids, *a, **kw)

            with monkeypatch.context() as m:
                m.setattr(tiny, "forward", spy)
                got = eng.generate(prompts, sp)
            assert got == want
            wide = 1 if invariant else 2
            assert seen == [(30, wide), (1, 1), (10, 1), (1, 1)], seen
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_torch_threads_sets_the_count_inside_the_block_and_restores_it():
    from grserve.model.thread_choice import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with pytest.raises(RuntimeError), torch_threads(2):
            raise RuntimeError("the block failed")
        assert torch.get_num_threads() == 1
        for unset in (0, None):  # left as it is
            with torch_threads(unset):
                assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_one_candidate_is_not_timed():
    clock = FakeClock({1: 1.0})
    assert choose_threads(clock.probe, [1, 1], timer=clock.timer) == ThreadChoice(1, {}, "one candidate")
    assert clock.seen == []
    assert candidates(1) == [1] and candidates(2) == [1, 2] and candidates(16) == [15, 16]


@pytest.fixture(scope="module")
def tiny():
    from grserve.model import load_model

    return load_model("tiny")


def test_an_explicit_count_is_kept(tiny):
    choice = engine_threads(3, tiny, cores=2)
    assert choice.threads == 3 and torch.get_num_threads() == 3 and not choice.probe_ms


@pytest.mark.parametrize("packed", [True, False])
def test_the_probe_runs_the_models_first_layer(tiny, packed):
    assert layer_probe(tiny, packed, rows=5)().shape == (5, tiny.spec.hidden_size)  # the down projection's rows
    choice = engine_threads(0, tiny, packed, cores=2)
    assert choice.threads in (1, 2) and set(choice.probe_ms) == {1, 2}
    assert torch.get_num_threads() == choice.threads
    assert engine_threads(0, tiny, packed, cores=1).threads == 1


def test_serve_builds_its_engine_with_the_measured_count(monkeypatch):
    from grserve.config import LLMServeConfig, ModelConfig
    from grserve.engine.async_llm import AsyncLLMEngine

    cfg = LLMServeConfig(model=ModelConfig(source="tiny"))
    torch.set_num_threads(1)
    plain = AsyncLLMEngine.build(cfg)
    assert plain.thread_choice is None and torch.get_num_threads() == 1  # the caller's count stays
    monkeypatch.setattr("grserve.model.thread_choice.usable_cores", lambda: 2)
    picked = AsyncLLMEngine.build(cfg, pick_threads=True)
    assert picked.thread_choice.threads == torch.get_num_threads() and set(picked.thread_choice.probe_ms) == {1, 2}


def test_a_serving_engine_names_its_cpu_and_threads(tiny_model):
    """The retrieval and ranking start line (``--threads``): the CPU's label and the choice with its reason."""
    from grserve.model.thread_choice import serving_threads
    from grserve.model.cpu_support import cpu_support

    before = torch.get_num_threads()
    try:
        line = serving_threads(1, tiny_model(seed=0))
        assert line == f"CPU {cpu_support().label()}: 1 torch threads (--threads)" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _tasks() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def _wait_for(cond, timeout_s: float = 5.0) -> bool:
    import time

    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_release_frees_the_calling_threads_openmp_workers_and_the_next_region_makes_new_ones():
    """``release_openmp_pool`` ends the calling thread's OpenMP workers (one thread fewer per worker), results
    are unchanged, and the next parallel region starts a pool again."""
    import os

    from grserve.model.thread_choice import openmp_runtime, release_openmp_pool

    lib = openmp_runtime()
    if not os.path.isdir("/proc/self/task") or lib is None or not hasattr(lib, "omp_pause_resource_all"):
        pytest.skip("no OpenMP runtime with omp_pause_resource_all in this process (or no /proc)")
    torch.set_num_threads(3)
    x = torch.arange(1 << 22, dtype=torch.float32)

    def region() -> torch.Tensor:  # an elementwise op over 4M values: a parallel region of 3 threads
        return (x * 0.5).sum()

    want = region()
    with_pool = _tasks()
    assert release_openmp_pool()
    assert _wait_for(lambda: _tasks() <= with_pool - 2), (with_pool, _tasks())
    assert torch.equal(region(), want)
    assert _wait_for(lambda: _tasks() >= with_pool), (with_pool, _tasks())


def test_an_engine_releases_its_builders_pool_before_its_step_thread_starts(monkeypatch):
    """``AsyncLLMEngine.start`` (and a GR batcher's ``start``) release the OpenMP workers of the thread that built
    the engine, on that thread, before the step thread exists."""
    import threading

    from grserve.config import SchedulerConfig
    from grserve.engine import async_llm, batching
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.llm import build_model_engine
    from grserve.model import load_model
    from grserve.scheduler.fcfs import FCFSScheduler

    calls = []

    def record():
        calls.append((threading.current_thread().name, threading.enumerate()))
        return True

    monkeypatch.setattr(async_llm, "release_openmp_pool", record)
    monkeypatch.setattr(batching, "release_openmp_pool", record)
    eng = build_model_engine(load_model("tiny", seed=0), FCFSScheduler(), num_blocks=32, block_size=8)
    gr = batching.BatchingCore(lambda reqs: reqs, SchedulerConfig(max_batch_requests=1, max_inflight_batches=1),
                               "gr-test")
    for i, engine in enumerate([AsyncLLMEngine(eng, None), gr]):
        engine.start()
        try:
            assert len(calls) == i + 1
            name, alive = calls[i]
            assert name == threading.current_thread().name and engine._thread is not None
            assert engine._thread not in alive  # the step (batcher) thread did not exist yet
        finally:
            engine.stop()


def test_the_released_runtime_is_torchs_not_another_packages_copy():
    """scikit-learn and libCacheSim vendor their own libgomp (``<package>.libs/libgomp-<hash>.so``), loaded beside
    torch's: pausing theirs would leave torch's pool alone (a full test run loads them before this module)."""
    from grserve.model.thread_choice import torch_openmp_path

    site = "/venv/lib/python3.11/site-packages"
    others = [f"{site}/libcachesim.libs/libgomp-2af01464.so.1.0.0", f"{site}/scikit_learn.libs/libgomp-e985bcbb.so.1.0.0"]
    libs = [f"{site}/torch/lib/libtorch_cpu.so", f"{site}/numpy.libs/libscipy_openblas64_-ff651d7f.so"]
    assert torch_openmp_path(others + libs + [f"{site}/torch/lib/libgomp.so.1"], f"{site}/torch") == \
        f"{site}/torch/lib/libgomp.so.1"
    assert torch_openmp_path(others + [f"{site}/torch.libs/libgomp-a34b3233.so.1"], f"{site}/torch") == \
        f"{site}/torch.libs/libgomp-a34b3233.so.1"  # a repaired wheel's vendored copy
    system = "/usr/lib/x86_64-linux-gnu/libgomp.so.1"  # a torch that ships none links the system's
    assert torch_openmp_path(others + [system], f"{site}/torch") == system
    assert torch_openmp_path(others + libs, f"{site}/torch") is None


def test_fewer_threads_are_kept_only_when_a_second_timing_agrees():
    """A burst of another process during the first timing (the 2-thread samples slow) does not cost the engine
    its second thread; a machine that stays loaded (slow in both timings) keeps one thread; ``confirm=False``
    decides on the first timing."""
    def clock_with(first: float, later: float, rounds: int = 3) -> FakeClock:
        clock = FakeClock({1: 1.0, 2: first})
        calls = {"n": 0}
        probe = clock.probe

        def burst_then(n_first=4 + rounds * 2):  # warm-up (4 calls) and the first timing's 2-thread samples
            calls["n"] += 1
            if calls["n"] > n_first:
                clock.cost[2] = later
            probe()

        clock.probe = burst_then
        return clock

    burst = clock_with(first=0.97, later=0.5)
    assert choose_threads(burst.probe, [1, 2], rounds=3, sample_s=0, timer=burst.timer).threads == 2
    assert burst.seen.count(2) > 2 + 3  # a second timing ran
    loaded = clock_with(first=0.97, later=0.98)
    choice = choose_threads(loaded.probe, [1, 2], rounds=3, sample_s=0, timer=loaded.timer)
    assert choice.threads == 1 and torch.get_num_threads() == 1
    once = clock_with(first=0.97, later=0.5)
    assert choose_threads(once.probe, [1, 2], rounds=3, sample_s=0, timer=once.timer, confirm=False).threads == 1
