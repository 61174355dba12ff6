"""Offline next-access oracles and the synthetic prediction sources of the robustness experiments.

* ``AccessListOracle``: exact next-request times from the future (a trace, or per-key sorted access times).
  It is both Belady's input (``next_access``) and a perfect ``NextAccessPredictor``.
* ``NoisyPredictor``: the paper's noise model (§4.3 / Fig. 5, 13): with probability p a prediction is replaced by
  the *inverted* one, −(true next-request time); p = 1 is fully adversarial. Decision (digest §10.3): the coin is
  drawn once per access of a key, so repeated queries between two accesses agree (predictions stay ``stable``).
* ``RandomPredictor`` / ``ConstantPredictor``: uninformative predictions for the robustness bound tests.
* ``prefix_access_times``: the access times an oracle needs for the nodes of a radix prefix cache
  (``grserve.kvcache.radix``), whose keys only exist once prompts have split the tree.

Never-requested-again keys have next-access time +inf (inverted: −inf).
"""

from __future__ import annotations

import bisect
import math
import random
from collections import defaultdict
from typing import Hashable, Iterable, Sequence

import numpy as np

from grserve.eviction.policy import EvictionPolicy
from grserve.kvcache.radix import RadixCache

INF = math.inf


class AccessListOracle:
    stable = True

    def __init__(self, access_times: dict[Hashable, list[int]]):
        self._times = access_times  # key -> sorted request times
        self._last: dict[Hashable, int] = {}

    @classmethod
    def from_trace(cls, keys: Iterable[Hashable]) -> "AccessListOracle":
        times: dict[Hashable, list[int]] = defaultdict(list)
        for t, k in enumerate(keys):
            times[k].append(t)
        return cls(dict(times))

    def next_access(self, key: Hashable, now: int) -> float:
        """The first request time of ``key`` strictly after ``now`` (+inf if none)."""
        ts = self._times.get(key)
        if not ts:
            return INF
        i = bisect.bisect_right(ts, now)
        return float(ts[i]) if i < len(ts) else INF

    # NextAccessPredictor
    def observe(self, key: Hashable, now: int) -> None:
        self._last[key] = now

    def predict(self, keys: Sequence[Hashable], now: int) -> list[float]:
        last = self._last
        return [self.next_access(k, last.get(k, now)) for k in keys]

    def copy_history(self, src: Hashable, dst: Hashable) -> None:
        if src in self._last:
            self._last[dst] = self._last[src]


class NoisyPredictor:
    """Wraps an exact predictor; each access flips the key's prediction to −truth with probability p."""

    stable = True

    def __init__(self, base: AccessListOracle, p: float, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be in [0, 1], got {p}")
        self.base, self.p = base, p
        self._rng = random.Random(seed)
        self._flipped: dict[Hashable, bool] = {}

    def observe(self, key: Hashable, now: int) -> None:
        self.base.observe(key, now)
        self._flipped[key] = self.p > 0 and (self.p >= 1 or self._rng.random() < self.p)

    def predict(self, keys: Sequence[Hashable], now: int) -> list[float]:
        vals = self.base.predict(keys, now)
        fl = self._flipped
        return [-v if fl.get(k, False) else v for k, v in zip(keys, vals)]

    def copy_history(self, src: Hashable, dst: Hashable) -> None:
        self.base.copy_history(src, dst)
        self._flipped[dst] = self._flipped.get(src, False)


class RandomPredictor:
    """Next-access time = last access + U(0, scale), drawn once per access."""

    stable = True

    def __init__(self, scale: float = 1000.0, seed: int = 0):
        self.scale = scale
        self._rng = random.Random(seed)
        self._val: dict[Hashable, float] = {}

    def observe(self, key: Hashable, now: int) -> None:
        self._val[key] = now + self._rng.random() * self.scale

    def predict(self, keys: Sequence[Hashable], now: int) -> list[float]:
        return [self._val.get(k, float(now)) for k in keys]


class ConstantPredictor:
    """Every key is predicted to come back at the same time (ties everywhere)."""

    stable = True

    def __init__(self, value: float = 0.0):
        self.value = value

    def observe(self, key: Hashable, now: int) -> None:
        pass

    def predict(self, keys: Sequence[Hashable], now: int) -> list[float]:
        return [self.value] * len(keys)


class _AccessRecorder(EvictionPolicy):
    """Infinite-capacity 'policy' that records, per node key, the request times that touched it."""

    name = "recorder"

    def __init__(self):
        super().__init__(1)
        self.times: dict[Hashable, list[int]] = {}

    def _add(self, key: Hashable, now: int) -> None:
        ts = self.times.setdefault(key, [])
        if not ts or ts[-1] != now:
            ts.append(now)

    def on_insert(self, key, now):
        self._add(key, now)

    def on_hit(self, key, now):
        self._add(key, now)

    def on_split(self, head, tail, now):
        self.times[tail] = [t for t in self.times.get(head, []) if t < now]

    def on_remove(self, key):
        pass

    def set_evictable(self, key, evictable):
        pass

    def victim(self, now):
        raise AssertionError("the recorder never evicts")

    def __len__(self):
        return len(self.times)

    def __contains__(self, key):
        return key in self.times


def prefix_access_times(prompts: Sequence[np.ndarray]) -> dict[Hashable, list[int]]:
    """For an offline oracle on prefix traces: replay the prompts (request r at time r) through an unbounded tree
    and return, per node key, the sorted request times that touched that node. Every node that a bounded tree can
    hold starts at a boundary of the unbounded tree (a request end or a divergence point), so its key is here."""
    rec = _AccessRecorder()
    tree = RadixCache(1 << 62, policy=rec)
    for r, toks in enumerate(prompts):
        tree.match_prefix(toks, now=r)
        tree.insert(toks, now=r)
    return rec.times
