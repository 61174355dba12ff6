"""BAT's request trace over the synthetic ranking population (``grserve.ranking.workload``), for
``grserve bench ranking``:

- items: Zipf popularity whose exponent is solved so that the top 10% of items receive ``hot_share`` (0.9) of
  the **realized candidate accesses** (each request draws ``candidates`` *distinct* items, which flattens the
  access distribution relative to the popularity weights, so the exponent is calibrated by simulating the draw);
  100 candidates per request (never scaled);
- requests: each user's requests at uniform times in one hour (Poisson given the count); candidates are
  ``candidates`` distinct items drawn by popularity (successive sampling without replacement, Gumbel-top-k).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from grserve.ranking.registry import RankingRegistry
from grserve.ranking.workload import WorkloadSpec, synthetic_population


@dataclass(frozen=True)
class TraceRequest:
    time_s: float
    user_id: int
    item_ids: tuple[int, ...]


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
    """The population (``synthetic_population``, the registry a server starts with), the trace over it, and its
    statistics."""
    sp = spec.scaled()
    rng = np.random.default_rng(sp.seed)
    pop = synthetic_population(spec, vocab_size, rng)
    reg, counts, user_lens, n_u = pop.registry, pop.requests_per_user, pop.profile_lens, sp.num_users
    k = min(sp.candidates, sp.num_items)
    exponent = calibrated_exponent(sp.num_items, k, sp.hot_share, seed=sp.seed)
    popularity = item_popularity(sp.num_items, exponent, rng)
    users = np.repeat(np.arange(n_u), counts)
    times = rng.random(users.size) * sp.duration_s
    cands = _draw_candidates(np.log(popularity), users.size, k, rng)
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
        "top10pct_popularity_mass": float(np.sort(popularity)[::-1][: max(1, sp.num_items // 10)].sum()),
        "zipf_exponent": exponent,
    }
    return reg, trace, stats
