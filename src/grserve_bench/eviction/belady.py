"""Belady / OPT: evict the cached key whose next request is farthest in the future (offline; needs the future).

Independent of the predictive policies (a lazy max-heap, O(log k) amortised) so that "FPB/LARU with the oracle =
Belady" is a real cross-check. ``oracle`` is anything with ``next_access(key, now) -> float``
(``AccessListOracle``). Ties (only among never-requested-again keys, +inf) go to the oldest insertion.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Hashable

from grserve.eviction.policy import EVICTION_POLICIES, EvictionPolicy, NoEvictableKey


@EVICTION_POLICIES.register("belady", aliases=("opt",))
class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, capacity: int, oracle: Any = None):
        super().__init__(capacity)
        if oracle is None or not hasattr(oracle, "next_access"):
            raise ValueError("Belady needs oracle= with next_access(key, now) (e.g. AccessListOracle)")
        self.oracle = oracle
        self._next: dict[Hashable, tuple[float, int]] = {}  # key -> (next access, version)
        self._evictable: dict[Hashable, bool] = {}
        self._heap: list[tuple[float, int, int, Hashable]] = []  # (-next, seq, version, key)
        self._seq = itertools.count()
        self._n_evictable = 0

    def _push(self, key: Hashable, now: int) -> None:
        nxt = self.oracle.next_access(key, now)
        ver = next(self._seq)
        self._next[key] = (nxt, ver)
        heapq.heappush(self._heap, (-nxt, ver, ver, key))

    def on_insert(self, key: Hashable, now: int) -> None:
        self._evictable[key] = True
        self._n_evictable += 1
        self._push(key, now)

    def on_hit(self, key: Hashable, now: int) -> None:
        self._push(key, now)
        if len(self._heap) > 4 * len(self._next) + 64:  # drop stale entries (amortised O(1))
            self._heap = [(-n, v, v, k) for k, (n, v) in self._next.items()]
            heapq.heapify(self._heap)

    def on_remove(self, key: Hashable) -> None:
        del self._next[key]
        self._n_evictable -= self._evictable.pop(key)

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        if self._evictable[key] != evictable:
            self._evictable[key] = evictable
            self._n_evictable += 1 if evictable else -1
            if evictable:  # re-announce: its heap entry may have been dropped while locked
                nxt, _ = self._next[key]
                ver = next(self._seq)
                self._next[key] = (nxt, ver)
                heapq.heappush(self._heap, (-nxt, ver, ver, key))

    def victim(self, now: int) -> Hashable:
        if self._n_evictable == 0:
            raise NoEvictableKey("no evictable key")
        heap = self._heap
        while True:
            neg, _, ver, key = heapq.heappop(heap)
            cur = self._next.get(key)
            if cur is None or cur[1] != ver:
                continue  # stale entry
            if not self._evictable[key]:
                continue  # locked: dropped here, re-pushed by set_evictable(True)
            del self._next[key]
            del self._evictable[key]
            self._n_evictable -= 1
            self.stats["evictions"] += 1
            return key

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._next

    @property
    def n_evictable(self) -> int:
        return self._n_evictable
