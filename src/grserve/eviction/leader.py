"""``leader`` and ``density``: a learned hit-density ranking for prefix blocks, and a policy that follows
whichever of LRU, window-LFU and that ranking is winning in sampled miniature caches.

Three *experts* rank the same cached keys:

* **lru**: the least recently used evictable key;
* **lfu**: window-LFU (frequency over the last ``lfu_window`` accesses, LRU on ties; ``lfu.py``, embedded — its
  recency index is the LRU order too);
* **learned** (``density`` on its own): the key with the lowest hit density from ``HitModel`` —
  P(reused | class, idle age) / expected ticks until that reuse, where the class is the key's windowed access
  count and its prefix-tree shape (leaf / one child / branch point; the root block). Keys of a class are kept in
  access order and the candidates are the oldest and the newest of every class (at most 2·N_CLASSES per
  eviction): a hit density that falls with age evicts old keys, one that rises (a loop) evicts young ones. A key
  made evictable again (radix: a parent whose last child left, an unlocked path) rejoins its class: the oldest
  key of a class comes from a lazy min-heap on last access (O(log n)), the newest from the class's insertion
  order.
  ``invert=True`` evicts the *highest* density instead (the adversarial-prediction experiment).

``leader`` evicts by the expert whose *miniature cache* has the most (exponentially decayed) hits. Each
miniature is a full instance of that expert with capacity k/R fed only the keys in a 1/R spatial sample of the
key space (a hash of the key, SHARDS-style), R = min(8, k // 64) (R = 1 for small caches: exact shadows). The
leader changes only when another expert's decayed hits exceed the leader's by ``margin`` (hysteresis), so the
real cache keeps one expert's state on a stationary trace. This is what keeps the learned ranking safe: if its
predictions are bad, its miniature loses and the real cache runs LRU or LFU. The learned miniature scores with
the leader's own ``HitModel`` (``shared_model``: learned from every real access, never fed by the miniature), so
it is not handicapped by learning from a 1/R sample; the start and ties go to it.

Prefix structure: ``on_path(keys, now)`` (called by the cache with each request's block-hash path before its
accesses) records each key's depth and counts each key's distinct children. Without it every key is a depth-1
leaf and only frequency and age remain.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Sequence

from grserve.eviction.hit_model import N_CLASSES, HitModel, klass
from grserve.eviction.lfu import WindowLFUPolicy
from grserve.eviction.lru import LRUPolicy
from grserve.eviction.policy import EVICTION_POLICIES, EvictionPolicy, NoEvictableKey

EXPERTS = ("lru", "lfu", "learned")
_MIX = 0x9E3779B97F4A7C15


def sampled(key: Hashable, rate: int) -> bool:
    """Spatial sampling: is ``key`` in the 1/rate sample of the key space (a fixed hash, stable per key)?"""
    return rate == 1 or ((hash(key) * _MIX) >> 17) % rate == 0


class ExpertsPolicy(EvictionPolicy):
    """The cached keys ranked by the three experts; evicts by ``follow`` (``leader`` subclasses choose it)."""

    name = "experts"

    def __init__(self, capacity: int, follow: str = "learned", invert: bool = False, lfu_window: int | None = None,
                 max_keys: int = 1 << 21, structure: tuple[dict, dict] | None = None, model: HitModel | None = None):
        super().__init__(capacity)
        if follow not in EXPERTS:
            raise ValueError(f"follow must be one of {EXPERTS}, got {follow!r}")
        self.follow, self.invert, self.max_keys = follow, invert, max_keys
        # a shared ``model`` (a miniature of ``leader``) is read, never fed: its owner learns from every access
        self.learns = model is None
        self.model = model or HitModel(horizon=capacity, refresh_every=max(1024, min(4096, 4 * capacity)))
        self.lfu = WindowLFUPolicy(capacity, window=lfu_window or 10 * capacity)
        self._meta: dict[Hashable, tuple[int, int]] = {}  # key -> (last access, class then)
        self._depth, self._children = structure if structure is not None else ({}, {})
        self._cached: dict[Hashable, bool] = {}  # cached key -> evictable
        self._by_class: list[dict[Hashable, None]] = [{} for _ in range(N_CLASSES)]  # evictable, insertion order
        self._heaps: list[list[tuple[int, int, Hashable]]] = [[] for _ in range(N_CLASSES)]  # (last, seq, key), lazy
        self._seq = 0
        self.n_evictable_ = 0
        self.stats.update({e + "_evictions": 0 for e in EXPERTS})

    # ---- prefix structure ----------------------------------------------------------------------------------
    def on_path(self, keys: Sequence[Hashable], now: int) -> None:
        depth, children = self._depth, self._children
        for j, k in enumerate(keys):
            if k not in depth:
                depth[k] = j
                if j:
                    children[keys[j - 1]] = children.get(keys[j - 1], 0) + 1

    # ---- events --------------------------------------------------------------------------------------------
    def _access(self, key: Hashable, now: int) -> None:
        m = self._meta.get(key)
        learns = self.learns
        if m is not None:
            if learns:
                self.model.close_event(m[1], now - m[0])
            if self._cached.get(key):
                del self._by_class[m[1]][key]
        c = klass(self.lfu._count.get(key, 1), self._children.get(key, 0), self._depth.get(key, 1))
        if learns:
            self.model.open_event(c)
        self._meta[key] = (now, c)
        if len(self._meta) > self.max_keys:  # forget the oldest-inserted history (dicts keep insertion order)
            old = next(iter(self._meta))
            if old not in self._cached:
                del self._meta[old]

    def on_hit(self, key: Hashable, now: int) -> None:
        self.lfu.on_hit(key, now)
        self._access(key, now)
        if self._cached[key]:
            self._join(key)

    def on_insert(self, key: Hashable, now: int) -> None:
        if key in self._cached:
            raise ValueError(f"{key!r} is already cached")
        self.lfu.on_insert(key, now)
        self._access(key, now)
        self._cached[key] = True
        self.n_evictable_ += 1
        self._join(key)

    def _join(self, key: Hashable) -> None:
        """Add an evictable key to its class: the dict (membership, newest) and the heap (oldest by last access)."""
        last, c = self._meta[key]
        cls, heap = self._by_class[c], self._heaps[c]
        cls[key] = None
        self._seq += 1
        heapq.heappush(heap, (last, self._seq, key))
        if len(heap) > 2 * len(cls) + 64:  # drop stale entries (amortised O(1))
            meta = self._meta
            heap[:] = [e for e in heap if e[2] in cls and meta[e[2]] == (e[0], c)]
            heapq.heapify(heap)

    def _oldest(self, c: int) -> Hashable:
        """The least recently accessed evictable key of class c (stale heap entries are popped)."""
        cls, heap, meta = self._by_class[c], self._heaps[c], self._meta
        while True:
            last, _, k = heap[0]
            if k in cls and meta[k] == (last, c):
                return k
            heapq.heappop(heap)

    def on_remove(self, key: Hashable) -> None:
        self.lfu.on_remove(key)
        if self._cached.pop(key):
            self.n_evictable_ -= 1
            del self._by_class[self._meta[key][1]][key]

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        if self._cached[key] == evictable:
            return
        self.lfu.set_evictable(key, evictable)
        self._cached[key] = evictable
        if evictable:  # back in its class, at its last access time in the heap
            self.n_evictable_ += 1
            self._join(key)
        else:
            self.n_evictable_ -= 1
            del self._by_class[self._meta[key][1]][key]

    # ---- eviction ------------------------------------------------------------------------------------------
    def learned_choice(self, now: int) -> Hashable:
        """The candidate (oldest and newest of each class) with the lowest hit density (highest if inverted)."""
        meta, score = self._meta, self.model.score
        sign = -1.0 if self.invert else 1.0
        best_k, best, best_last = None, float("inf"), 0
        for c, cls in enumerate(self._by_class):
            if not cls:
                continue
            for k in (self._oldest(c), next(reversed(cls))):
                last, c = meta[k]
                v = sign * score(c, now - last)
                if v < best or (v == best and last < best_last):
                    best_k, best, best_last = k, v, last
        return best_k

    def choice(self, expert: str, now: int) -> Hashable:
        idx = self.lfu.index
        if expert == "lru":
            return idx.oldest(1)
        if expert == "lfu":
            return idx.argmax_upto(idx.oldest_position(idx.n_evictable))
        return self.learned_choice(now)

    def victim(self, now: int) -> Hashable:
        if not self.n_evictable_:
            raise NoEvictableKey("no evictable key")
        oldest = self.lfu.index.oldest(1)
        model = self.model
        if self.learns:
            model.horizon += (now - self._meta[oldest][0] - model.horizon) / 64.0  # the LRU eviction age
        lead = self.leader()
        z = self.choice(lead, now)
        self.stats[lead + "_evictions"] += 1
        self.stats["evictions"] += 1
        del self._cached[z]
        del self._by_class[self._meta[z][1]][z]
        self.n_evictable_ -= 1
        self.lfu.on_remove(z)
        return z

    def leader(self) -> str:
        return self.follow

    # ---- introspection -------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._cached

    @property
    def n_evictable(self) -> int:
        return self.n_evictable_


@EVICTION_POLICIES.register("density")
class DensityPolicy(ExpertsPolicy):
    """The learned expert alone: evict the candidate with the lowest class hit density."""

    name = "density"

    def __init__(self, capacity: int, invert: bool = False, **kw):
        super().__init__(capacity, follow="learned", invert=invert, **kw)


@EVICTION_POLICIES.register("leader")
class LeaderPolicy(ExpertsPolicy):
    """Evict by the expert whose sampled miniature cache has the most recent hits (see the module docstring)."""

    name = "leader"

    def __init__(self, capacity: int, invert: bool = False, memory: int = 4096, margin: float = 0.01,
                 sample_rate: int | None = None, min_shadow: int = 64, start: str = "learned",
                 shared_model: bool = True, **kw):
        super().__init__(capacity, follow=start, invert=invert, **kw)
        self.rate = sample_rate or max(1, min(8, capacity // min_shadow))
        ks = max(1, capacity // self.rate)
        win = kw.get("lfu_window")
        self.shadows: dict[str, EvictionPolicy] = {
            "lru": LRUPolicy(ks),
            "lfu": WindowLFUPolicy(ks, window=(win or 10 * capacity) // self.rate or 1),
            "learned": DensityPolicy(ks, invert=invert, structure=(self._depth, self._children),
                                     lfu_window=(win or 10 * capacity) // self.rate or 1,
                                     model=self.model if shared_model else None),
        }
        self._shadow_cached: dict[str, set] = {e: set() for e in EXPERTS}
        self.hits = dict.fromkeys(EXPERTS, 0.0)
        self._keep = 1.0 - 1.0 / memory
        self.margin = margin
        self.stats["switches"] = 0

    def _shadow(self, key: Hashable, now: int) -> None:
        if not sampled(key, self.rate):
            return
        keep = self._keep
        for e, pol in self.shadows.items():
            cached = self._shadow_cached[e]
            self.hits[e] *= keep
            if key in cached:
                self.hits[e] += 1.0
                pol.on_hit(key, now)
                continue
            if len(cached) >= pol.capacity:
                cached.discard(pol.victim(now))
            pol.on_insert(key, now)
            cached.add(key)

    def on_hit(self, key: Hashable, now: int) -> None:
        self._shadow(key, now)
        super().on_hit(key, now)

    def on_insert(self, key: Hashable, now: int) -> None:
        self._shadow(key, now)
        super().on_insert(key, now)

    def leader(self) -> str:
        h, cur = self.hits, self.follow
        best = max(EXPERTS, key=lambda e: (h[e], e == cur))
        if best != cur and h[best] > (1.0 + self.margin) * h[cur]:
            self.follow = best
            self.stats["switches"] += 1
        return self.follow
