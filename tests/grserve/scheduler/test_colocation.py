"""Online/offline co-location (issue 13 item 3): the policy layer on plain views, the step latency model, the real
engine (preempted offline requests finish with the outputs of an un-preempted run), the API field, /metrics, and
the priority carried through the cluster front end to an instance's engine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from grserve.config import Priority
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest
from grserve.model.spec import ModelSpec
from grserve.scheduler.chunked import ChunkedPrefillScheduler
from grserve.scheduler.colocation import ColocationScheduler
from grserve.scheduler.fcfs import FCFSScheduler
from grserve.scheduler.llm_types import PoolView, SchedulerInput, SeqView
from grserve.scheduler.step_latency import StepFeatures, StepLatencyModel, item_features

BS = 4
SPEC = ModelSpec(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module")
def small(random_decoder):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on a busy shared machine: more threads only spin
    yield random_decoder(SPEC, 3, 0.1)
    torch.set_num_threads(threads)


def _v(i, tokens, *, prio="online", computed=0, preempt=0, arrival=0.0) -> SeqView:
    running = computed > 0
    held = 2 * -(-computed // BS) if running else 0
    return SeqView(i, arrival, 0.0 if running else None, tokens, computed, 1 if running else 0,
                   "kv" if running else None, held, -1, None, prio, preempt)


def _inp(waiting, running, free) -> SchedulerInput:
    total = free + sum(s.held_blocks for s in running)
    return SchedulerInput(1.0, tuple(waiting), tuple(running), PoolView(total, free, BS))


class _Fixed:
    """A latency 'model' that predicts a + c·decodes (no fitting), to test the admission rule alone."""

    coef = (1.0,)  # "fitted"
    observe_strict = StepLatencyModel.observe_strict

    def __init__(self, a, c):
        self.a, self.c = a, c
        self.correction, self.correction_rate = 1.0, 0.05

    def predict(self, f):
        return self.a + self.c * f.decode_requests

    def observe(self, f, s):
        pass


@pytest.mark.parametrize("inner", [FCFSScheduler(), ChunkedPrefillScheduler(token_budget=64)], ids=["fcfs", "chunked"])
def test_online_waiting_first_and_preempted_offline_at_head_of_offline_queue(inner):
    pol = ColocationScheduler(inner, offline_admission=False)
    # engine order of W: the preempted offline request 3 is at the front (engine.appendleft), then arrivals
    w = [_v(3, 8, prio="offline", preempt=1), _v(1, 8, prio="offline"), _v(2, 8), _v(4, 8)]
    out = pol.schedule(_inp(w, [], free=2 * 2))  # room for exactly one 8-token request
    assert [x.seq_id for x in out.scheduled] == [2]
    out = pol.schedule(_inp([s for s in w if s.priority == "offline"], [], free=2 * 2))
    assert [x.seq_id for x in out.scheduled] == [3]  # the preempted one heads the offline queue


@pytest.mark.parametrize("inner", [FCFSScheduler(), ChunkedPrefillScheduler(token_budget=64)], ids=["fcfs", "chunked"])
def test_online_preempts_newest_offline_when_memory_binds(inner):
    pol = ColocationScheduler(inner, offline_admission=False, max_offline_preemptions=2)
    running = [_v(10, 9, prio="offline", computed=8), _v(11, 9, computed=8), _v(12, 9, prio="offline", computed=8)]
    out = pol.schedule(_inp([_v(20, 8)], running, free=0))
    assert out.preempted[0] == 12 and 11 not in out.preempted  # the newest offline request, never the online one
    assert 20 in [x.seq_id for x in out.scheduled]
    # one already preempted max times is no longer a victim: the older one is taken instead
    running[2] = _v(12, 9, prio="offline", computed=8, preempt=2)
    out = pol.schedule(_inp([_v(20, 8)], running, free=0))
    assert out.preempted[0] == 10 and 12 not in out.preempted and 11 not in out.preempted
    assert 20 not in [x.seq_id for x in out.scheduled]  # 10 alone frees too little: 20 waits a step
    # no preemptable victim left: the capped offline requests are kept even before the online one
    running[0] = _v(10, 9, prio="offline", computed=8, preempt=2)
    out = pol.schedule(_inp([_v(20, 8)], running, free=0))
    assert 10 not in out.preempted and 12 not in out.preempted


def test_online_admission_takes_offline_victims_beyond_the_policy():
    """fcfs has memory for its decodes but none for the online prompt: offline victims make room for it."""
    pol = ColocationScheduler(FCFSScheduler(), offline_admission=False)
    running = [_v(10, 8, prio="offline", computed=7), _v(11, 8, computed=7), _v(12, 8, prio="offline", computed=7)]
    out = pol.schedule(_inp([_v(20, 8)], running, free=0))  # the 8th token of each fits its blocks: decodes run
    assert out.preempted == [12] and [x.seq_id for x in out.scheduled] == [20]
    assert pol.stats["offline_victims"] == 1


def test_no_preemption_when_memory_is_not_the_reason():
    pol = ColocationScheduler(ChunkedPrefillScheduler(token_budget=2), offline_admission=False)
    running = [_v(10, 9, prio="offline", computed=8), _v(11, 9, prio="offline", computed=8)]
    out = pol.schedule(_inp([_v(20, 8)], running, free=100))  # the token budget is spent on decodes
    assert out.preempted == [] and 20 not in [x.seq_id for x in out.scheduled]


@pytest.mark.parametrize("inner", [FCFSScheduler(), ChunkedPrefillScheduler(token_budget=64)], ids=["fcfs", "chunked"])
def test_offline_decodes_join_a_strict_batch_only_within_the_tpot_slo(inner):
    # a step costs 10 ms + 5 ms per decode row; SLO 26 ms: the online decode + 2 offline decodes fit, not 3
    pol = ColocationScheduler(inner, tpot_slo_s=0.026, model=_Fixed(0.010, 0.005))
    running = [_v(1, 9, computed=8)] + [_v(i, 9, prio="offline", computed=8) for i in (2, 3, 4, 5)]
    out = pol.schedule(_inp([], running, free=100))
    ids = sorted(x.seq_id for x in out.scheduled)
    assert ids == [1, 2, 3] and pol.stats["offline_deferred"] == 2
    # no online work running: offline runs freely
    out = pol.schedule(_inp([], running[1:], free=100))
    assert sorted(x.seq_id for x in out.scheduled) == [2, 3, 4, 5]
    # admission off: everything runs
    pol.offline_admission = False
    assert len(pol.schedule(_inp([], running, free=100)).scheduled) == 5


def test_an_online_request_already_over_its_tpot_gets_no_offline_company():
    pol = ColocationScheduler(ChunkedPrefillScheduler(token_budget=64), tpot_slo_s=0.026, model=_Fixed(0.010, 0.005))
    # 5 tokens out, the first at t=0.9; now = 1.0: TPOT so far would be (0.1 + step) / 5 <= 26 ms iff step <= 30 ms
    fresh = _v(1, 9, computed=8)._replace(num_output=5, first_token_time=0.9)
    offline = [_v(i, 9, prio="offline", computed=8) for i in (2, 3, 4)]
    assert len(pol.schedule(_inp([], [fresh] + offline, free=100)).scheduled) == 3  # the step limit (26 ms) binds
    # first token at t=0.88: 0.12 s for 4 gaps already; a step may take 10 ms only: the online decode alone
    slow = fresh._replace(first_token_time=0.88)
    assert [x.seq_id for x in pol.schedule(_inp([], [slow] + offline, free=100)).scheduled] == [1]


def test_correction_learns_that_strict_steps_run_slower_than_predicted():
    pol = ColocationScheduler(ChunkedPrefillScheduler(token_budget=64), tpot_slo_s=0.026, model=_Fixed(0.010, 0.005))
    running = [_v(1, 9, computed=8)] + [_v(i, 9, prio="offline", computed=8) for i in (2, 3, 4, 5)]
    assert len(pol.schedule(_inp([], running, free=100)).scheduled) == 3  # predicted 25 ms <= 26 ms
    for _ in range(100):  # every strict step takes 1.5x its prediction
        out = pol.schedule(_inp([], running, free=100))
        pol.observe_step(out, 1.5 * pol._last_pred)
    assert pol.model.correction == pytest.approx(1.5, rel=0.01)
    ids = [x.seq_id for x in pol.schedule(_inp([], running, free=100)).scheduled]
    assert ids == [1]  # one offline row: 1.5 x (10 + 2 x 5) ms = 30 ms > 26 ms (the online decode alone: 22.5 ms)


def test_fcfs_offline_prefill_deferred_falls_back_to_decoding_online():
    """fcfs planned a prefill of offline requests only while an online request decodes; the model says no: the
    step decodes instead (the online request is not stalled)."""

    class _Pre(_Fixed):
        def predict(self, f):
            return self.a + 0.01 * f.prefill_tokens + self.c * f.decode_requests

    pol = ColocationScheduler(FCFSScheduler(), tpot_slo_s=0.05, model=_Pre(0.01, 0.001))
    out = pol.schedule(_inp([_v(5, 40, prio="offline")], [_v(1, 9, computed=8)], free=100))
    assert out.kind == "decode" and [x.seq_id for x in out.scheduled] == [1]
    # a backlog: a re-plan must not just pick the next offline requests (nor fall back to the unchecked plan)
    pol.max_num_batched_tokens = 80  # fcfs admits two 40-token prompts per plan
    backlog = [_v(i, 40, prio="offline") for i in range(5, 12)]
    out = pol.schedule(_inp(backlog, [_v(1, 9, computed=8)], free=1000))
    assert out.kind == "decode" and [x.seq_id for x in out.scheduled] == [1]


def test_chunked_offline_prefill_is_cut_to_fit_the_slo():
    class _Pre(_Fixed):
        def predict(self, f):
            return self.a + 0.001 * f.prefill_tokens + self.c * f.decode_requests

    # 10 ms + 1 ms (the online decode) leaves 9 ms: a 9-token chunk of the 40-token offline prompt
    pol = ColocationScheduler(ChunkedPrefillScheduler(token_budget=64), tpot_slo_s=0.0205, model=_Pre(0.01, 0.001))
    out = pol.schedule(_inp([_v(5, 40, prio="offline")], [_v(1, 9, computed=8)], free=100))
    assert {x.seq_id: x.num_tokens for x in out.scheduled} == {1: 1, 5: 9}


def test_step_latency_model_recovers_a_linear_cost():
    rng = np.random.default_rng(0)
    m = StepLatencyModel(forget=1.0)
    assert m.predict(StepFeatures(1, 1, 1)) is None  # no model before min_samples
    true = np.array([0.004, 2e-5, 3e-4, 1e-7])
    for _ in range(200):
        f = StepFeatures(int(rng.integers(0, 512)), int(rng.integers(0, 64)), int(rng.integers(0, 20000)))
        m.observe(f, float(true @ f.row()) * (1 + 0.01 * rng.standard_normal()))
    np.testing.assert_allclose(m.coef, true, rtol=0.1)
    # a factor that the data drive negative is held at 0, not allowed to make a bigger batch predict faster
    m2 = StepLatencyModel(forget=1.0)
    for i in range(50):
        m2.observe(StepFeatures(0, i % 7, 0), 0.01 - 1e-4 * (i % 7))
    assert (m2.coef >= 0).all()
    assert item_features(10, 9, 1) == StepFeatures(0, 1, 10)
    assert item_features(10, 4, 3) == StepFeatures(3, 0, 7)


# ---------------------------------------------------------------------------------------------------- real engine
def _engine(model, num_blocks, cap=3, inner=None):
    from grserve.engine.llm import build_model_engine

    pol = ColocationScheduler(inner or ChunkedPrefillScheduler(token_budget=64), tpot_slo_s=10.0,
                              max_offline_preemptions=cap)
    return build_model_engine(model, pol, num_blocks=num_blocks, block_size=BS, max_model_len=512)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
@pytest.mark.parametrize("inner", ["fcfs", "chunked"])
def test_preempted_offline_requests_finish_identical(small, inner, sampling):
    model = small
    rng = random.Random(1)
    offline = [[rng.randrange(1, 500) for _ in range(20)] for _ in range(3)]
    online = [[rng.randrange(1, 500) for _ in range(12)] for _ in range(3)]
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) if sampling == "greedy" else
              SamplingParams(max_tokens=24, temperature=0.8, seed=5 + i, ignore_eos=True) for i in range(3)]
    ref = _engine(model, 256).generate(offline, params)  # plenty of memory: nobody is preempted

    mk = (lambda: FCFSScheduler()) if inner == "fcfs" else (lambda: ChunkedPrefillScheduler(token_budget=64))
    eng = _engine(model, 2 * 3 * 11, cap=2, inner=mk())  # 3 offline requests (44 tokens) fill the pool
    eng.keep_finished = True
    ids = [eng.add_request(p, sp, priority="offline") for p, sp in zip(offline, params)]
    for _ in range(8):
        eng.step()
    on = [eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)) for p in online]
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    done = {s.seq_id: s for s in eng.finished}
    assert all(done[i].finish_reason == "length" for i in ids + on)
    assert eng.stats["offline_preemptions"] >= 1 and any(done[i].num_preemptions for i in ids)
    assert all(done[i].num_preemptions == 0 for i in on)  # online work was never the victim
    assert all(done[i].num_preemptions <= 2 + 1 for i in ids)  # cap (+ at most one memory-pressure preemption)
    assert [done[i].output_ids for i in ids] == ref


def test_aptserve_inside_the_layer_finishes_everything_identically(small):
    """Apt-Serve inside: no priority guarantee against its own knapsack (docs/llm.md), but liveness and exact
    outputs hold."""
    from grserve.scheduler.aptserve import AptServeScheduler

    rng = random.Random(2)
    prompts = [[rng.randrange(1, 500) for _ in range(16)] for _ in range(6)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref = _engine(small, 256).generate(prompts, sp)
    eng = _engine(small, 2 * 4 * 8, inner=AptServeScheduler(ttft_slo=0.5, tbt_slo=0.5, rho=1e-6))
    eng.keep_finished = True
    ids = [eng.add_request(p, sp, priority="offline" if i % 2 else "online") for i, p in enumerate(prompts)]
    for _ in range(3000):
        if not eng.has_work():
            break
        eng.step()
    done = {s.seq_id: s for s in eng.finished}
    assert [done[i].output_ids for i in ids] == ref


def test_priority_is_validated_by_the_engine(small):
    eng = _engine(small, 64)
    with pytest.raises(ValueError, match="priority"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority="batch")
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority="offline")
    assert eng.priority_counts() == {"running_online": 0, "running_offline": 0, "waiting_online": 0,
                                     "waiting_offline": 1}
    assert eng.waiting[0].priority is Priority.OFFLINE  # one enum inside, whatever string came in


def test_priority_is_one_enum_from_the_request_on():
    req = LLMRequest([1, 2], SamplingParams(max_tokens=1), priority="offline")
    assert req.priority is Priority.OFFLINE and req.priority == "offline" and f"{req.priority}" == "offline"
    assert LLMRequest([1], SamplingParams()).priority is Priority.ONLINE
    with pytest.raises(ValueError, match=r"priority must be one of \('online', 'offline'\), not 'batch'"):
        LLMRequest([1], SamplingParams(), priority="batch")


# ---------------------------------------------------------------------------------------------------- API, metrics
@pytest.fixture(scope="module")
def app_client(small, tmp_path_factory):
    from fastapi.testclient import TestClient

    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.engine.tokenizer import load_tokenizer
    from grserve.server.llm.app import create_llm_app

    model = small
    spec = model.spec
    tok = load_tokenizer("preset", spec.vocab_size, 512, tmp_path_factory.mktemp("tok"))
    core = _engine(model, 128)
    loop = AsyncLLMEngine(core, tok).start()
    app = create_llm_app(loop, tok, "m", 512, spec.vocab_size)
    with TestClient(app) as c:
        yield c, loop
    loop.stop()


def test_api_priority_field_strict_and_metrics(app_client):
    c, loop = app_client
    body = {"model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    r = c.post("/v1/completions", json={**body, "priority": "offline"})
    assert r.status_code == 200, r.text
    for bad in ("urgent", 1, "Offline"):
        r = c.post("/v1/completions", json={**body, "priority": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert c.post("/v1/completions", json={**body, "priority": None}).status_code == 200  # null: the default
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": "offline"}
    assert c.post("/v1/chat/completions", json=chat).status_code == 200
    text = c.get("/metrics").text
    for name in ("offline_preemptions_total", "offline_deferred", "running_online", "running_offline",
                 "waiting_online", "waiting_offline"):  # a running total is a counter (issue 25)
        assert f"grserve_llm_{name} " in text, name


# ---------------------------------------------------------------------------------------------------- the cluster
class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *a, **kw):
        return self.fn(*a, **kw)


class _FakeActor:
    def __init__(self):
        self.calls = []
        self.submit = _Remote(lambda *a, **kw: self.calls.append((a, kw)))


def test_cluster_front_end_carries_priority_to_the_instance():
    from grserve.cluster.llm.front_end import ClusterLLMEngine
    from grserve.config import ClusterConfig

    from grserve.cluster.wire import Attempt, LLMInstanceInfo

    actor = _FakeActor()
    info = LLMInstanceInfo(0, "x", max_model_len=512, num_blocks=64)
    eng = ClusterLLMEngine([actor], [info], ClusterConfig(instances=1))
    eng._status = "ok"  # no poll threads: only the submit path is under test
    eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2), request_id="a", priority="offline"))
    eng.submit(LLMRequest([1, 2, 3], SamplingParams(max_tokens=2), request_id="b"))
    assert [a[0].priority for a, _ in actor.calls] == ["offline", "online"]
    # the instance side: EngineInstance.submit hands it to its engine
    from grserve.cluster.llm.instance import EngineInstance

    inst = EngineInstance.__new__(EngineInstance)
    inst.kv_snapshot = True
    got = []
    inst.engine = type("E", (), {"prefix_cache": None, "submit": lambda self, req: got.append(req.priority)})()
    inst._submit(Attempt("r", 0, [1, 2], SamplingParams(max_tokens=1), priority="offline"))
    assert got == ["offline"]
    assert Attempt("r", 0, [1], SamplingParams()).priority == "online"


# ---------------------------------------------------------------------------------------------------- the benchmark
def test_bench_part_colocation_smoke(small, tmp_path):
    """A miniature of ``grserve bench pd --parts colocation``: the keys, finite (a small model saved as a dir)."""
    import math

    from grserve_bench import pd_colocation
    from grserve.model.loader import save_pretrained

    save_pretrained(small, tmp_path)
    cfg = pd_colocation.PartConfig(coloc_model=str(tmp_path), coloc_online_requests=6, coloc_offline_requests=12,
                                   coloc_reps=1, coloc_max_num_seqs=8, coloc_num_blocks=512)
    out = pd_colocation.run_part(cfg)
    for k in ("online_ttft_p90_ratio", "online_tpot_p90_ratio"):
        assert math.isfinite(out[k]) and out[k] > 0, (k, out[k])
    assert 0 <= out["offline_throughput_share"] <= 1.5  # a tiny window: offline may get nothing in it
    assert out["coloc_offline_tokens_per_s"]["offline_only"] > 0
