"""A synthetic ranking workload with BAT's trace statistics (digest §2.5, §7.3; the paper gives no
distributions, so these are calibrated to the statistics it does give):

- items: Zipf popularity whose exponent is solved so that the top 10% of items receive ``hot_share`` (0.9) of
  the **realized candidate accesses** (each request draws ``candidates`` *distinct* items, which flattens the
  access distribution relative to the popularity weights, so the exponent is calibrated by simulating the draw);
  item lengths uniform in [10, 18] tokens (the identifier token included); 100 candidates per request;
- users: per-hour request counts with exactly ``round(once_fraction · users)`` (60% > 55%) users seen once, the
  rest 2 + a heavy (Zipf(1.8)) tail capped at 60; profile lengths lognormal (median 1250, σ 0.7 → mean ≈ 1.6K,
  ≈ 40% of users below the ≈ 1.4K item tokens of a request), capped at 8K, and rank-correlated with activity
  (active users have long profiles, BAT §5.3);
- requests: each user's requests at uniform times in one hour (Poisson given the count); candidates are
  ``candidates`` distinct items drawn by popularity (successive sampling without replacement, Gumbel-top-k).

``scale`` multiplies the profile lengths only (median, minimum, cap). Candidates per request (100) and item
lengths (10–18) never scale. The default is 1.0 (the paper's lengths); the CPU benchmark shrinks the *number of
users* (and so requests), not the lengths, so the user/item token ratio of a request stays the paper's.
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
    hot_share: float = 0.9  # share of realized candidate accesses on the top 10% of items
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


def _draw_candidates(logp: np.ndarray, n_requests: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n_requests, k] distinct items per row, successive sampling ∝ p without replacement (Gumbel-top-k)."""
    rows = max(1, 4_000_000 // max(logp.size, 1))  # bound memory: ≤ 4M keys at a time
    out = np.empty((n_requests, k), dtype=np.int64)
    for r0 in range(0, n_requests, rows):
        keys = logp[None, :] + rng.gumbel(size=(min(rows, n_requests - r0), logp.size))
        out[r0:r0 + rows] = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    return out


def realized_top_share(items: np.ndarray, num_items: int, top_fraction: float = 0.1) -> float:
    """Share of all candidate accesses that fall on the most-accessed ``top_fraction`` of the catalog."""
    cnt = np.bincount(items.reshape(-1), minlength=num_items)
    k = max(1, int(round(num_items * top_fraction)))
    return float(np.sort(cnt)[::-1][:k].sum() / max(cnt.sum(), 1))


def calibrated_exponent(num_items: int, candidates: int, hot_share: float, seed: int = 0,
                        probe_requests: int = 400) -> float:
    """Zipf exponent whose *realized* top-10% access share, with ``candidates`` distinct items per request,
    is ``hot_share`` (bisection on a fixed-seed simulation of the draw)."""
    ranks = np.log(np.arange(1, num_items + 1, dtype=np.float64))
    k = min(candidates, num_items)
    probe_requests = max(20, min(probe_requests, 20_000_000 // max(num_items, 1)))  # big catalogs: fewer probes
    lo, hi = 0.0, 6.0
    for _ in range(22):
        a = (lo + hi) / 2
        share = realized_top_share(_draw_candidates(-a * ranks, probe_requests, k, np.random.default_rng(seed)),
                                   num_items)
        lo, hi = (a, hi) if share < hot_share else (lo, a)
    return (lo + hi) / 2


def item_popularity(num_items: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    w = np.arange(1, num_items + 1, dtype=np.float64) ** -exponent
    p = np.empty(num_items)
    p[rng.permutation(num_items)] = w / w.sum()  # hot items scattered over the id space
    return p


def generate_workload(spec: WorkloadSpec, vocab_size: int) -> tuple[RankingRegistry, list[TraceRequest], dict]:
    sp = spec.scaled()
    rng = np.random.default_rng(sp.seed)
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
    k = min(sp.candidates, sp.num_items)
    exponent = calibrated_exponent(sp.num_items, k, sp.hot_share, seed=sp.seed)
    pop = item_popularity(sp.num_items, exponent, rng)
    users = np.repeat(np.arange(n_u), counts)
    times = rng.random(users.size) * sp.duration_s
    cands = _draw_candidates(np.log(pop), users.size, k, rng)
    order = np.argsort(times, kind="stable")
    trace = [TraceRequest(float(times[j]), int(users[j]), tuple(int(i) for i in cands[j])) for j in order]
    per_item = [sum(len(reg.item_tokens(i)) for i in r.item_ids) for r in trace]
    per_user = [len(reg.user_tokens(r.user_id)) for r in trace]
    item_tok, user_tok = np.mean(per_item), np.mean(per_user)
    # the most any prefix choice can serve from cache with an unbounded user cache and the whole item pool: per
    # request the larger of its item tokens and (if the user was seen before) its profile — a trace property
    seen: set[int] = set()
    ceiling = 0
    for r, it, ut in zip(trace, per_item, per_user):
        ceiling += max(it, ut if r.user_id in seen else 0)
        seen.add(r.user_id)
    stats = {
        "users": n_u, "requests": len(trace), "items": sp.num_items, "candidates": k,
        "users_seen_once": float(np.mean(counts == 1)),
        "profile_mean": float(user_lens.mean()), "profile_median": float(np.median(user_lens)),
        "profile_max": int(user_lens.max()),
        "profile_mean_per_request": float(user_tok),
        "item_tokens_per_request": float(item_tok),
        "item_token_share": float(item_tok / (item_tok + user_tok)),
        "cacheable_share_ceiling": float(ceiling / (sum(per_item) + sum(per_user))),
        "users_below_item_tokens": float(np.mean(user_lens < item_tok)),
        "top10pct_access_share": realized_top_share(cands, sp.num_items),
        "top10pct_popularity_mass": float(np.sort(pop)[::-1][: max(1, sp.num_items // 10)].sum()),
        "zipf_exponent": exponent,
    }
    return reg, trace, stats
