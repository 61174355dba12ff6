"""Issue 26 item 5: the retrieval engine is warm (every warm-up beam width × batch bucket has run once) before it
takes requests and before the server listens; a cluster start says per instance when it is ready; ``grserve bench
retrieval`` warms every beam width of every system before it times any."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from grserve.catalog import CatalogStore, generate_catalog
from grserve.config import AccelConfig, SchedulerConfig, SearchConfig
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.types import RetrievalRequest


@pytest.fixture()
def catalog():
    return generate_catalog(300, 3, 8, 1, 16)


def test_start_warms_every_beam_width_before_health_is_ok(tiny_model, catalog):
    model = tiny_model(seed=0)
    eng = RetrievalEngine(model, CatalogStore(catalog, vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=8, warmup_beam_widths="4,8,16"), warm=True)
    assert eng.health().status != "ok" and eng.warmup_runs is None
    eng.start()
    try:
        assert eng.health().status == "ok"
        assert [(r.beam_width, r.batch, r.prompt_tokens) for r in eng.warmup_runs] == [(4, 1, 48), (8, 1, 48),
                                                                                       (16, 1, 48)]
        assert all(r.seconds > 0 for r in eng.warmup_runs)
        assert eng.stats()["requests_done"] == 0  # the warm-up is not a request
    finally:
        eng.stop()
    cold = RetrievalEngine(model, CatalogStore(catalog), SearchConfig(beam_width=8)).start()  # warm=False
    try:
        assert cold.warmup_runs is None
    finally:
        cold.stop()


def test_the_device_path_captures_every_bucket_at_warm_up(tiny_model, catalog):
    """Fast path on CPU (eager): after start every (batch bucket ≤ max batch, beam width) has its bucket, and a
    request of a warmed shape builds none (its first batch pays no set-up)."""
    model = tiny_model(seed=0)
    accel = AccelConfig(fast_path="on", batch_buckets="1,2,4,8", prompt_bucket=64)
    eng = RetrievalEngine(model, CatalogStore(catalog, vocab_size=model.spec.vocab_size),
                          SearchConfig(beam_width=8, warmup_beam_widths="4,8"),
                          SchedulerConfig(max_batch_requests=4), accel=accel, warm=True).start()
    try:
        keys = set(eng.runner._buckets)
        assert {(k[0], k[1]) for k in keys} == {(r, bw) for r in (1, 2, 4) for bw in (4, 8)}
        assert {k[2] for k in keys} == {64}
        prompt = catalog.layout.sids_to_tokens(catalog.sids[:20])  # 60 tokens: the 64-token bucket
        res = eng.submit(RetrievalRequest(prompt, 8, 3)).future.result(timeout=120)
        assert len(res.items) == 3 and set(eng.runner._buckets) == keys
    finally:
        eng.stop()


def test_serve_listens_only_after_the_warm_up(monkeypatch, capsys):
    """``grserve serve``: the warm-up lines are printed and the engine is warm and started before uvicorn runs."""
    from grserve.config import CatalogConfig, ProcessConfig, ServeConfig
    from grserve.server.retrieval import command as retrieval_main
    from grserve.server.launch import serving

    seen = {}

    def fake_serve(app, host, port, log_level, stop):
        eng = app.state.engine
        seen.update(warm=eng.warmup_runs, status=eng.health().status)
        stop()
        return 0

    monkeypatch.setattr(serving, "serve_until_exit", fake_serve)
    cfg = ServeConfig(catalog=CatalogConfig(num_items=500, codebook_size=16),
                      search=SearchConfig(beam_width=8, warmup_beam_widths="2,8"),
                      process=ProcessConfig(engine_process=False))
    assert retrieval_main.run(cfg) == 0
    assert seen["status"] == "ok" and [r.beam_width for r in seen["warm"]] == [2, 8]
    out = capsys.readouterr().out
    assert "warm-up 1/2: beam width 2" in out and "warm-up 2/2: beam width 8" in out and "warmed up in" in out


def test_serve_with_an_engine_process_listens_only_after_its_warm_up(monkeypatch, capfd):
    """The same with the engine in its own process (the default): it warms up before its first heartbeat, so the
    front end is ready (and uvicorn runs) only after; the warm-up lines come from the engine process."""
    from grserve.config import CatalogConfig, ServeConfig
    from grserve.server.retrieval import command as retrieval_main
    from grserve.server.launch import serving

    seen = {}

    def fake_serve(app, host, port, log_level, stop):
        seen.update(status=app.state.engine.health().status, out=capfd.readouterr().out)
        stop()
        return 0

    monkeypatch.setattr(serving, "serve_until_exit", fake_serve)
    cfg = ServeConfig(catalog=CatalogConfig(num_items=500, codebook_size=16),
                      search=SearchConfig(beam_width=8, warmup_beam_widths="2,8"))
    assert retrieval_main.run(cfg) == 0
    out = seen["out"]
    assert seen["status"] == "ok"
    assert "warm-up 1/2: beam width 2" in out and "warm-up 2/2: beam width 8" in out and "warmed up in" in out


class _FakeRay(types.SimpleNamespace):
    """ray.wait / ray.get over refs that become ready at given wait calls; a ref may hold an error."""

    def __init__(self, ready_at: dict[int, int], errors: dict[int, Exception] | None = None):
        super().__init__()
        self.calls, self.ready_at, self.errors = 0, ready_at, errors or {}

    def wait(self, pending, num_returns=1, timeout=None):
        self.calls += 1
        ready = [r for r in pending if self.ready_at[r] <= self.calls][:num_returns]
        return ready, [r for r in pending if r not in ready]

    def get(self, ref):
        if ref in self.errors:
            raise self.errors[ref]
        return {"index": ref}


class _Actor:
    def __init__(self, i: int):
        self.info = types.SimpleNamespace(remote=lambda: i)


def test_cluster_start_reports_each_instance(monkeypatch):
    from grserve.cluster.core.start_progress import wait_ready

    monkeypatch.setitem(sys.modules, "ray", _FakeRay({0: 3, 1: 1, 2: 4}))
    lines: list[str] = []
    infos = wait_ready([_Actor(i) for i in range(3)], lines.append)
    assert infos == [{"index": 0}, {"index": 1}, {"index": 2}]  # actor order, not readiness order
    assert lines[0].startswith("starting 3 instance(s)")
    assert lines[1].startswith("instance 1 ready after") and lines[1].endswith("(1/3)")
    assert lines[2].startswith("still starting after") and lines[2].endswith("instance(s) 0, 2")
    assert lines[3].startswith("instance 0 ready") and lines[3].endswith("(2/3)")
    assert lines[4].startswith("instance 2 ready") and lines[4].endswith("(3/3)")
    monkeypatch.setitem(sys.modules, "ray", _FakeRay({0: 1, 1: 1}, {1: RuntimeError("engine build failed")}))
    with pytest.raises(RuntimeError, match="engine build failed"):
        wait_ready([_Actor(0), _Actor(1)], lines.append)


def test_bench_retrieval_warms_every_width_before_timing(monkeypatch, capsys):
    """Every system runs at every beam width inside the warm-up, and the first timed grserve run comes after it."""
    from grserve_bench import retrieval as bench

    events: list[tuple[str, int]] = []
    real_run, real_warm = bench.run_grserve, bench.warm_every_width

    def run_grserve(engine, prompts, bw, top_n):
        events.append(("grserve", bw))
        return real_run(engine, prompts, bw, top_n)

    def warm(bws, systems):
        events.append(("warm-start", 0))
        out = real_warm(bws, systems)
        events.append(("warm-end", 0))
        return out

    monkeypatch.setattr(bench, "run_grserve", run_grserve)
    monkeypatch.setattr(bench, "warm_every_width", warm)
    cfg = bench.RetrievalBenchConfig(num_items=300, codebook_size=8, prompt_len=24, beam_widths="4,8", requests=2,
                                     batch=2, naive_requests=1, skip_hf=True)
    assert bench.run(cfg) == 0
    end = events.index(("warm-end", 0))
    assert events[0] == ("warm-start", 0) and events[1:end] == [("grserve", 4), ("grserve", 8)]
    assert events[end + 1:] == [("grserve", 4), ("grserve", 8)]
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    import json

    warm_s = json.loads(summary)["warmup_s"]
    assert set(warm_s) == {"grserve", "grserve_batch", "naive"}
    assert all(set(per) == {"4", "8"} for per in warm_s.values())
    assert np.isfinite([v for per in warm_s.values() for v in per.values()]).all()
