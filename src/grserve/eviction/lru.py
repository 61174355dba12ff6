"""LRU: evict the least recently used evictable key (the default of SGLang, vLLM, HugeCTR)."""

from __future__ import annotations

from typing import Hashable

from grserve.eviction.policy import EvictionPolicy, NoEvictableKey
from grserve.eviction.recency import RecencyIndex


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.index = RecencyIndex(capacity)

    def on_insert(self, key: Hashable, now: int) -> None:
        self.index.touch(key)

    def on_hit(self, key: Hashable, now: int) -> None:
        self.index.touch(key)

    def on_remove(self, key: Hashable) -> None:
        self.index.remove(key)

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        self.index.set_evictable(key, evictable)

    def victim(self, now: int) -> Hashable:
        if self.index.n_evictable == 0:
            raise NoEvictableKey("no evictable key")
        z = self.index.oldest(1)
        self.index.remove(z)
        self.stats["evictions"] += 1
        return z

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.index

    @property
    def n_evictable(self) -> int:
        return self.index.n_evictable
