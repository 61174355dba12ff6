"""Knobs of the eviction policies and of the LightGBM next-access-time predictor (one dataclass per concern).

Kept here rather than in ``grserve/config.py`` so that ``eviction/`` stays a leaf package; the serving config can
embed these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PolicyName = Literal["lru", "lfu", "belady", "fpb", "hf", "laru", "density", "leader"]
PredictMode = Literal["sync", "async"]


@dataclass(frozen=True)
class LARUConfig:
    """Algorithm 1 parameters. ``b`` is the decay base of λ (paper: 2, chosen so that log_b k ≤ k).

    ``decay_every`` is the number of prediction-induced misses (Line 14 evaluated *true*) per division of λ by b:
    1 is Algorithm 1 / the DLRM setting; the LLM setting halves λ every ⌈k/32⌉ such misses ("auto" picks 1 for
    k ≤ 64 and ⌈k/32⌉ above, k taken at the phase start). The counter restarts at every phase (digest §11.7).
    """

    b: float = 2.0
    decay_every: int | Literal["auto"] = 1


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


@dataclass(frozen=True)
class EvictionConfig:
    """Which policy a cache uses, chosen by name (``make_policy``)."""

    policy: PolicyName = "lru"
    laru: LARUConfig = field(default_factory=LARUConfig)
    hf_candidates: int = 4  # HALP's fixed LRU candidate set (digest §11.17)
    lfu_window: int = 10_000  # window-LFU: frequency counted over the last N accesses
    mode: PredictMode = "sync"
    async_batch: int = 64  # ASYNC: accesses per background prediction job
    async_threaded: bool = False  # ASYNC: a real background thread (True) or its deterministic emulation
