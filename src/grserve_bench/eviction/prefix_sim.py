"""Replay a trace of *requests*, each a path of prefix-block keys (hash ids), through a unit-size block cache.

Three modes (``grserve bench cache --trace-file``):

* **block** (``leaves_only=False``): every key is an independent item — the paging loop of ``simulate.py``, one
  access per block, in request order;
* **radix** (``leaves_only=True``): the keys form a prefix tree (a block's id fixes its whole prefix, so its parent
  is the key before it in any path). A request hits the longest cached prefix of its path and inserts the rest;
  only cached blocks with no cached child are evictable (SGLang's leaf-only eviction), and the request's own path
  is locked while it is served. A block's parent is always cached while the block is (the invariant
  ``check_tree`` asserts);
* **engine** (``mode="engine"``): the LLM engine's shared-block cache (``kvcache/shared_prefix.py``). A request hits
  the longest cached *chain* of its path (a cached block after the first miss is not a hit: the engine recomputes
  from the first miss); its missing blocks are inserted, blocks already cached further down are left alone (as the
  engine's adoption skips them); the request's matched and inserted blocks are pinned while it is served, and
  every other cached block is evictable — inner ones too, as in vLLM (an evicted inner block leaves its cached
  descendants unreachable until they age out).

Time is the global block-access index in both modes (access j of a request that starts at t is at t + j), so an
``AccessListOracle.from_trace`` over the flattened keys is the exact next-use oracle of both (Belady on leaves in
radix mode, as in ``kvcache/radix.py``). A policy that defines ``on_path(keys, now)`` is told each request's path
before its accesses (the prefix-aware policies read the tree structure from it). ``policy_seconds`` is the
process CPU time spent in the policy and the cache loop (``time.process_time``, per request), not wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from grserve.eviction.policy import EvictionPolicy


@dataclass
class PathSimResult:
    requests: int = 0
    accesses: int = 0
    hits: int = 0
    policy_seconds: float = 0.0
    hits_per_request: list[int] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0


MODES = ("block", "radix", "engine")


def simulate_paths(paths: Sequence[Sequence[Hashable]], policy: EvictionPolicy, leaves_only: bool = False,
                   capacity: int | None = None, mode: str | None = None) -> PathSimResult:
    """Replay ``paths`` (one key list per request) through a cache of ``capacity`` blocks driven by ``policy``;
    ``mode`` one of ``MODES`` (default: radix if ``leaves_only`` else block)."""
    mode = mode or ("radix" if leaves_only else "block")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: one of {MODES}")
    sim = _Tree(policy, policy.capacity if capacity is None else capacity, mode == "radix")
    serve = {"block": sim.request_blocks, "radix": sim.request, "engine": sim.request_chain}[mode]
    res = PathSimResult()
    t = 0
    on_path = getattr(policy, "on_path", None)
    clock = time.process_time  # CPU time: the µs per access of a shared, loaded machine stay meaningful
    for path in paths:
        t0 = clock()
        if on_path is not None:
            on_path(path, t)
        h = serve(path, t)
        res.policy_seconds += clock() - t0
        res.hits += h
        res.hits_per_request.append(h)
        t += len(path)
    res.requests = len(paths)
    res.accesses = t
    return res


class _Tree:
    def __init__(self, policy: EvictionPolicy, capacity: int, leaves_only: bool):
        self.policy = policy
        self.capacity = capacity
        self.leaves_only = leaves_only
        self.cached: set[Hashable] = set()
        self.parent: dict[Hashable, Hashable | None] = {}
        self.children: dict[Hashable, int] = {}  # cached key -> number of cached children
        self.in_use: set[Hashable] = set()  # the cached blocks of the request being served (radix mode)

    def request_blocks(self, path: Sequence[Hashable], t: int) -> int:
        pol, cached, hits = self.policy, self.cached, 0
        for j, x in enumerate(path):
            if x in cached:
                pol.on_hit(x, t + j)
                hits += 1
                continue
            pol.on_miss(x, t + j)
            if len(cached) >= self.capacity:
                z = pol.victim(t + j)
                if z not in cached:
                    raise AssertionError(f"{pol.name} chose {z!r}, which is not cached")
                cached.remove(z)
            pol.on_insert(x, t + j)
            cached.add(x)
        return hits

    def _match(self, path: Sequence[Hashable], t: int) -> int:
        """The longest cached prefix of ``path`` (each block a hit for the policy); returns its length."""
        i = 0
        while i < len(path) and path[i] in self.cached:
            self.policy.on_hit(path[i], t + i)
            i += 1
        return i

    def request_chain(self, path: Sequence[Hashable], t: int) -> int:
        pol, cached, n = self.policy, self.cached, len(path)
        i = self._match(path, t)
        pinned = set(path[:i])
        for x in pinned:
            pol.set_evictable(x, False)
        for j in range(i, n):
            x = path[j]
            if x in cached:  # reachable only through a block evicted before it: recomputed, not a hit
                continue
            pol.on_miss(x, t + j)
            if len(cached) >= self.capacity:
                if pol.n_evictable == 0:  # every cached block is this request's: the rest is not cached
                    break
                z = pol.victim(t + j)
                if z not in cached or z in pinned:
                    raise AssertionError(f"{pol.name} evicted {z!r}: not cached, or pinned by the request")
                cached.remove(z)
            pol.on_insert(x, t + j)
            pol.set_evictable(x, False)
            cached.add(x)
            pinned.add(x)
        for x in pinned:
            pol.set_evictable(x, True)
        return i

    def request(self, path: Sequence[Hashable], t: int) -> int:
        pol, cached, n = self.policy, self.cached, len(path)
        i = self._match(path, t)
        if i == n:
            return n
        # The request's path is locked while it is served. Its matched blocks above path[i - 1] have a cached child
        # on the path, so they stay inner nodes; path[i - 1] may be a leaf, or an inner node whose other children
        # are all evicted below: it must not become evictable then (``_evict`` reads ``in_use``).
        self.in_use = set(path[:i])
        if i > 0:
            pol.set_evictable(path[i - 1], False)
        for j in range(i, n):
            x = path[j]
            pol.on_miss(x, t + j)
            if len(cached) >= self.capacity:
                if pol.n_evictable == 0:  # the whole cache is this request's path: the rest is not cached
                    break
                self._evict(pol.victim(t + j))
            prev = path[j - 1] if j else None
            self.parent[x] = prev
            pol.on_insert(x, t + j)
            cached.add(x)
            self.in_use.add(x)
            self.children[x] = 0
            if prev is not None:
                self.children[prev] += 1
            if j < n - 1:
                pol.set_evictable(x, False)  # on the path being extended
        else:
            j = n
        self.in_use = set()
        last = path[min(j, n) - 1] if j > 0 else None
        # unlock: the deepest cached block of this request is a leaf again (its ancestors have a cached child)
        if last is not None and last in cached and self.children[last] == 0:
            pol.set_evictable(last, True)
        return i

    def _evict(self, z: Hashable) -> None:
        if z not in self.cached or self.children.get(z):
            raise AssertionError(f"{self.policy.name} evicted {z!r}: not a cached leaf")
        self.cached.remove(z)
        del self.children[z]
        p = self.parent.get(z)
        if p is not None and p in self.cached:
            self.children[p] -= 1
            if self.children[p] == 0 and p not in self.in_use:
                self.policy.set_evictable(p, True)

    def check_tree(self) -> None:
        for k in self.cached:
            p = self.parent.get(k)
            assert p is None or p in self.cached, f"{k!r} cached without its parent"
