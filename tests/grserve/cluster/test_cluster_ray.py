"""The cluster on a real local Ray: three instance actors of a small random model behind ``ClusterLLMEngine``.

Ray and the actors start once for the module (about 20-30 s on a shared 2-core machine). The tests run in order
and use the instances up: routing and equality with one engine, the HTTP app and its metrics, then a kill by PID
(SIGKILL) of an instance holding requests mid-prefill and mid-decode, a frozen instance (SIGSTOP) fenced by the
heartbeat timeout, and the last instance's death failing its request with a 503-class ``RequestLost``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from cluster_fixtures import HEARTBEAT_S, consume, one_engine, running_cluster, save_random_model  # noqa: E402
from grserve.cluster.core.recovery import RequestLost  # noqa: E402
from grserve.config import LLMConfig, LLMServeConfig, ModelConfig  # noqa: E402
from grserve.engine.sampling import SamplingParams  # noqa: E402
from grserve.engine.types import LLMRequest  # noqa: E402

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
# long enough that no request can finish before the kill tests have seen every request mid-decode with its KV
# snapshot (an export waits for the step in progress: the engine lock is FIFO; on a loaded machine steps are slow)
LONG = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=300, temperature=0.9, seed=7, ignore_eos=True)
RESULTS: dict[str, list] = {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, random_decoder):
    return save_random_model(tmp_path_factory, random_decoder, "cluster-model", seed=3)


@pytest.fixture(scope="module")
def cfg(model_dir):
    return LLMServeConfig(model=ModelConfig(source=model_dir),
                          llm=LLMConfig(scheduler="fcfs", num_blocks=512, prefix_cache_tokens=4096))


@pytest.fixture(scope="module")
def cluster(cfg):
    with running_cluster(cfg) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference(cfg):
    """The same requests on one engine in this process."""
    return one_engine(cfg)


def _prompts(seed: int, n: int, lo: int = 40, hi: int = 200, shared: list[int] | None = None) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [(shared or []) + rng.integers(3, 30000, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_sigterm_handler_is_the_front_ends(cluster):
    """``ray.init`` installs ``sys.exit(15)`` as the driver's SIGTERM handler: a SIGTERM'd ``serve --instances N``
    drained, then exited with status 15 where a one-instance server dies by the signal (143). ``start_ray`` puts
    the front end's own handler there (its behaviour: ``test_cluster_front_end.py``)."""
    from grserve.cluster.core.ray_runtime import on_sigterm

    assert signal.getsignal(signal.SIGTERM) is on_sigterm

def test_startup_and_kv_routing_equal_one_engine(cluster, reference):
    assert len({inst.info.pid for inst in cluster.instances}) == 3
    lines = cluster.describe()
    assert len(lines) == 4 and all(str(inst.info.pid) in "\n".join(lines) for inst in cluster.instances)
    shared = _prompts(0, 1, 64, 65)[0]
    prompts = _prompts(1, 4, shared=shared)
    first = cluster.submit(LLMRequest(prompts[0], GREEDY))
    outs = [first.future.result(timeout=60).output_ids]
    time.sleep(0.3)  # the instance's KV events reach the index (one poll)
    holder = next(i for i, inst in enumerate(cluster.instances) if cluster.router.routed[i] == 1)
    later = []
    for p in prompts[1:]:
        later.append(cluster.submit(LLMRequest(p, GREEDY)))
        time.sleep(0.05)
    results = [first.future.result(timeout=60)] + [h.future.result(timeout=60) for h in later]
    outs += [r.output_ids for r in results[1:]]
    assert outs == reference(prompts, GREEDY)
    assert cluster.router.decisions["prefix"] >= 1
    assert cluster.router.routed[holder] >= 2  # the shared 64-token prefix pulled a later request to its holder
    assert cluster.stats()["prefix_hit_tokens"] >= 64
    # usage.cached_tokens: each request's own prefix hits, adding up to the instances' counters (it was always 0)
    cached = [r.cached_tokens for r in results]
    assert cached[0] == 0 and max(cached) >= 64
    end = time.monotonic() + 5
    while cluster.stats()["prefix_hit_tokens"] != sum(cached):
        assert time.monotonic() < end, (cached, cluster.stats()["prefix_hit_tokens"])
        time.sleep(0.05)


def test_ray_listens_on_loopback_only_and_asks_for_a_token(cluster):
    """The Ray that grserve starts (issue 25): no process of it — GCS, raylet, agents, workers, the instance
    actors, this driver — listens outside loopback, and its GCS refuses a client without the token."""
    import ipaddress

    from cluster_fixtures import descendants, listening_sockets
    from grserve.cluster.core.ray_security import check_joined

    pids = descendants(os.getpid()) | {inst.info.pid for inst in cluster.instances}
    socks = listening_sockets(pids)
    names = {name for _, name, _, _ in socks}
    assert {"gcs_server", "raylet"} <= names and len(socks) >= 6, socks
    for pid, name, addr, port in socks:
        ip = ipaddress.ip_address(addr)
        ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
        assert ip.is_loopback, f"{name} (pid {pid}) listens on {addr}:{port}"
    gcs = ray.get_runtime_context().gcs_address
    assert gcs.startswith("127.0.0.1:") and check_joined(gcs) == "token"


def test_http_app_and_metrics(cluster, cfg):
    from fastapi.testclient import TestClient

    from grserve.cluster.core.metrics import ClusterCollector
    from grserve.server.llm.app import create_llm_app

    info = cluster.instances[0].info
    app = create_llm_app(cluster, cluster.tokenizer, "m", info.max_model_len, info.vocab_size)
    app.state.metrics.registry.register(ClusterCollector(cluster))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 5,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert client.get("/health").json()["status"] == "ok"
        body = {"model": "m", "prompt": list(range(100, 140)), "max_tokens": 2, "temperature": 0}
        assert client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        time.sleep(0.3)  # its blocks reach the KV index: the repeat goes where they are
        usage = client.post("/v1/completions", json=body).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks of 16; the last token computed
        text = client.get("/metrics").text
    for name in ("grserve_cluster_instance_up{instance=\"2\"} 1.0", "grserve_cluster_routing_decisions_total",
                 "grserve_cluster_migrations_total", "grserve_cluster_instance_booked_tokens",
                 "grserve_cluster_kv_index_blocks", "grserve_llm_running"):
        assert name in text
    for phase in ("queue", "prefill", "decode"):  # the instances' engine phases (before: empty in cluster mode)
        assert f'grserve_llm_request_{phase}_time_seconds_count{{model_name="m"}} 3.0' in text, phase


def _moved_enough(cluster, h) -> bool:
    """The request has 3 tokens out and its KV snapshot is at the front end (so it can migrate)."""
    rec = cluster.records.get(h.request_id)
    assert rec is not None, f"request ended before the kill: {h.future.exception(timeout=1)!r}"
    return rec.delivered >= 3 and rec.snapshot is not None


def test_kill_by_pid_mid_prefill_and_mid_decode_loses_nothing(cluster, reference):
    """SIGKILL instance 0 while it holds a request mid-decode and one still in prefill: every request finishes,
    each streaming client sees each position once, and greedy outputs equal the one-engine run."""
    victim = 0
    greedy = _prompts(2, 4, 60, 120)
    seeded = _prompts(3, 2, 60, 120)
    long_prompt = _prompts(4, 1, 1500, 1501)[0]  # still in prefill when the kill comes
    cluster.router.load[1].prefill_tokens += 10**6  # steer the new requests to the victim
    cluster.router.load[2].prefill_tokens += 10**6
    try:
        hs = [cluster.submit(LLMRequest(p, LONG)) for p in greedy]
        hs += [cluster.submit(LLMRequest(p, SEEDED)) for p in seeded]
        deadline = time.monotonic() + 60
        while not all(_moved_enough(cluster, h) for h in hs):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        hs.append(cluster.submit(LLMRequest(long_prompt, LONG)))
    finally:
        cluster.router.load[1].prefill_tokens -= 10**6
        cluster.router.load[2].prefill_tokens -= 10**6
    assert all(cluster.records[h.request_id].instance == victim for h in hs)
    assert cluster.records[hs[-1].request_id].delivered == 0
    assert all(cluster.records[h.request_id].delivered < LONG.max_tokens for h in hs[:4])
    t0 = time.perf_counter()
    os.kill(cluster.instances[victim].info.pid, signal.SIGKILL)

    async def consume_all():
        return await asyncio.gather(*(consume(h) for h in hs))

    streamed = asyncio.run(consume_all())
    results = [h.future.result(timeout=5) for h in hs]
    down = cluster.instances[victim]
    assert not down.up and down.down_at - t0 < 1.5  # detected within the target
    for ids, r in zip(streamed, results):
        assert ids == r.output_ids and len(ids) == LONG.max_tokens  # each position once, no gap
    assert [r.output_ids for r in results[:4]] + [results[-1].output_ids] == \
        reference(greedy + [long_prompt], LONG)
    assert cluster.counters["migrated"] >= 4 and cluster.counters["recomputed"] >= 1  # decode: KV; prefill: none
    moved = cluster.counters["migrated"] + cluster.counters["recomputed"]
    assert sum(r.num_preemptions for r in results) == moved  # a cluster result's num_preemptions counts its moves
    assert cluster.instances[victim].index not in {i for h in cluster.index.blocks.values() for i in h}
    RESULTS["seeded"] = [r.output_ids for r in results[4:6]]
    RESULTS["seeded_prompts"] = seeded


def test_seeded_sampling_survives_the_kill(reference):
    assert "seeded" in RESULTS
    assert RESULTS["seeded"] == reference(RESULTS["seeded_prompts"], SEEDED)


def test_frozen_instance_is_fenced_by_heartbeat(cluster, reference):
    """SIGSTOP instance 1: its polls stop answering; after the heartbeat timeout it is killed and its requests
    move to instance 2."""
    victim = 1
    prompts = _prompts(5, 2, 60, 100)
    cluster.router.load[2].prefill_tokens += 10**6
    try:
        hs = [cluster.submit(LLMRequest(p, LONG)) for p in prompts]
    finally:
        cluster.router.load[2].prefill_tokens -= 10**6
    while not all(cluster.records[h.request_id].delivered >= 2 for h in hs if h.request_id in cluster.records):
        time.sleep(0.005)
    pid = cluster.instances[victim].info.pid
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        outs = [h.future.result(timeout=60).output_ids for h in hs]
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    inst = cluster.instances[victim]
    deadline = time.monotonic() + HEARTBEAT_S + 5  # fenced even if its requests had finished before the stop
    while inst.up and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not inst.up and inst.down_reason == "heartbeat timeout"
    # silent for HEARTBEAT_S counted from its last answer (just before the stop), then fenced
    assert HEARTBEAT_S - 0.5 <= inst.down_at - t0 < HEARTBEAT_S + 2.5
    assert outs == reference(prompts, LONG)


def test_last_instance_death_fails_with_request_lost(cluster):
    hs = [cluster.submit(LLMRequest(p, GREEDY)) for p in _prompts(6, 2)]
    while not any(cluster.records.get(h.request_id) and cluster.records[h.request_id].delivered for h in hs):
        time.sleep(0.005)
    os.kill(cluster.instances[2].info.pid, signal.SIGKILL)
    for h in hs:
        with pytest.raises(RequestLost) as err:
            h.future.result(timeout=30)
        assert err.value.http_status == 503
    assert cluster.health().status == "stopped" and cluster.counters["lost"] == 2
    assert torch.equal(torch.tensor(cluster.router.routed).sign(), torch.ones(3, dtype=torch.int64))



def test_dead_instance_restarts_and_rejoins(cluster):
    """With every instance dead, a restart (the function --restart-instances runs after a death) brings instance 0
    back as a new actor and incarnation: it serves again, the KV index resyncs it by snapshot, /metrics shows it."""
    from prometheus_client import CollectorRegistry, generate_latest

    from grserve.cluster.core.metrics import ClusterCollector
    from grserve.cluster.core.respawn import respawn

    old = cluster.instances[0].info
    assert not cluster.instances[0].up
    assert respawn(cluster, 0)
    new = cluster.instances[0].info
    assert cluster.instances[0].up and new.pid != old.pid and new.incarnation != old.incarnation
    prompt = _prompts(7, 1, 80, 81)[0]
    assert len(cluster.submit(LLMRequest(prompt, GREEDY)).future.result(timeout=60).output_ids) == 40
    deadline = time.monotonic() + 10
    while not any(0 in holders for holders in cluster.index.blocks.values()):  # resynced, then its events
        assert time.monotonic() < deadline
        time.sleep(0.05)
    registry = CollectorRegistry()
    registry.register(ClusterCollector(cluster))
    text = generate_latest(registry).decode()
    assert 'grserve_cluster_instance_up{instance="0"} 1.0' in text
    assert 'grserve_cluster_instance_up{instance="1"} 0.0' in text
    assert "grserve_cluster_instance_restarts_total 1.0" in text
    assert cluster.health().status == "ok"
