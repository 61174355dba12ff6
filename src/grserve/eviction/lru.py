"""LRU: evict the least recently used evictable key (the default of SGLang, vLLM, HugeCTR)."""

from __future__ import annotations

from typing import Hashable

from grserve.eviction.policy import EVICTION_POLICIES, IndexedPolicy, NoEvictableKey


@EVICTION_POLICIES.register("lru")
class LRUPolicy(IndexedPolicy):
    name = "lru"

    def on_insert(self, key: Hashable, now: int) -> None:
        self.index.touch(key)

    def on_hit(self, key: Hashable, now: int) -> None:
        self.index.touch(key)

    def on_remove(self, key: Hashable) -> None:
        self.index.remove(key)

    def victim(self, now: int) -> Hashable:
        if self.index.n_evictable == 0:
            raise NoEvictableKey("no evictable key")
        z = self.index.oldest(1)
        return self._evict(z)
