"""Shared prefix blocks: a hash-keyed cache of full K/V blocks that requests *share* instead of copying.

vLLM-style automatic prefix caching on the hybrid pool (``kvcache/blocks.py``):

* **Keys**: the chained block hash of each full block of tokens (``kvcache/block_hash.py``); one entry holds one
  token group's K and V blocks (the group's two plane blocks), plus its parent's hash.
* **Save** (the end of a prefill, where the copying store copied rows out): every full computed block group of
  the request that is not cached yet is *adopted* — the cache retains the request's own blocks (reference
  count + 1), no copy.
* **Load** (admission of a KV request): the longest chain of cached groups of the prompt is attached to the new
  request's table (reference count + 1 each; the tokens are not computed). At least one prompt token is computed
  (its logits are sampled), so when the cached chain covers the whole prompt the last group is not shared: its
  cached rows up to the last token are copied into a private block (copy-on-write of a partial last block).
  Writes only ever go to private blocks: shared groups are full and lie before the request's first computed
  token.
* **Release**: a block returns to the free list when its last holder lets go (``BlockPool._drop``): the requests
  holding it and the cache. An entry no request holds is *evictable*; the pool counts its blocks as free and
  evicts entries (by the eviction policy, keys = block hashes) when a reservation needs them, or when the cache
  is over ``capacity_blocks`` groups. Evicting an inner group leaves its cached descendants unreachable; they hold
  no request and age out by the same policy.

The policy sees a hit per matched group and ``on_path`` (the request's hash path) when it defines it (``density``,
``leader``). Hit accounting: ``stats["hit_tokens"]`` counts the shared and copied tokens.

``listener`` (the cluster's KV event publisher, ``cluster/core/kv_index.py``): ``stored_blocks(tokens, groups)``
after a save adopted groups (``groups``: (hash, start, stop) of each, ``tokens`` the path from position 0),
``evicted_blocks(hashes)`` when groups go. ``clear()`` empties the cache (a benchmark's fresh start).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grserve.eviction.policy import EvictionPolicy, make_policy
from grserve.kvcache.block_hash import chained_block_hashes
from grserve.kvcache.blocks import BlockPool, BlockTable, HybridCacheStorage

LEARNED = ("fpb", "hf", "laru")


@dataclass
class Entry:
    blocks: tuple[int, ...]  # the group's K and V blocks
    parent: int | None


def block_policy(policy: EvictionPolicy | str, capacity_blocks: int, *, train_async: bool = False,
                 **policy_kw: Any) -> EvictionPolicy:
    """The eviction policy of a cache of prefix blocks (keys: chained block hashes): ``policy`` itself when it is
    an instance, else built by name; a learned one (LARU, FPB, HF) gets the online LightGBM next-access predictor
    unless ``predictor=`` is given (``train_async``: it refits on a background thread, not inside the access that
    triggers it). Shared by this cache and the retrieval engine's (``kvcache/prefix_blocks.py``)."""
    if not isinstance(policy, str):
        return policy
    kw = dict(policy_kw)
    if policy in LEARNED and "predictor" not in kw:
        from grserve.eviction.config import PredictorConfig
        from grserve.eviction.predictor import LearnedPredictor

        kw["predictor"] = LearnedPredictor(PredictorConfig(horizon=4096, window=16_384, retrain_every=2048,
                                                           min_train=256), train_async=train_async)
    return make_policy(policy, capacity_blocks, **kw)


class SharedPrefixCache:
    shares_blocks = True

    def __init__(self, pool: BlockPool, capacity_blocks: int, policy: EvictionPolicy | str = "lru",
                 **policy_kw: Any):
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be ≥ 1")
        if pool.reclaimer is not None:
            raise ValueError("the pool already has a prefix cache")
        self.pool = pool
        self.capacity_groups = capacity_blocks
        self.capacity = capacity_blocks * pool.block_size  # tokens
        self.bytes = 0  # no memory beyond the pool's blocks
        self._policy_spec = (policy, policy_kw)
        self.policy = self._new_policy()
        self.listener: Any = None
        self.entries: dict[int, Entry] = {}
        self._of_block: dict[int, int] = {}  # block -> hash of its entry
        self._evictable: dict[int, bool] = {}
        self._reclaimable = 0  # blocks of evictable entries
        self.clock = 0
        self.stats = {"lookups": 0, "hit_tokens": 0, "lookup_tokens": 0, "shared_groups": 0, "cow_tokens": 0,
                      "adopted_groups": 0, "evicted_groups": 0}
        pool.reclaimer = self

    def _new_policy(self) -> EvictionPolicy:
        policy, policy_kw = self._policy_spec
        return block_policy(policy, self.capacity_groups, **policy_kw)

    def clear(self) -> None:
        """Empty the cache — every group back to the pool, the policy (when built by name) and the counters new.
        No request may hold a cached group."""
        if any(not ev for ev in self._evictable.values()):
            raise RuntimeError("clear() while requests hold cached blocks")
        gone = list(self.entries)
        for e in self.entries.values():
            self.pool.release(e.blocks)
        self.entries, self._of_block, self._evictable, self._reclaimable = {}, {}, {}, 0
        if isinstance(self._policy_spec[0], str):
            self.policy.close()
            self.policy = self._new_policy()
        else:
            for h in gone:
                self.policy.on_remove(h)
        self.clock = 0
        self.stats = {k: 0 for k in self.stats}
        if self.listener is not None and gone:
            self.listener.evicted_blocks(gone)

    # ---- the pool's view ----------------------------------------------------------------------------------
    def reclaimable(self) -> int:
        return self._reclaimable

    def reclaim(self, n_blocks: int) -> int:
        """Evict evictable entries (by the policy) until ≥ ``n_blocks`` blocks are freed or none is left."""
        freed = 0
        while freed < n_blocks and self.policy.n_evictable > 0:
            freed += self._evict(self.policy.victim(self.clock))
        return freed

    def unpinned(self, block: int) -> None:
        h = self._of_block.get(block)
        if h is not None:
            self._set_evictable(h, all(self.pool.request_holders(b) == 0 for b in self.entries[h].blocks))

    def _set_evictable(self, h: int, ev: bool) -> None:
        if self._evictable[h] != ev:
            self._evictable[h] = ev
            self._reclaimable += len(self.entries[h].blocks) * (1 if ev else -1)
            self.policy.set_evictable(h, ev)

    def _evict(self, h: int) -> int:
        e = self.entries.pop(h)
        if not self._evictable.pop(h):
            raise AssertionError(f"policy {self.policy.name} evicted a group a request holds")
        self._reclaimable -= len(e.blocks)
        for b in e.blocks:
            del self._of_block[b]
        self.pool.release(e.blocks)
        self.stats["evicted_groups"] += 1
        if self.listener is not None:
            self.listener.evicted_blocks([h])
        return len(e.blocks)

    # ---- the engine's hooks --------------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def match(self, tokens: list[int]) -> list[int]:
        """Hashes of the longest cached chain of full groups of ``tokens`` (counts as a lookup for the policy)."""
        now = self._tick()
        hashes = chained_block_hashes(tokens, self.pool.block_size)
        on_path = getattr(self.policy, "on_path", None)
        if on_path is not None:
            on_path(hashes, now)
        out = []
        for h in hashes:
            if h not in self.entries:
                self.policy.on_miss(h, now)
                break
            self.policy.on_hit(h, now)
            out.append(h)
        return out

    def attach(self, seq_id: int, tokens: list[int], n: int, spare: int,
               storage: HybridCacheStorage) -> tuple[int, int, int]:
        """Give request ``seq_id`` (no table yet) its cached prefix: share the matched full groups, copy-on-write
        the rows of a last group it cannot share whole. The plan reserved blocks for n tokens from 0; the request
        computes n tokens after its prefix if ``spare`` blocks allow, else n minus the prefix. Returns (prefix
        tokens m, tokens to compute now, blocks taken beyond the plan)."""
        pool, B = self.pool, self.pool.block_size
        self.stats["lookups"] += 1
        self.stats["lookup_tokens"] += len(tokens)
        matched = self.match(tokens)
        limit = len(tokens) - 1  # at least one token is computed
        full = min(len(matched), limit // B)
        m = limit if len(matched) > full else full * B  # the chain covers the last token: copy its group's head
        n_after = min(n, len(tokens) - m)
        used = matched[:full + 1] if m > full * B else matched[:full]  # the copy's source is pinned while copied
        pinned = sum(len(self.entries[h].blocks) for h in used if self._evictable[h])
        extra = pool.blocks_for(m + n_after, "kv") - full * pool.kv_planes + pinned - pool.blocks_for(n, "kv")
        if extra > spare:  # stay within the plan: at most n tokens in all, only whole shared groups
            full = min(full, (n - 1) // B)
            m, n_after = full * B, n - full * B
            extra = 0
        pool.attach(seq_id, [self.entries[h].blocks for h in matched[:full]])
        cow = matched[full] if m > full * B else None
        for h in matched[:full] + ([cow] if cow is not None else []):
            self._set_evictable(h, False)  # the copy's source too: the reservation must not reclaim it
        table = pool.reserve(seq_id, m + n_after, "kv")
        if cow is not None:
            src = self.entries[cow].blocks
            self._copy_rows(src, table, full, m - full * B, storage)
            self.unpinned(src[0])  # evictable again if no request holds it
        self.stats["shared_groups"] += full
        self.stats["hit_tokens"] += m
        return m, n_after, max(0, extra)

    def _copy_rows(self, src: tuple[int, ...], table: BlockTable, group: int, rows: int,
                   storage: HybridCacheStorage) -> None:
        B = self.pool.block_size
        off = torch.arange(rows)
        for p, b in enumerate(src):
            dst = table.planes[p][group]
            storage.data[:, dst * B + off] = storage.data[:, b * B + off]
        self.stats["cow_tokens"] += rows

    def save(self, tokens: list[int], storage: HybridCacheStorage, table: BlockTable) -> int:
        """Adopt the request's full computed groups that are not cached yet (no copy). Returns the groups added."""
        now = self._tick()
        B = self.pool.block_size
        hashes = chained_block_hashes(tokens[:table.num_tokens], B)
        added: list[tuple[int, int, int]] = []  # (hash, start, stop) of each group adopted
        for g, h in enumerate(hashes):
            if h in self.entries:
                continue
            if len(self.entries) >= self.capacity_groups and not self.reclaim(1):
                break
            blocks = tuple(p[g] for p in table.planes)
            self.pool.retain(blocks)
            self.entries[h] = Entry(blocks, hashes[g - 1] if g else None)
            for b in blocks:
                self._of_block[b] = h
            self._evictable[h] = False
            self.policy.on_insert(h, now)
            self.policy.set_evictable(h, False)
            added.append((h, g * B, (g + 1) * B))
        self.stats["adopted_groups"] += len(added)
        if self.listener is not None and added:
            self.listener.stored_blocks(tokens, added)
        return len(added)

    @property
    def hit_rate(self) -> float:
        return self.stats["hit_tokens"] / self.stats["lookup_tokens"] if self.stats["lookup_tokens"] else 0.0

    def check(self) -> None:
        """Invariants (tests): every entry's blocks are retained and in use; evictable == no request holds it."""
        pool = self.pool
        pool.check()
        n = 0
        for h, e in self.entries.items():
            for b in e.blocks:
                assert b in pool._retained and self._of_block[b] == h
            free = all(pool.request_holders(b) == 0 for b in e.blocks)
            assert self._evictable[h] == free, f"entry {h:x}: evictable flag stale"
            n += len(e.blocks) if free else 0
            assert h in self.policy
        assert n == self._reclaimable and len(self.entries) == len(self.policy)
        assert set(pool._retained) == set(self._of_block)
