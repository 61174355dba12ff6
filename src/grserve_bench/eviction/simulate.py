"""The reference paging loop: a cache of ``capacity`` unit-size items driven by one policy over a key trace.

This is the single place that defines hit/miss for the trace-driven experiments: request t for key x is a hit iff
x is cached; on a miss the policy is told (``on_miss``), a victim is evicted if the cache is full, then x is
inserted. The cache's own set is the ground truth; the policy only chooses victims.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from grserve.eviction.policy import EvictionPolicy


@dataclass
class SimResult:
    requests: int = 0
    hits: int = 0
    misses: int = 0
    policy_seconds: float = 0.0
    evictions: list[Hashable] = field(default_factory=list)  # only with record_evictions=True
    hit_flags: list[bool] = field(default_factory=list)  # only with record_evictions=True

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 0.0


def simulate(keys: Sequence[Hashable], policy: EvictionPolicy, capacity: int | None = None,
             record_evictions: bool = False) -> SimResult:
    cap = policy.capacity if capacity is None else capacity
    cached: set[Hashable] = set()
    res = SimResult()
    clock = time.perf_counter
    spent = 0.0
    for t, x in enumerate(keys):
        if x in cached:
            t0 = clock()
            policy.on_hit(x, t)
            spent += clock() - t0
            res.hits += 1
            if record_evictions:
                res.hit_flags.append(True)
            continue
        res.misses += 1
        t0 = clock()
        policy.on_miss(x, t)
        if len(cached) >= cap:
            z = policy.victim(t)
            if z not in cached:
                raise AssertionError(f"{policy.name} chose {z!r}, which is not cached")
            cached.remove(z)
            if record_evictions:
                res.evictions.append(z)
        policy.on_insert(x, t)
        spent += clock() - t0
        cached.add(x)
        if record_evictions:
            res.hit_flags.append(False)
    res.requests = len(keys)
    res.policy_seconds = spent
    return res
