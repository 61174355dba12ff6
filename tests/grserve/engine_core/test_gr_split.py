"""Retrieval and ranking with the engine in its own process: the same answers as the engine on a thread; a catalog
reload and registered items reach the engine process in order, and a restarted engine process is sent them again
before it takes a request."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from grserve.catalog import generate_catalog
from grserve.config import (
    CatalogConfig,
    ModelConfig,
    RankingConfig,
    RankingDataConfig,
    RankingServeConfig,
    SearchConfig,
    ServeConfig,
)
from grserve.engine.types import RankingRequest, RetrievalRequest
from grserve.server.launch.processes import start_core


def _wait(cond, timeout_s=120.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _items(result):
    return [(it.item_id, round(it.score, 4)) for it in result.items]


def _restart(client):
    old = client.core.pid
    os.kill(old, signal.SIGKILL)
    _wait(lambda: client.state == "ok" and client.core is not None and client.core.pid != old)


def test_retrieval_same_answers_reload_and_restart():
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.command import retrieval_front_end

    cfg = ServeConfig(model=ModelConfig(source="tiny", seed=0), catalog=CatalogConfig(num_items=400, seed=3),
                      search=SearchConfig(beam_width=8, warmup=False))
    ref = RetrievalEngine.build(cfg).start()
    _, client, info = start_core("retrieval", cfg, 2, None)
    try:
        retrieval_front_end(cfg, client, info)
        rng = np.random.default_rng(0)
        prompts = [rng.integers(16, 800, size=n) for n in (5, 12, 30)]

        def both():
            for p in prompts:
                want = ref.submit(RetrievalRequest(p, 8, 5)).future.result(timeout=60)
                got = client.submit(RetrievalRequest(p, 8, 5)).future.result(timeout=60)
                assert _items(got) == _items(want) and got.catalog_version == want.catalog_version

        both()
        new = generate_catalog(400, 3, 256, seed=11)
        assert client.catalogs.replace(new) == 2 == ref.catalogs.replace(new)
        both()  # the reload reached the engine process before these requests
        _restart(client)
        both()  # the new engine process was sent the reload before its first request
        # /health reads the heartbeats: the first one of the new process may predate the replayed reload
        _wait(lambda: client.health().detail["catalog_version"] == 2, 10)
    finally:
        client.stop()
        ref.stop()


def test_ranking_same_answers_registrations_and_restart():
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.model import load_model
    from grserve.ranking.startup_data import build_registry
    from grserve.server.ranking.command import ranking_front_end

    cfg = RankingServeConfig(model=ModelConfig(source="tiny", seed=0), ranking=RankingConfig(policy="recompute"),
                             data=RankingDataConfig(num_items=40, num_users=6))
    model = load_model("tiny", dtype=cfg.model.dtype, seed=0)  # the dtype the engine process runs (default: auto)
    ref_reg = build_registry(cfg.data, model.spec.vocab_size)
    ref = RankingEngine(RankingRunner(model, ref_reg, cfg.ranking)).start()
    _, client, info = start_core("ranking", cfg, 2, None)
    try:
        ranking_front_end(cfg, client, info)
        reg = client.registry

        def req(r, k, ids):
            return RankingRequest(r.user_tokens(k % 6), [r.item_tokens(i) for i in ids], user_id=k % 6,
                                  item_ids=list(ids), now=0.0)

        def both(ids_list):
            for k, ids in enumerate(ids_list):
                want = ref.submit(req(ref_reg, k, ids)).future.result(timeout=120)
                got = client.submit(req(reg, k, ids)).future.result(timeout=120)
                assert got.order == want.order
                assert np.allclose(got.scores, want.scores, atol=1e-5)

        both([(0, 1, 2), (5, 9, 13, 21)])
        # a replaced item (new tokens) must reach the engine process: its KV is recomputed there
        tokens = np.asarray(list(reg.item_tokens(3)[:-1][::-1]) + [int(reg.item_tokens(3)[-1])])
        reg.add_item(3, tokens)
        ref_reg.add_item(3, tokens)
        both([(3, 4, 7)])
        _restart(client)
        both([(3, 4, 7), (0, 1, 2)])  # replayed to the new engine process
        _wait(lambda: client.runner.stats.requests >= 2, 10)
    finally:
        client.stop()
        ref.stop()


@pytest.mark.parametrize("mode", ["retrieval", "ranking"])
def test_help_names_the_process_flags(mode):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "grserve", "serve", mode, "--help"], capture_output=True, text=True,
                         timeout=60).stdout
    assert "--engine-process" in out and "--engine-restarts" in out
    assert ("--api-servers" in out) == (mode == "retrieval")


def test_the_log_replays_a_bound_catalog_at_the_front_ends_version():
    """Issue 41's cause: a catalog whose binding makes a copy (SID tokens resolved) reached the log with the copy's
    source, whose own version is 0; the replay must carry the version the front end serves it at."""
    from grserve.catalog import CatalogStore
    from grserve.cluster.gr.broadcast_log import BroadcastLog
    from grserve.cluster.gr.state_change import BroadcastCatalogStore, apply_change

    bind = lambda c: c.with_layout(c.layout)  # a copy at version 0, as bind_catalog's with_layout makes  # noqa: E731
    log = BroadcastLog()
    front = BroadcastCatalogStore(generate_catalog(50, 3, 16, seed=1), 4096, lambda ch: [log.record(ch)], bind)
    for seed in (2, 3):
        front.replace(generate_catalog(50, 3, 16, seed=seed))
    assert log.generation == 2

    class Engine:
        catalogs = CatalogStore(generate_catalog(50, 3, 16, seed=1), 4096, bind)

    assert log.replay(lambda ch: apply_change(Engine, ch)) == 1
    assert Engine.catalogs.version == front.version == 3
    np.testing.assert_array_equal(Engine.catalogs.current().item_ids, front.current().item_ids)
    assert log.replay(lambda ch: apply_change(Engine, ch)) == 1 and Engine.catalogs.version == 3  # idempotent


def test_a_core_that_refuses_the_recorded_state_never_serves():
    """A restarted core that cannot take a recorded change is fenced, never put in service (503 with the reason),
    and the supervisor gives up after its budget; requests are refused all along, never answered from the flags'
    state."""
    from grserve.cluster.wire import CatalogReplace
    from grserve.engine.protocol import EngineStopped
    from grserve.server.retrieval.command import retrieval_front_end

    cfg = ServeConfig(model=ModelConfig(source="tiny", seed=0), catalog=CatalogConfig(num_items=400, seed=3),
                      search=SearchConfig(beam_width=8, warmup=False))
    sup, client, info = start_core("retrieval", cfg, 1, None)
    try:
        retrieval_front_end(cfg, client, info)
        client.log.record(CatalogReplace(generate_catalog(400, 3, 99_999, seed=4), 7))  # beyond the vocab: refused
        os.kill(client.core.pid, signal.SIGKILL)
        _wait(lambda: client.state != "ok", 30)  # the death noticed
        deadline = time.monotonic() + 180
        while client.gave_up is None:
            assert time.monotonic() < deadline, "the supervisor did not give up"
            assert client.state != "ok", "a core that refused the recorded state was put in service"
            time.sleep(0.01)
        assert client.state == "stopped" and sup.incarnation == 2
        with pytest.raises(EngineStopped):
            client.submit(RetrievalRequest(np.arange(16, 30), 8, 5))
        assert "refused a recorded state change" in (client.catch_up_error or "")
    finally:
        client.stop()


def test_several_front_ends_refuse_catalog_reloads(tmp_path, capsys):
    """A reload reaches the one front end that took it; with --api-servers 2 the other would validate against the
    old catalog while the engine serves the new one, so the combination is refused before anything starts."""
    from grserve.cli import main

    assert main(["serve", "retrieval", "--api-servers", "2", "--catalog-dir", str(tmp_path)]) == 2
    assert "--api-servers > 1 with --catalog-dir" in capsys.readouterr().err


def test_an_answer_from_an_older_catalog_is_a_503_never_a_normal_answer():
    """The retrieval routes' last guard: an engine behind its front end's catalog answers 503 with Retry-After; a
    newer catalog (a reload that landed meanwhile) and an unreported version (0: a stand-in engine) pass."""
    from types import SimpleNamespace

    from grserve.inputs.refusal import ApiError
    from grserve.server.http.lifecycle import check_catalog_version

    front = SimpleNamespace(version=3)
    for served in (3, 4, 0):
        result = SimpleNamespace(catalog_version=served)
        assert check_catalog_version(result, front) is result
    with pytest.raises(ApiError) as exc:
        check_catalog_version(SimpleNamespace(catalog_version=2), front)
    assert exc.value.status == 503 and exc.value.type == "engine_state_behind"
    assert exc.value.headers == {"Retry-After": "1"}
