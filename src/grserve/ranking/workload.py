"""The users and items of a synthetic ranking workload with BAT's trace statistics (digest §2.5, §7.3; the paper
gives no distributions, so these are calibrated to the statistics it does give). ``grserve serve ranking`` starts
with them when no files are given; the lab draws the requests over the same population
(``grserve_bench.ranking_trace``).

- items: lengths uniform in [10, 18] tokens (the identifier token included);
- users: per-hour request counts with exactly ``round(once_fraction · users)`` (60% > 55%) users seen once, the
  rest 2 + a heavy (Zipf(1.8)) tail capped at 60; profile lengths lognormal (median 1250, σ 0.7 → mean ≈ 1.6K,
  ≈ 40% of users below the ≈ 1.4K item tokens of a request), capped at 8K, and rank-correlated with activity
  (active users have long profiles, BAT §5.3).

``scale`` multiplies the profile lengths only (median, minimum, cap). Item lengths (10–18) never scale. The default
is 1.0 (the paper's lengths); the CPU benchmark shrinks the *number of users* (and so requests), not the lengths,
so the user/item token ratio of a request stays the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grserve.ranking.registry import RankingRegistry, synthetic_registry


@dataclass(frozen=True)
class WorkloadSpec:
    num_items: int = 4000
    num_users: int = 400
    candidates: int = 100
    item_len: tuple[int, int] = (10, 18)
    profile_median: float = 1250.0
    profile_sigma: float = 0.7
    profile_min: int = 64
    profile_cap: int = 8192
    once_fraction: float = 0.6
    hot_share: float = 0.9  # share of realized candidate accesses on the top 10% of items (the trace's)
    activity_correlation: float = 0.7  # 0: lengths independent of activity, 1: sorted by activity
    duration_s: float = 3600.0
    scale: float = 1.0
    seed: int = 0

    def scaled(self) -> "WorkloadSpec":
        s = self.scale
        return WorkloadSpec(self.num_items, self.num_users, self.candidates, self.item_len,
                            self.profile_median * s, self.profile_sigma, max(8, round(self.profile_min * s)),
                            max(16, round(self.profile_cap * s)), self.once_fraction, self.hot_share,
                            self.activity_correlation, self.duration_s, 1.0, self.seed)


@dataclass(frozen=True)
class Population:
    registry: RankingRegistry
    requests_per_user: np.ndarray  # [num_users] requests each user makes in the trace window
    profile_lens: np.ndarray  # [num_users] profile tokens


def synthetic_population(spec: WorkloadSpec, vocab_size: int, rng: np.random.Generator | None = None) -> Population:
    """The workload's users and items. ``rng`` (default: seeded by ``spec.seed``) is advanced by the draws, so a
    trace drawn from it afterwards is the one of the whole workload."""
    sp = spec.scaled()
    rng = np.random.default_rng(sp.seed) if rng is None else rng
    n_u = sp.num_users
    # activity: exactly round(once_fraction · n_u) users once, the rest 2 + a heavy tail (capped at 60 per hour)
    once = np.zeros(n_u, dtype=bool)
    once[rng.permutation(n_u)[: int(round(sp.once_fraction * n_u))]] = True
    tail = np.minimum(2 + rng.zipf(1.8, size=n_u) - 1, 60)
    counts = np.where(once, 1, tail)
    # profile lengths: lognormal, capped, rank-correlated with activity
    lens = np.clip(rng.lognormal(np.log(sp.profile_median), sp.profile_sigma, size=n_u), sp.profile_min,
                   sp.profile_cap).astype(np.int64)
    key = sp.activity_correlation * (np.argsort(np.argsort(counts + rng.random(n_u) * 0.5)) / n_u) \
        + (1 - sp.activity_correlation) * rng.random(n_u)
    lens_sorted = np.sort(lens)
    user_lens = np.empty(n_u, dtype=np.int64)
    user_lens[np.argsort(key)] = lens_sorted
    reg = synthetic_registry(vocab_size, sp.num_items, sp.item_len, user_lens.tolist(), seed=sp.seed + 1)
    return Population(reg, counts, user_lens)
