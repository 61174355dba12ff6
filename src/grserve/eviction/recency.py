"""The LRU order with an O(log k) "l oldest → largest value" query (digest §10.3, §11.8).

Every tracked key sits at the leaf of a segment tree indexed by its *recency stamp* (a counter bumped on each
access, so stamps are unique and increase with recency). A leaf stores whether the key is evictable (count 1/0)
and its value (the predicted next-access time 𝒫 for the learned policies, −frequency for window-LFU). Internal
nodes keep the evictable count and (max value, leftmost position of the max). Then

* ``oldest(l)``: stamp of the l-th oldest evictable key, by count descent, O(log S);
* ``argmax_upto(pos)``: the key with the largest value among stamps ≤ pos, the *oldest* on ties, O(log S).

So "among the l LRU-oldest evictable items, the one with the largest predicted next-request time" (Algorithm 1,
Line 25) is two descents. Stamps grow without bound, so when they reach the tree size the live keys are
renumbered 0..n−1 in order (O(S), once per ≥ S/2 accesses: O(1) amortised). The tests compare it with a slow
list-based twin (``ReferenceRecency``, tests/grserve/eviction/test_eviction_policies.py).
"""

from __future__ import annotations

from typing import Hashable, Iterator

NEG_INF = float("-inf")


class RecencyIndex:
    def __init__(self, size_hint: int = 64):
        self._size = 1
        while self._size < max(2 * size_hint, 16):
            self._size *= 2
        self._alloc()
        self._stamp: dict[Hashable, int] = {}  # key -> stamp
        self._key_at: dict[int, Hashable] = {}  # stamp -> key
        self._value: dict[Hashable, float] = {}
        self._evictable: dict[Hashable, bool] = {}
        self._next = 0
        self.n_evictable = 0

    # ---- storage -------------------------------------------------------------------------------------------
    def _alloc(self) -> None:
        n = 2 * self._size
        self._cnt = [0] * n
        self._mx = [NEG_INF] * n
        self._am = [-1] * n  # leftmost leaf position holding _mx (−1: no evictable key below)

    def _set_leaf(self, pos: int, cnt: int, val: float) -> None:
        cnt_, mx, am = self._cnt, self._mx, self._am
        i = pos + self._size
        cnt_[i] = cnt
        if cnt:
            mx[i], am[i] = val, pos
        else:
            mx[i], am[i] = NEG_INF, -1
        i >>= 1
        while i:
            l, r = 2 * i, 2 * i + 1
            cnt_[i] = cnt_[l] + cnt_[r]
            if am[r] >= 0 and (am[l] < 0 or mx[r] > mx[l]):
                mx[i], am[i] = mx[r], am[r]
            else:
                mx[i], am[i] = mx[l], am[l]
            i >>= 1

    def _rebuild(self) -> None:
        """Renumber live keys 0..n−1 in recency order; grow the tree if it would be more than half full."""
        live = sorted(self._stamp.items(), key=lambda kv: kv[1])
        while 2 * len(live) + 2 > self._size:
            self._size *= 2
        self._alloc()
        self._key_at = {}
        size, cnt, mx, am = self._size, self._cnt, self._mx, self._am
        for pos, (key, _) in enumerate(live):
            self._stamp[key] = pos
            self._key_at[pos] = key
            if self._evictable[key]:
                cnt[size + pos], mx[size + pos], am[size + pos] = 1, self._value[key], pos
        for i in range(size - 1, 0, -1):
            l, r = 2 * i, 2 * i + 1
            cnt[i] = cnt[l] + cnt[r]
            if am[r] >= 0 and (am[l] < 0 or mx[r] > mx[l]):
                mx[i], am[i] = mx[r], am[r]
            else:
                mx[i], am[i] = mx[l], am[l]
        self._next = len(live)

    # ---- updates -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._stamp

    def touch(self, key: Hashable, value: float | None = None, evictable: bool | None = None) -> None:
        """Insert ``key`` or move it to the most-recently-used end (optionally updating value / evictability)."""
        old = self._stamp.get(key)
        if old is not None:
            self._set_leaf(old, 0, NEG_INF)
            del self._key_at[old]
        else:
            self._value[key] = NEG_INF if value is None else value
            self._evictable[key] = True if evictable is None else evictable
            self.n_evictable += self._evictable[key]
        if value is not None:
            self._value[key] = value
        if evictable is not None and old is not None and evictable != self._evictable[key]:
            self.n_evictable += 1 if evictable else -1
            self._evictable[key] = evictable
        if self._next >= self._size:
            self._stamp.pop(key, None)
            self._rebuild()
        pos = self._next
        self._next += 1
        self._stamp[key] = pos
        self._key_at[pos] = key
        self._set_leaf(pos, int(self._evictable[key]), self._value[key])

    def remove(self, key: Hashable) -> None:
        pos = self._stamp.pop(key)
        del self._key_at[pos]
        self.n_evictable -= self._evictable.pop(key)
        del self._value[key]
        self._set_leaf(pos, 0, NEG_INF)

    def set_value(self, key: Hashable, value: float) -> None:
        self._value[key] = value
        if self._evictable[key]:
            self._set_leaf(self._stamp[key], 1, value)

    def value(self, key: Hashable) -> float:
        return self._value[key]

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        if self._evictable[key] == evictable:
            return
        self._evictable[key] = evictable
        self.n_evictable += 1 if evictable else -1
        self._set_leaf(self._stamp[key], int(evictable), self._value[key])

    # ---- queries -------------------------------------------------------------------------------------------
    def oldest_position(self, l: int) -> int:
        """Stamp of the l-th oldest evictable key (1-based); requires 1 ≤ l ≤ n_evictable."""
        cnt = self._cnt
        i = 1
        while i < self._size:
            if cnt[2 * i] >= l:
                i = 2 * i
            else:
                l -= cnt[2 * i]
                i = 2 * i + 1
        return i - self._size

    def oldest(self, l: int = 1) -> Hashable:
        return self._key_at[self.oldest_position(l)]

    def argmax_upto(self, pos: int) -> Hashable:
        """Evictable key with the largest value among stamps ≤ pos; the oldest one on ties."""
        mx, am = self._mx, self._am
        best_v, best_p = NEG_INF, -1
        i, a, b = 1, 0, self._size
        while True:
            if b - 1 <= pos:
                if am[i] >= 0 and (best_p < 0 or mx[i] > best_v):
                    best_v, best_p = mx[i], am[i]
                break
            mid = (a + b) // 2
            if pos < mid:
                i, b = 2 * i, mid
            else:
                l = 2 * i
                if am[l] >= 0 and (best_p < 0 or mx[l] > best_v):
                    best_v, best_p = mx[l], am[l]
                i, a = 2 * i + 1, mid
        return self._key_at[best_p]

    def oldest_keys(self, l: int) -> list[Hashable]:
        """The l oldest evictable keys, oldest first (O(l log S); used for SYNC re-prediction of 𝓛)."""
        return [self._key_at[self.oldest_position(j)] for j in range(1, l + 1)]

    def keys(self) -> Iterator[Hashable]:
        """All tracked keys, oldest first."""
        return iter([k for k, _ in sorted(self._stamp.items(), key=lambda kv: kv[1])])
