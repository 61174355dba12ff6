"""Window-LFU: evict the evictable key requested least often among the last ``window`` requests.

Frequencies are counted over a sliding window of requests (hits and insertions), for cached and uncached keys
alike, so a formerly hot key cools down. Ties go to the least recently used key. The victim query is the same
O(log k) segment-tree argmax as LARU's, with value = −(window count).
"""

from __future__ import annotations

from collections import deque
from typing import Hashable

from grserve.eviction.policy import EVICTION_POLICIES, IndexedPolicy, NoEvictableKey


@EVICTION_POLICIES.register("lfu")
class WindowLFUPolicy(IndexedPolicy):
    name = "lfu"

    def __init__(self, capacity: int, window: int = 10_000):
        super().__init__(capacity)
        if window < 1:
            raise ValueError("window must be ≥ 1")
        self.window = window
        self._recent: deque[Hashable] = deque()
        self._count: dict[Hashable, int] = {}

    def _request(self, key: Hashable) -> None:
        self._recent.append(key)
        self._count[key] = self._count.get(key, 0) + 1
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            c = self._count[old] - 1
            if c:
                self._count[old] = c
            else:
                del self._count[old]
            if old in self.index and old != key:
                self.index.set_value(old, -float(c))

    def on_insert(self, key: Hashable, now: int) -> None:
        self._request(key)
        self.index.touch(key, value=-float(self._count[key]))

    def on_hit(self, key: Hashable, now: int) -> None:
        self._request(key)
        self.index.touch(key, value=-float(self._count[key]))

    def on_remove(self, key: Hashable) -> None:
        self.index.remove(key)

    def victim(self, now: int) -> Hashable:
        n = self.index.n_evictable
        if n == 0:
            raise NoEvictableKey("no evictable key")
        z = self.index.argmax_upto(self.index.oldest_position(n))
        return self._evict(z)
