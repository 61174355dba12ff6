"""The knobs of the LightGBM next-access-time predictor.

Kept here rather than in ``grserve/config.py`` so that ``eviction/`` stays a leaf package.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PredictorConfig:
    """Online LightGBM next-access-time model (LRB-style features; digest §5, §10.3, §11.9).

    Time is *logical*: one tick per request seen by the cache (digest §11.10).
    """

    n_deltas: int = 10  # most recent inter-access gaps
    n_edcs: int = 10  # exponentially decayed counters, window 2^(edc_base_exp + i)
    edc_base_exp: int = 4
    horizon: int = 16_384  # a sample not re-accessed within `horizon` ticks is labelled 2·horizon (censored)
    window: int = 65_536  # sliding window of recent accesses kept as training samples
    retrain_every: int = 8_192  # retrain cadence, in accesses
    min_train: int = 512  # no model before this many labelled samples
    max_train: int = 32_768  # subsample of the window used per retrain
    num_rounds: int = 32
    num_leaves: int = 31
    learning_rate: float = 0.1
    num_threads: int = 1  # 2 on a shared 2-core box: OpenMP spin contention made refits ~60× slower
    max_keys: int = 1_000_000  # per-key history table bound (oldest keys forgotten beyond this)
    seed: int = 0
