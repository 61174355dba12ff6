"""Hot-Replicated Cold-Sharded (HRCS) item-KV placement (BAT §5.2, Algorithm 1) and its baselines.

``compute_replication_ratio`` is Algorithm 1 as printed:

    t ← PrefillTime(τ_u, c·τ_i);  T_max ← α·t;  S_item ← τ_i
    R_max ← T_max · B · (N−1) / (c · S_item · N)
    sort F descending; r ← the first i/|F| whose CDF ≥ 1 − R_max

with the (N−1)/N factor configurable (``factor="paper"``, default, as printed; ``factor="derived"`` uses N/(N−1),
the reciprocal that a direct derivation gives: a request on one of N nodes finds a sharded item remote with
probability (N−1)/N, so remote tokens = c·τ_i·R·(N−1)/N ≤ α·t·B). F is normalised here. N = 1 → r = 1
(everything is local). B is tokens/s per link (link bytes/s ÷ KV bytes per token).

Placement (``hrcs_placement``): the top ⌈r·|F|⌉ items on every worker, the rest round-robin over the workers in
hotness order (an even split of both items and load). Every item has a *home* worker that always holds it; replicas
are extra copies. ``replicate`` keeps the homes and replaces the replicated set by the currently hottest items, so
a re-placement moves only the difference (``meta_service.py`` serves it; the lab's ``grserve_bench/hrcs_compare.py``
holds the baselines: full replication, hash sharding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np

FACTORS = ("paper", "derived")


def max_comm_ratio(alpha: float, prefill_s: float, bandwidth_tps: float, candidates: int, item_tokens: float,
                   workers: int, factor: str = "paper") -> float:
    if factor not in FACTORS:
        raise ValueError(f"factor must be one of {FACTORS}, got {factor!r}")
    if workers <= 1:
        return 0.0
    t_max = alpha * prefill_s
    n = workers
    f = (n - 1) / n if factor == "paper" else n / (n - 1)
    return t_max * bandwidth_tps * f / (candidates * item_tokens)


def compute_replication_ratio(bandwidth_tps: float, freq: Iterable[float], tau_u: float, tau_i: float, alpha: float,
                              candidates: int, workers: int,
                              prefill_time: Callable[[float, float], float] | float, factor: str = "paper") -> float:
    """Algorithm 1. ``prefill_time(τ_u, c·τ_i)`` (seconds) or a measured constant."""
    f = np.sort(np.asarray(list(freq), dtype=np.float64))[::-1]
    if f.size == 0:
        return 0.0
    if workers <= 1:
        return 1.0
    t = prefill_time(tau_u, candidates * tau_i) if callable(prefill_time) else float(prefill_time)
    r_max = max_comm_ratio(alpha, t, bandwidth_tps, candidates, tau_i, workers, factor)
    total = f.sum()
    if total <= 0:
        return 0.0
    cdf = np.cumsum(f / total)
    i = int(np.searchsorted(cdf, 1.0 - r_max - 1e-12, side="left"))  # first index with CDF ≥ 1 − R_max
    return min(i + 1, f.size) / f.size


@dataclass
class Placement:
    name: str
    workers: int
    home: dict[int, int]  # item → the worker that always holds it
    replicated: set[int] = field(default_factory=set)  # items held by every worker

    def owners(self, item: int) -> frozenset[int]:
        if item in self.replicated:
            return frozenset(range(self.workers))
        return frozenset((self.home[item],))

    def items_on(self, worker: int) -> list[int]:
        return [i for i, w in self.home.items() if w == worker or i in self.replicated]

    @property
    def replication_ratio(self) -> float:
        return len(self.replicated) / max(len(self.home), 1)


def _by_hotness(items: Iterable[int], freq: Mapping[int, float]) -> list[int]:
    return sorted(items, key=lambda i: (-freq.get(i, 0.0), i))


def _top(order: list[int], ratio: float) -> int:
    return min(len(order), int(math.ceil(ratio * len(order) - 1e-9)))


def hrcs_placement(items: Iterable[int], freq: Mapping[int, float], ratio: float, workers: int) -> Placement:
    order = _by_hotness(items, freq)
    k = _top(order, ratio)
    replicated = set(order[:k])
    home = {i: n % workers for n, i in enumerate(order[k:])}
    home.update({i: i % workers for i in order[:k]})
    return Placement("hrcs", workers, home, replicated)


def replicate(placement: Placement, freq: Mapping[int, float], ratio: float) -> Placement:
    """The same homes, the hottest ⌈ratio·|items|⌉ items replicated (a re-placement moves only the difference)."""
    order = _by_hotness(placement.home, freq)
    return replace(placement, replicated=set(order[:_top(order, ratio)]))


def place_new(placement: Placement, items: Iterable[int]) -> Placement:
    """``placement`` with homes for the items it lacks, each on the worker holding the fewest homes then."""
    home = dict(placement.home)
    count = [0] * placement.workers
    for w in home.values():
        count[w] += 1
    for i in items:
        if i not in home:
            w = home[i] = min(range(placement.workers), key=lambda k: (count[k], k))
            count[w] += 1
    return replace(placement, home=home)


