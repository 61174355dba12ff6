"""The one eviction interface every grserve cache uses, the predictor protocol, and the by-name registry
(``EVICTION_POLICIES``; every policy module registers its class, its package imports them all).

A cache drives its policy with a small event protocol (``now`` is the cache's logical clock, one tick per
request; several events may share a tick):

* ``on_hit(key, now)``      a cached key was requested;
* ``on_miss(key, now)``     a request for a key that is not cached (before any eviction it causes; LARU uses it
                            to detect prediction-induced misses; the others ignore it);
* ``on_insert(key, now)``   the key is now cached (evictable by default);
* ``victim(now)``           choose a key to evict among the *evictable* cached keys, forget it and return it —
                            the cache must then drop it;
* ``on_remove(key)``        the cache dropped a key for its own reasons (invalidation);
* ``set_evictable(key, b)`` lock/unlock a key (radix cache: in-use nodes and inner nodes are not evictable).

Policies never touch cached values or tensors; they only see keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Hashable, Protocol, Sequence, runtime_checkable

from grserve.eviction.recency import RecencyIndex
from grserve.registry import Registry


class NoEvictableKey(RuntimeError):
    """``victim`` was called while every cached key is locked (or the cache is empty)."""


@runtime_checkable
class NextAccessPredictor(Protocol):
    """Predicts each key's next request time (logical clock).

    ``stable`` is True when a key's prediction can only change when that key is accessed (oracles, noisy oracles,
    random/constant predictions): then predicting at access time gives exactly the values Algorithm 1 Line 23
    would compute at eviction time, and the policies use that equivalence to skip per-eviction re-prediction.
    """

    stable: bool

    def observe(self, key: Hashable, now: int) -> None: ...

    def predict(self, keys: Sequence[Hashable], now: int) -> Sequence[float]: ...


class EvictionPolicy(ABC):
    name: str = "?"

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be ≥ 1, got {capacity}")
        self.capacity = capacity
        self.stats: dict[str, int] = {"evictions": 0, "predictions": 0, "predictor_calls": 0}

    # ---- events --------------------------------------------------------------------------------------------
    @abstractmethod
    def on_insert(self, key: Hashable, now: int) -> None: ...

    @abstractmethod
    def on_hit(self, key: Hashable, now: int) -> None: ...

    def on_miss(self, key: Hashable, now: int) -> None:  # noqa: B027 - optional hook
        """A request for an uncached key (called before the eviction it may cause)."""

    @abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def set_evictable(self, key: Hashable, evictable: bool) -> None: ...

    @abstractmethod
    def victim(self, now: int) -> Hashable:
        """Choose, forget and return an evictable key; raise ``NoEvictableKey`` if there is none."""

    def on_split(self, head: Hashable, tail: Hashable, now: int) -> None:
        """A cached item was divided (radix node split): ``head`` keeps its key, ``tail`` is new.

        Default: the tail is a fresh insertion. Oracle/learned predictors may copy the history (see docs)."""
        self.on_insert(tail, now)

    def close(self) -> None:  # noqa: B027 - background workers override
        """Stop background work (ASYNC prediction threads)."""

    # ---- introspection -------------------------------------------------------------------------------------
    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...

    @property
    def n_evictable(self) -> int:
        return len(self)


INITIAL_INDEX_SIZE = 1 << 12  # keys a policy's RecencyIndex holds before it first grows


class IndexedPolicy(EvictionPolicy):
    """A policy whose state is a ``RecencyIndex`` (LRU order + per-key values): LRU, window-LFU, FPB/HF/LARU."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # the tree grows with the keys (RecencyIndex._rebuild): a huge capacity (an upper bound, e.g. a prefix
        # cache bounded by --kv-budget-bytes) allocates nothing up front
        self.index = RecencyIndex(min(capacity, INITIAL_INDEX_SIZE))

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        self.index.set_evictable(key, evictable)

    def _evict(self, z: Hashable) -> Hashable:
        """Forget the chosen victim and count the eviction."""
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


EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")  # each policy file registers its class


def policy_names() -> tuple[str, ...]:
    return EVICTION_POLICIES.names()


def make_policy(name: str, capacity: int, **kw: Any) -> EvictionPolicy:
    """Build a policy by name. Learned policies need ``predictor=``; Belady (the lab's) needs ``oracle=``.

    Extra keywords go to the policy's constructor (e.g. ``mode``, ``b``, ``decay_every``, ``candidates``)."""
    return EVICTION_POLICIES.create(name, capacity, **kw)
