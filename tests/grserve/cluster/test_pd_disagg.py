"""The PD coordinator's pieces that need no Ray: the set-up checks, which sampling may be split, the queue-aware
TTFT predictor and the flip rule's TTFT probe (the cluster itself: tests/grserve/cluster/test_cluster_pd.py)."""

from __future__ import annotations

import types

import pytest

from grserve.cluster.llm.pd_disagg import PDCoordinator, QueueTTFTPredictor, check_pd, splittable
from grserve.config import ClusterConfig, LLMServeConfig, PDConfig, SLOConfig
from grserve.engine.sampling import SamplingParams


def test_check_pd_refuses_what_cannot_work():
    ok = PDConfig(pd=True, prefill_instances=1)
    check_pd(ok, ClusterConfig(instances=3), 1024)
    with pytest.raises(ValueError, match="instances >= 2"):
        check_pd(ok, ClusterConfig(instances=1), 1024)
    with pytest.raises(ValueError, match="min-per-role"):
        check_pd(PDConfig(pd=True, prefill_instances=3), ClusterConfig(instances=3), 1024)
    with pytest.raises(ValueError, match="prefix-cache-tokens"):
        check_pd(ok, ClusterConfig(instances=3), 0)
    with pytest.raises(ValueError, match="kv-snapshot"):
        check_pd(ok, ClusterConfig(instances=3, kv_snapshot=False), 1024)


def test_serve_llm_pd_needs_two_instances():
    from grserve.flags import UsageError
    from grserve.server.llm.command import run

    with pytest.raises(UsageError, match="--pd needs --instances >= 2"):
        run(LLMServeConfig(pd=PDConfig(pd=True)))


def test_only_output_independent_sampling_is_split():
    assert splittable(SamplingParams(temperature=0.7, seed=3, top_p=0.9))
    for bad in (dict(presence_penalty=0.5), dict(frequency_penalty=0.1), dict(repetition_penalty=1.2),
                dict(min_tokens=5), dict(logprobs=2)):
        assert not splittable(SamplingParams(**bad))


def test_queue_delay_is_queued_tokens_over_the_measured_rate():
    p = QueueTTFTPredictor(2000.0, a=0.0, b=1 / 2000.0)
    for n in (32, 256, 1024, 1536, 2048):  # convex in L: the free fit takes a negative linear term
        p.observe(n, 0.02 - 5e-5 * n + 2e-7 * n * n + 1e-4)
    assert p.coef[1] < 0
    assert p.predict(3072, 1536) - p.predict(0, 1536) == pytest.approx(3072 / 2000.0)
    assert p.predict(0, 1536) == pytest.approx(p.prefill_s(1536))


def test_ttft_probe_expires_after_one_slo():
    eng = types.SimpleNamespace(instances=[object(), object(), object()])
    cost = types.SimpleNamespace(break_even_tokens=lambda: 10)
    c = PDCoordinator(eng, PDConfig(pd=True, min_dwell_s=0), SLOConfig(ttft_slo_s=1.0), cost,
                      QueueTTFTPredictor(1000.0))
    c.recent_input, c.recent_input_at = 1536, 100.0
    assert c.ttft_probe(100.5) == 1536 and c.ttft_probe(101.5) == 0
    assert c.threshold == 10
    h = getattr(c.cfg, "slo_headroom", 1.0)
    assert c.plan_slo().ttft_slo_s == pytest.approx(h)
