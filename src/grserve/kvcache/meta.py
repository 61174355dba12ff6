"""The cache meta service's hotness (BAT §5.1): how often each user and item KV entry is read, no physical data.

Hotness is a **decayed sliding-window frequency** (the paper gives neither the window form nor the decay; our
choice): every access adds 1 and the sum decays with time constant W,

    f(t) = Σ_{accesses a ≤ t} exp(-(t - t_a) / W)

an exponentially weighted window of length ~W (a user issuing r requests per W has f ≈ r in steady state).
It is kept lazily per key as (value, last time), so an update or a read is O(1). Because the decay factor is the
same for every key, the ordering of keys by f never changes between accesses.

Time is passed in (seconds, any clock): the benchmark replays a trace's timestamps, the server passes wall time.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Iterable


class DecayedWindowFrequency:
    def __init__(self, window_s: float):
        if window_s <= 0:
            raise ValueError(f"window must be > 0, got {window_s}")
        self.window_s = float(window_s)
        self._state: dict[Hashable, tuple[float, float]] = {}

    def get(self, key: Hashable, now: float) -> float:
        st = self._state.get(key)
        if st is None:
            return 0.0
        value, t = st
        return value * math.exp(-max(now - t, 0.0) / self.window_s)

    def touch(self, key: Hashable, now: float, amount: float = 1.0) -> float:
        f = self.get(key, now) + amount
        self._state[key] = (f, max(now, self._state.get(key, (0.0, now))[1]))
        return f

    def snapshot(self, now: float, keys: Iterable[Hashable] | None = None) -> dict[Hashable, float]:
        ks = self._state.keys() if keys is None else keys
        return {k: self.get(k, now) for k in ks}

    def forget(self, key: Hashable) -> None:
        self._state.pop(key, None)

    def __len__(self) -> int:
        return len(self._state)


class CacheMetaService:
    """Hotness (user and item frequencies), thread-safe. Where each entry lives is the engine's own (a local user
    cache and item pool) or, in a ranking cluster, the front end's (``cluster/gr/meta_service.py``)."""

    def __init__(self, user_window_s: float = 300.0, item_window_s: float = 3600.0):
        self.user_freq = DecayedWindowFrequency(user_window_s)
        self.item_freq = DecayedWindowFrequency(item_window_s)
        self._lock = threading.Lock()

    # ---- hotness ------------------------------------------------------------------------------------------
    def record_request(self, user_id: int | None, item_ids: Iterable[int], now: float) -> float:
        """Update hotness for one request; returns the user's frequency *before* this access (the prediction)."""
        with self._lock:
            f_before = 0.0
            if user_id is not None:
                f_before = self.user_freq.get(user_id, now)
                self.user_freq.touch(user_id, now)
            for i in item_ids:
                self.item_freq.touch(i, now)
            return f_before

    def user_frequency(self, user_id: int, now: float) -> float:
        with self._lock:
            return self.user_freq.get(user_id, now)

    def user_frequencies(self, user_ids: Iterable[int], now: float) -> dict[int, float]:
        with self._lock:
            return {u: self.user_freq.get(u, now) for u in user_ids}

    def item_frequencies(self, now: float) -> dict[int, float]:
        with self._lock:
            return self.item_freq.snapshot(now)
