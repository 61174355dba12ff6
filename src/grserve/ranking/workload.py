"""A synthetic ranking workload with BAT's trace statistics (digest §2.5, §7.3; the paper gives no
distributions, so these are calibrated to the statistics it does give):

- items: Zipf popularity whose exponent is solved so the top 10% of items receive ``hot_share`` (0.9) of the
  accesses; item lengths uniform in [10, 18] tokens (the identifier token included);
- users: per-hour request counts with ``once_fraction`` (> 55%) of users seen once, the rest 2 + a heavy
  (Zipf-like) tail; profile lengths lognormal (median 1250, σ 0.7 → mean ≈ 1.6K, ≈ 36% below 1K tokens),
  capped at 8K, and rank-correlated with activity (active users have long profiles, BAT §5.3);
- requests: each user's requests at uniform times in one hour (Poisson given the count); candidates are
  ``candidates`` distinct items drawn by popularity.

``scale`` multiplies every length-like quantity (profile median and cap, candidates per request) so a CPU run
keeps the ratios: user tokens / item tokens per request, and the tail shape. Item token lengths stay 10–18.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grserve.ranking.registry import RankingRegistry, synthetic_registry


@dataclass(frozen=True)
class WorkloadSpec:
    num_items: int = 8000
    num_users: int = 400
    candidates: int = 100
    item_len: tuple[int, int] = (10, 18)
    profile_median: float = 1250.0
    profile_sigma: float = 0.7
    profile_min: int = 64
    profile_cap: int = 8192
    once_fraction: float = 0.6
    hot_share: float = 0.9  # share of accesses on the top 10% of items
    activity_correlation: float = 0.7  # 0: lengths independent of activity, 1: sorted by activity
    duration_s: float = 3600.0
    scale: float = 1.0
    seed: int = 0

    def scaled(self) -> "WorkloadSpec":
        s = self.scale
        return WorkloadSpec(self.num_items, self.num_users, max(2, round(self.candidates * s)), self.item_len,
                            self.profile_median * s, self.profile_sigma, max(8, round(self.profile_min * s)),
                            max(16, round(self.profile_cap * s)), self.once_fraction, self.hot_share,
                            self.activity_correlation, self.duration_s, 1.0, self.seed)


@dataclass(frozen=True)
class TraceRequest:
    time_s: float
    user_id: int
    item_ids: tuple[int, ...]


def zipf_exponent_for(num_items: int, hot_share: float, top_fraction: float = 0.1) -> float:
    """The exponent a of p_i ∝ i^-a whose top ``top_fraction`` of items hold ``hot_share`` of the mass."""
    ranks = np.arange(1, num_items + 1, dtype=np.float64)
    k = max(1, int(round(num_items * top_fraction)))
    lo, hi = 0.0, 5.0
    for _ in range(60):
        a = (lo + hi) / 2
        w = ranks ** -a
        share = w[:k].sum() / w.sum()
        lo, hi = (a, hi) if share < hot_share else (lo, a)
    return (lo + hi) / 2


def item_popularity(num_items: int, hot_share: float, rng: np.random.Generator) -> np.ndarray:
    a = zipf_exponent_for(num_items, hot_share)
    w = np.arange(1, num_items + 1, dtype=np.float64) ** -a
    p = np.empty(num_items)
    p[rng.permutation(num_items)] = w / w.sum()  # hot items scattered over the id space
    return p


def generate_workload(spec: WorkloadSpec, vocab_size: int) -> tuple[RankingRegistry, list[TraceRequest], dict]:
    sp = spec.scaled()
    rng = np.random.default_rng(sp.seed)
    n_u = sp.num_users
    # activity: once with probability once_fraction, else 2 + a heavy tail (capped at 60 per hour)
    once = rng.random(n_u) < sp.once_fraction
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
    pop = item_popularity(sp.num_items, sp.hot_share, rng)
    trace = []
    for u in range(n_u):
        for t in rng.random(int(counts[u])) * sp.duration_s:
            items = rng.choice(sp.num_items, size=sp.candidates, replace=False, p=pop)
            trace.append(TraceRequest(float(t), u, tuple(int(i) for i in items)))
    trace.sort(key=lambda r: r.time_s)
    item_tok = np.mean([sum(len(reg.item_tokens(i)) for i in r.item_ids) for r in trace])
    stats = {
        "users": n_u, "requests": len(trace), "items": sp.num_items, "candidates": sp.candidates,
        "users_seen_once": float(np.mean(counts == 1)),
        "profile_mean": float(user_lens.mean()), "profile_max": int(user_lens.max()),
        "profile_mean_per_request": float(np.mean([len(reg.user_tokens(r.user_id)) for r in trace])),
        "item_tokens_per_request": float(item_tok),
        "users_below_item_tokens": float(np.mean(user_lens < item_tok)),
        "top10pct_item_share": float(np.sort(pop)[::-1][: max(1, sp.num_items // 10)].sum()),
        "zipf_exponent": zipf_exponent_for(sp.num_items, sp.hot_share),
    }
    return reg, trace, stats
