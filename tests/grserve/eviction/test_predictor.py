"""The online LightGBM next-access-time predictor: features, labels, learning a periodic trace, SYNC/ASYNC."""

from __future__ import annotations

import math

import numpy as np
import pytest

from grserve_bench import traces as T
from grserve.eviction import LARUPolicy, PredictorConfig, make_policy
from grserve.eviction.predictor import LearnedPredictor
from grserve_bench.eviction import simulate

pytest.importorskip("lightgbm")


def _cfg(**kw):
    base = dict(horizon=200, window=2_000, retrain_every=500, min_train=100, num_rounds=16)
    base.update(kw)
    return PredictorConfig(**base)


def test_features_deltas_edcs_count():
    p = LearnedPredictor(_cfg(n_deltas=3, n_edcs=2, edc_base_exp=1), static_feature=lambda k: 7.0)
    for t in (0, 4, 6, 13):
        p.observe("a", t)
    h = p._hist["a"]
    assert h[2] == [7.0, 2.0, 4.0]  # most recent gap first
    e = [1.0, 1.0]  # windows 2, 4
    for gap in (4, 2, 7):
        e = [1.0 + e[i] * 2.0 ** (-gap / 2 ** (1 + i)) for i in range(2)]
    assert h[3] == pytest.approx(e)
    row = p._row(h)
    assert row[:3] == [7.0, 2.0, 4.0] and row[3:5] == pytest.approx(e) and row[5:] == [4.0, 7.0]
    p.observe("b", 14)
    assert all(math.isnan(v) for v in p._row(p._hist["b"])[:3])


def test_labels_are_next_gaps_and_censored_beyond_horizon():
    p = LearnedPredictor(_cfg(horizon=10, window=100, retrain_every=1000, min_train=1))
    p.observe("a", 0)
    p.observe("b", 1)
    p.observe("a", 5)  # labels a's first row with gap 5
    X, y = p._training_set(now=50)  # b's row (age 49 ≥ 10) is censored at 2·horizon; a's 2nd row too
    assert sorted(np.expm1(y).round(6).tolist()) == [5.0, 20.0, 20.0]
    X, y = p._training_set(now=8)  # too young to censor: only the labelled row
    assert np.expm1(y).round(6).tolist() == [5.0]


def test_learns_periodic_keys_and_drives_laru_on_a_loop():
    """Keys with distinct fixed periods: the model's predicted next time ranks keys like the truth."""
    trace = T.loop(12_000, 300)
    k = 200
    pred = LearnedPredictor(_cfg(horizon=1_000, window=4_000, retrain_every=1_000))
    laru = LARUPolicy(k, predictor=pred, mode="async", async_batch=32)
    res = simulate(trace, laru)
    lru = simulate(trace, make_policy("lru", k)).hit_rate
    assert pred.retrains >= 5 and lru == 0.0
    assert res.hit_rate > 0.4  # OPT ≈ 0.66, LRU = 0
    # a key just accessed is predicted ~300 ticks later
    t = len(trace) - 1
    assert pred.predict([trace[t]], t)[0] == pytest.approx(t + 300, rel=0.02)


def test_sync_mode_predicts_candidates_with_the_model():
    trace = T.zipf(4_000, 400, 0.9, seed=2)
    pred = LearnedPredictor(_cfg())
    fpb = make_policy("fpb", 32, predictor=pred, mode="sync")
    simulate(trace, fpb)
    assert pred.retrains >= 5
    assert fpb.stats["predictions"] >= fpb.stats["evictions"] * 2  # every eviction re-predicts all candidates


def test_background_training_thread():
    pred = LearnedPredictor(_cfg(), train_async=True)
    for t, key in enumerate(T.loop(1_500, 50)):
        pred.observe(key, t)
    pred.wait_training()
    assert pred.model is not None and pred.retrains >= 1
    v = pred.predict([0, 1], 1_500)
    assert all(np.isfinite(v))
