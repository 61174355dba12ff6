"""Prefix blocks of GR retrieval prompts: the K/V of full, block-aligned prompt prefixes kept across requests.

A GR prompt repeats from request to request in two ways: the instruction (a chat model's system prompt and
instruction before every user's items) and the returning user (the same history plus the last visit's items).
This cache keeps the K/V of full prompt blocks between batches so that a request computes only what no earlier
request computed (docs/architecture.md, "Prefix reuse in retrieval"):

* **Keys**: the chained hash of each full block of ``block_size`` tokens (``kvcache/block_hash.py``): a hash names
  the block's whole prefix from position 0, so equal keys mean equal K/V (RoPE at the same absolute positions).
* **Load** (``load``, at a batch's prefill): the longest chain of cached blocks of the prompt is *copied* into the
  request's ``shared_kv`` slot (any head-major ``[layers, Hkv, tokens, D]`` view: ``BeamKV``, ``PaddedBeamKV``, a
  thinking request's buffer). At least one prompt token is left to compute (its hidden state starts the beams), so
  at most ``⌊(L − 1) / B⌋`` blocks are loaded. Copy, not share: ``shared_kv`` is one contiguous tensor per batch,
  and a copied block needs no pin: an entry can be evicted the moment the copy is done.
* **Store** (``store``, after the prefill): every full block of the prompt not cached yet is copied out of
  ``shared_kv``, in order, while room can be made without evicting the prompt's own blocks (an ancestor evicted
  for its descendant would leave both unreachable). The partial last block is never stored.
* **Eviction**: one ``EvictionPolicy`` per tier (``eviction/``: LRU, LARU, leader, …), keys = block hashes; the
  policy sees ``on_path`` (the request's hash path, for ``leader`` / ``density``), a hit per matched block and a
  miss at the first block that is not cached (LARU's prediction-induced-miss test). Evicting an inner block leaves
  its descendants unreachable; they are matched by no one and age out by the same policy.
* **Tiers**: the device tier (the model's device) and, when ``host_tokens`` > 0, a host tier (pinned memory on
  CUDA, LRU): a block the device tier's policy evicts *spills* to the host tier and is dropped only when the host
  tier evicts it. A host hit is copied from host memory and the block moves back to the device tier. On a CPU the
  two tiers would be the same memory, so a CPU cache has one (``serve`` refuses ``--prefix-cache-host-tokens``
  there).
* **Budget** (``KVBudget``): the device tier's bytes and the beam KV of the batches running count against one
  budget. A batch reserves its beam KV before it runs; the cache gives way (``give_way``: spill or evict by its
  policy) until both fit, never the request: a batch that does not fit even with an empty cache still runs, and
  the cache stores nothing while the budget is short.

``listener`` (the cluster's KV event publisher, as ``SharedPrefixCache``'s): ``stored_blocks(tokens, groups)`` after a
store added blocks (``groups``: (hash, start, stop)), ``evicted_blocks(hashes)`` when blocks leave the last tier.

Thread-safe: the retrieval engine runs up to ``max_inflight_batches`` batches at once; every call holds one lock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from grserve.eviction.lru import LRUPolicy
from grserve.eviction.policy import EvictionPolicy
from grserve.kvcache.block_hash import chained_block_hashes
from grserve.kvcache.shared_prefix import block_policy


class KVBudget:
    """Bytes of device memory for KV: the beam KV of running batches (``reserve`` / ``release``) plus the prefix
    cache's device tier (which reads ``in_flight`` and gives way). ``total`` None: no bound but the cache's own."""

    def __init__(self, total: int | None):
        self.total = total
        self.in_flight = 0
        self._lock = threading.Lock()

    def reserve(self, n: int) -> None:
        with self._lock:
            self.in_flight += n

    def release(self, n: int) -> None:
        with self._lock:
            self.in_flight -= n

    def room(self) -> int | None:
        """Bytes left for the cache's device tier (None: unbounded)."""
        return None if self.total is None else self.total - self.in_flight


@dataclass
class Block:
    k: torch.Tensor  # [layers, Hkv, B, D]
    v: torch.Tensor
    parent: int | None


@dataclass
class PrefixMatch:
    """A prompt's block hashes and how many of its first tokens were loaded from the cache."""

    hashes: list[int]
    tokens: int  # loaded tokens (a multiple of the block size)


class _Tier:
    def __init__(self, name: str, capacity_blocks: int, policy: EvictionPolicy, device: torch.device, pin: bool):
        self.name, self.capacity, self.policy = name, capacity_blocks, policy
        self.device, self.pin = device, pin
        self.blocks: dict[int, Block] = {}


class PrefixBlockCache:
    def __init__(self, capacity_tokens: int, *, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 policy: EvictionPolicy | str = "lru", host_tokens: int = 0, budget: KVBudget | None = None,
                 **policy_kw: Any):
        if block_size < 1:
            raise ValueError("block_size must be ≥ 1")
        if capacity_tokens < block_size:
            raise ValueError(f"capacity_tokens ({capacity_tokens}) must hold one block of {block_size} tokens")
        self.block_size = block_size
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_bytes = 2 * num_layers * num_kv_heads * head_dim * block_size * torch.empty(
            0, dtype=dtype).element_size()
        self.budget = budget or KVBudget(None)
        self._policy_spec = (policy, policy_kw)
        self._host_blocks = host_tokens // block_size
        self._capacity_blocks = capacity_tokens // block_size
        self.listener: Any = None
        self._lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        """Empty both tiers; new policies (when given by name) and counters."""
        gone = [h for t in getattr(self, "tiers", []) for h in t.blocks]
        policy, kw = self._policy_spec
        pin = self.device.type == "cuda"
        self.tiers = [_Tier("device", self._capacity_blocks,
                            block_policy(policy, self._capacity_blocks, **kw), self.device, False)]
        if self._host_blocks > 0:
            self.tiers.append(_Tier("host", self._host_blocks, LRUPolicy(self._host_blocks), torch.device("cpu"),
                                    pin))
        self.clock = 0
        self.stats = {"lookups": 0, "lookup_tokens": 0, "hit_tokens": 0, "host_hit_blocks": 0, "stored_blocks": 0,
                      "evicted_blocks": 0, "spilled_blocks": 0, "gave_way_blocks": 0, "store_skipped_blocks": 0}
        if self.listener is not None and gone:
            self.listener.evicted_blocks(gone)

    # ---- what a runner calls ---------------------------------------------------------------------------------
    def load(self, tokens: np.ndarray, k_dst: torch.Tensor, v_dst: torch.Tensor) -> PrefixMatch:
        """Copy the longest cached chain of ``tokens``' full blocks (at most ⌊(L − 1) / B⌋) into ``k_dst`` /
        ``v_dst`` [layers, Hkv, ≥ L, D] from position 0; returns the prompt's hashes and the tokens loaded."""
        B = self.block_size
        hashes = chained_block_hashes(tokens, B)
        limit = (len(tokens) - 1) // B
        with self._lock:
            now = self._tick()
            dev = self.tiers[0]
            on_path = getattr(dev.policy, "on_path", None)
            if on_path is not None:
                on_path(hashes, now)
            n = 0
            for g, h in enumerate(hashes):
                tier = self._find(h)
                if tier is None:
                    dev.policy.on_miss(h, now)
                    break
                if tier is dev:
                    dev.policy.on_hit(h, now)
                    blk = dev.blocks[h]
                else:  # a host hit: back to the device tier
                    self.stats["host_hit_blocks"] += 1
                    blk = self._promote(h, now)
                if g < limit:
                    k_dst[:, :, g * B:(g + 1) * B].copy_(blk.k, non_blocking=True)
                    v_dst[:, :, g * B:(g + 1) * B].copy_(blk.v, non_blocking=True)
                    n += 1
            self.stats["lookups"] += 1
            self.stats["lookup_tokens"] += len(tokens)
            self.stats["hit_tokens"] += n * B
        return PrefixMatch(hashes, n * B)

    def store(self, tokens: np.ndarray, match: PrefixMatch, k_src: torch.Tensor, v_src: torch.Tensor) -> int:
        """Copy the prompt's full blocks that are not cached out of ``k_src`` / ``v_src`` (its ``shared_kv``, all
        of the prompt computed or loaded). Returns the blocks added."""
        B = self.block_size
        added: list[tuple[int, int, int]] = []
        with self._lock:
            now = self._tick()
            dev = self.tiers[0]
            locked: list[int] = []  # the prompt's own blocks on the device: room is never made by evicting them
            try:
                for g, h in enumerate(match.hashes):
                    if h in dev.blocks:
                        dev.policy.set_evictable(h, False)
                        locked.append(h)
                        continue
                    if self._find(h) is not None:
                        continue
                    if not self._make_room(dev, 1):
                        self.stats["store_skipped_blocks"] += len(match.hashes) - g
                        break
                    k = k_src[:, :, g * B:(g + 1) * B].clone(memory_format=torch.contiguous_format)
                    v = v_src[:, :, g * B:(g + 1) * B].clone(memory_format=torch.contiguous_format)
                    dev.blocks[h] = Block(k, v, match.hashes[g - 1] if g else None)
                    dev.policy.on_insert(h, now)
                    dev.policy.set_evictable(h, False)
                    locked.append(h)
                    added.append((h, g * B, (g + 1) * B))
            finally:
                for h in locked:
                    dev.policy.set_evictable(h, True)
            self.stats["stored_blocks"] += len(added)
        if self.listener is not None and added:
            self.listener.stored_blocks(np.asarray(tokens), added)
        return len(added)

    def give_way(self) -> int:
        """Spill or evict device blocks (by the policy) until the device tier fits in what the budget leaves the
        running batches. Returns the blocks that left the device tier."""
        with self._lock:
            room = self.budget.room()
            if room is None:
                return 0
            dev, moved = self.tiers[0], 0
            while dev.policy.n_evictable and len(dev.blocks) * self.block_bytes > room:
                self._evict_one(dev)
                moved += 1
            self.stats["gave_way_blocks"] += moved
            return moved

    # ---- accounting --------------------------------------------------------------------------------------------
    def tier_bytes(self) -> dict[str, int]:
        return {t.name: len(t.blocks) * self.block_bytes for t in self.tiers}

    @property
    def bytes(self) -> int:
        """Bytes of the device tier (what counts against the budget)."""
        return len(self.tiers[0].blocks) * self.block_bytes

    @property
    def hit_rate(self) -> float:
        s = self.stats
        return s["hit_tokens"] / s["lookup_tokens"] if s["lookup_tokens"] else 0.0

    def __contains__(self, h: int) -> bool:
        return self._find(h) is not None

    def check(self) -> None:
        """Invariants (tests): each block in exactly one tier, on that tier's device; each tier within its capacity
        and holding exactly its policy's keys."""
        seen: set[int] = set()
        for t in self.tiers:
            assert len(t.blocks) <= t.capacity, f"{t.name} tier over capacity"
            assert len(t.policy) == len(t.blocks), f"{t.name} tier: policy and blocks disagree"
            for h, b in t.blocks.items():
                assert h in t.policy and h not in seen
                assert b.k.device.type == t.device.type
                seen.add(h)

    # ---- internals ---------------------------------------------------------------------------------------------
    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _find(self, h: int) -> _Tier | None:
        for t in self.tiers:
            if h in t.blocks:
                return t
        return None

    def _fits(self, tier: _Tier, n: int) -> bool:
        if len(tier.blocks) + n > tier.capacity:
            return False
        if tier is self.tiers[0]:
            room = self.budget.room()
            return room is None or (len(tier.blocks) + n) * self.block_bytes <= room
        return True

    def _make_room(self, tier: _Tier, n: int) -> bool:
        """Evict (spill) from ``tier`` by its policy until ``n`` more blocks fit; False if they cannot."""
        while not self._fits(tier, n):
            if tier.policy.n_evictable == 0:
                return False
            self._evict_one(tier)
        return True

    def _evict_one(self, tier: _Tier) -> None:
        h = tier.policy.victim(self.clock)
        blk = tier.blocks.pop(h)
        below = self.tiers[self.tiers.index(tier) + 1] if tier is not self.tiers[-1] else None
        if below is not None and self._make_room(below, 1):
            below.blocks[h] = self._moved(blk, below)
            below.policy.on_insert(h, self.clock)
            self.stats["spilled_blocks"] += 1
            return
        self.stats["evicted_blocks"] += 1
        if self.listener is not None:
            self.listener.evicted_blocks([h])

    def _promote(self, h: int, now: int) -> Block:
        """Move host block ``h`` up to the device tier (spilling the device policy's victims down); returns the
        block to copy from. With no room on the device (the budget), the block leaves the cache after this copy."""
        dev, host = self.tiers[0], self.tiers[1]
        blk = host.blocks.pop(h)
        host.policy.on_remove(h)
        if self._make_room(dev, 1):
            blk = dev.blocks[h] = self._moved(blk, dev)
            dev.policy.on_insert(h, now)
        else:
            self.stats["evicted_blocks"] += 1
            if self.listener is not None:
                self.listener.evicted_blocks([h])
        return blk

    def _moved(self, blk: Block, tier: _Tier) -> Block:
        if tier.device.type == "cpu" and tier.pin:
            k = torch.empty(blk.k.shape, dtype=blk.k.dtype, pin_memory=True)
            v = torch.empty(blk.v.shape, dtype=blk.v.dtype, pin_memory=True)
            k.copy_(blk.k)
            v.copy_(blk.v)
            return Block(k, v, blk.parent)
        return Block(blk.k.to(tier.device), blk.v.to(tier.device), blk.parent)
