"""Prompt-prefix KV cache for LLM serving: a radix tree of cached token spans over a slot tensor.

Requests that share a prompt prefix (a system prompt, a few-shot header, a multi-turn history) skip computing it:
at admission the engine matches the prompt against the tree, copies the matched tokens' K/V from the store into
the request's own blocks and prefills only the rest; when a prefill completes, the prompt's new tokens' K/V are
copied into the store. The eviction policy of the tree is pluggable (``lru``, ``laru``, … — the LCR work's
policies through ``kvcache/radix.py``).

Decisions (docs/llm.md):
- **Copy, not share.** Cached K/V live in their own tensor ``kv[L, 2, capacity, width]`` (one slot per token)
  and are copied into the request's paged blocks, so the block pool, the schedulers' memory model and
  preemption stay exactly as before; the saving is compute (prefill tokens), the cost is one row copy per
  cached token per layer. Sharing blocks in place (vLLM / SGLang style) would save memory too but needs
  reference-counted blocks in the hybrid pool.
- **KV requests only.** A hidden-cache request stores x, not K/V, so it neither reads nor fills the store.
- **At least one token is computed**: the match is capped at n − 1 tokens, the last prompt token's logits are
  needed to sample.
- The store's K/V carry RoPE at their absolute positions, so a match is only valid from position 0 — which is
  what a prefix match is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from grserve.eviction.policy import EvictionPolicy
from grserve.kvcache.blocks import BlockTable, HybridCacheStorage
from grserve.kvcache.radix import RadixCache

LEARNED = ("fpb", "hf", "laru")  # policies that need a next-access predictor (LCR)


class PrefixKVStore:
    def __init__(self, capacity_tokens: int, num_layers: int, width: int, *, policy: EvictionPolicy | str = "lru",
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", **policy_kw: Any):
        self.capacity = capacity_tokens
        self.kv = torch.zeros(num_layers, 2, capacity_tokens, width, dtype=dtype, device=device)
        self._policy_spec = (policy, policy_kw)
        # store/evict hook (the cluster's KV event publisher): .stored(tokens, start, stop) after a span is
        # cached, .evicted(path_tokens, start, stop) when one goes (tokens[start:stop] of a path from position 0)
        self.listener: Any = None
        self.clear()

    def clear(self) -> None:
        """Empty the store: every slot free, a new tree (and policy, when given by name), the counters at 0."""
        self._free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64).tolist()  # a stack of free slots
        policy, policy_kw = self._policy_spec
        kw = dict(policy_kw)
        if policy in LEARNED and "predictor" not in kw:  # the online LightGBM next-access predictor
            from grserve.eviction.config import PredictorConfig
            from grserve.eviction.predictor import LearnedPredictor

            kw["predictor"] = LearnedPredictor(PredictorConfig(horizon=4096, window=16_384, retrain_every=2048,
                                                               min_train=256))
        self.tree = RadixCache(self.capacity, policy, on_evict=self._release, **kw)
        self.tree.on_evict_node = self._evicted
        self.stats = {"lookups": 0, "hit_tokens": 0, "lookup_tokens": 0, "inserted_tokens": 0}

    @classmethod
    def for_storage(cls, storage: HybridCacheStorage, capacity_tokens: int, policy: EvictionPolicy | str = "lru",
                    **policy_kw: Any) -> "PrefixKVStore":
        return cls(capacity_tokens, storage.num_layers, storage.width, policy=policy, dtype=storage.data.dtype,
                   device=storage.data.device, **policy_kw)

    @property
    def bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def _evicted(self, node) -> None:
        if self.listener is None:
            return
        parts, n = [], node
        while n is not None:
            parts.append(n.key)
            n = n.parent
        self.listener.evicted(np.concatenate(parts[::-1]), node.start, node.end)

    def _release(self, slots: np.ndarray) -> None:
        self._free.extend(int(s) for s in slots)

    def _alloc(self, start: int, stop: int) -> np.ndarray:
        n = stop - start
        if n > len(self._free):  # the tree never holds more tokens than there are slots
            raise AssertionError("prefix store: more tokens inserted than free slots")
        out = np.array(self._free[-n:][::-1], dtype=np.int64)
        del self._free[-n:]
        return out

    # ---- the engine's hooks: match + copy_in at admission, save at the end of a prefill -----------------------
    def match(self, tokens: list[int]) -> np.ndarray:
        """The store slots of the longest cached prefix of ``tokens[:-1]`` (at least one token is left to
        compute: its logits are sampled). Counts as an access for the eviction policy."""
        self.stats["lookups"] += 1
        self.stats["lookup_tokens"] += len(tokens)
        if len(tokens) < 2:
            return np.zeros(0, dtype=np.int64)
        return self.tree.match_prefix(tokens[:-1]).values

    def copy_in(self, slots: np.ndarray, storage: HybridCacheStorage, table: BlockTable) -> int:
        """Copy the K/V of ``slots`` (a matched prefix, possibly cut short) into ``table``'s rows 0…m−1 (the
        table must hold ≥ m tokens' blocks). Returns m."""
        m = len(slots)
        if m:
            rows = storage.row_index(table, 0, m)  # [2, m]: K rows, V rows
            src = torch.from_numpy(np.ascontiguousarray(slots)).to(self.kv.device)
            for plane in (0, 1):
                storage.data[:, rows[plane]] = self.kv[:, plane].index_select(1, src)
            self.stats["hit_tokens"] += m
        return m

    def save(self, tokens: list[int], storage: HybridCacheStorage, table: BlockTable) -> int:
        """Cache ``tokens`` (all computed into ``table``): the part beyond the cached prefix is copied from the
        request's rows into free slots (evicting per the policy). Returns how many tokens were new."""
        def write(start: int, stop: int, dst: torch.Tensor) -> None:
            rows = storage.row_index(table, start, stop)
            for plane in (0, 1):
                self.kv[:, plane].index_copy_(1, dst, storage.data[:, rows[plane]])

        return self._insert(tokens, write)

    def _insert(self, tokens: list[int], write) -> int:
        """Insert ``tokens`` into the tree; ``write(start, stop, dst_slots)`` fills each new span's slots. Counts the
        new tokens and tells the listener (the cluster's KV index publisher) what was stored."""
        new: list[tuple[int, int, np.ndarray]] = []

        def make(start: int, stop: int) -> np.ndarray:
            slots = self._alloc(start, stop)
            new.append((start, stop, slots))
            return slots

        self.tree.insert(np.asarray(tokens, dtype=np.int64), make)
        for start, stop, slots in new:
            write(start, stop, torch.from_numpy(slots).to(self.kv.device))
        added = sum(stop - start for start, stop, _ in new)
        self.stats["inserted_tokens"] += added
        if self.listener is not None:
            for start, stop, _ in new:
                self.listener.stored(tokens, start, stop)
        return added

    @property
    def hit_rate(self) -> float:
        return self.stats["hit_tokens"] / self.stats["lookup_tokens"] if self.stats["lookup_tokens"] else 0.0

    def check(self) -> None:
        """Invariants (tests): the tree's own, and free slots + cached tokens = capacity with no slot twice."""
        self.tree.check()
        used: list[int] = []
        for node in self.tree.nodes.values():
            used.extend(int(v) for v in node.value)
        assert len(used) == len(set(used)) == self.tree.size
        assert len(self._free) + len(used) == self.capacity
        assert not set(used) & set(self._free)
