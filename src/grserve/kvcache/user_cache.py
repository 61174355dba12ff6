"""The user-prefix KV cache (BAT §5.1): paged, one entry per user, capacity in bytes, two replacement rules.

- ``lru``: the baselines' rule (BAT §6.1: "leverage CPU memory as an LRU cache"): any new user is admitted and
  the least recently used users are evicted until it fits.
- ``frequency``: BAT's rule: victims are the lowest-frequency users (decayed sliding-window frequency from the
  cache meta service), and only users whose frequency is **strictly below** the newcomer's may be evicted;
  when they cannot free enough pages the newcomer is not admitted (``plan_admission`` returns None).

A user larger than the whole cache is never admitted. Reads (``get``) refresh the LRU order.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from grserve.kvcache.paged import PagedKVStore

REPLACEMENTS = ("lru", "frequency")


class UserKVCache:
    def __init__(self, store: PagedKVStore, replacement: str = "lru",
                 frequency: Callable[[list[int]], dict[int, float]] | None = None):
        if replacement not in REPLACEMENTS:
            raise ValueError(f"unknown replacement {replacement!r}; choose one of {REPLACEMENTS}")
        if replacement == "frequency" and frequency is None:
            raise ValueError("frequency replacement needs a frequency source (the cache meta service)")
        self.store = store
        self.replacement = replacement
        self._frequency = frequency
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.RLock()
        self.evictions = 0

    # ---- reads --------------------------------------------------------------------------------------------
    def __contains__(self, user_id: int) -> bool:
        return user_id in self.store

    def __len__(self) -> int:
        return len(self.store)

    def get(self, user_id: int) -> torch.Tensor | None:
        with self._lock:
            if user_id not in self.store:
                return None
            self._lru.move_to_end(user_id)
            return self.store.get(user_id)

    def users(self) -> list[int]:
        return list(self._lru)

    def min_frequency(self) -> float:
        """min f_p over cached users; +inf when the cache is empty (nothing to displace)."""
        with self._lock:
            if not self._lru or self._frequency is None:
                return float("inf")
            return min(self._frequency(list(self._lru)).values())

    def fits_free(self, num_tokens: int) -> bool:
        return self.store.pages_for(num_tokens) <= self.store.free_pages

    def fits_at_all(self, num_tokens: int) -> bool:
        return self.store.pages_for(num_tokens) <= self.store.num_pages

    # ---- admission ----------------------------------------------------------------------------------------
    def plan_admission(self, num_tokens: int, user_frequency: float | None = None) -> list[int] | None:
        """Victims to evict so a ``num_tokens`` user fits ([] when it fits already), or None when it cannot."""
        need = self.store.pages_for(num_tokens)
        with self._lock:
            if need > self.store.num_pages:
                return None
            missing = need - self.store.free_pages
            if missing <= 0:
                return []
            if self.replacement == "lru":
                order = list(self._lru)
            else:
                freqs = self._frequency(list(self._lru))
                limit = float("inf") if user_frequency is None else user_frequency
                order = sorted((u for u in self._lru if freqs[u] < limit), key=lambda u: freqs[u])
            victims, freed = [], 0
            for u in order:
                if freed >= missing:
                    break
                victims.append(u)
                freed += self.store.entry_pages(u)
            return victims if freed >= missing else None

    def admit(self, user_id: int, kv: torch.Tensor, victims: list[int] | None = None) -> bool:
        """Evict ``victims`` (from ``plan_admission``) and store the user's KV. False when it still does not fit."""
        with self._lock:
            if user_id in self.store:
                self.remove(user_id)
            for u in victims or ():
                if self.remove(u):
                    self.evictions += 1
            ok = self.store.put(user_id, kv)
            if ok:
                self._lru[user_id] = None
            return ok

    def remove(self, user_id: int) -> bool:
        with self._lock:
            self._lru.pop(user_id, None)
            return self.store.remove(user_id)
