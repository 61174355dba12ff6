"""The item-prefix KV pool (BAT §4.3, §5.1): one paged entry per item, precomputed for the whole catalog.

Under item-as-prefix every item starts at the same position and never sees another item, so its K/V depend on
its own tokens only: they are computed once (offline, ``grserve.engine.ranking.precompute_item_kv``) and shared
by every request. The pool is memory only; it never runs the model.

``ItemKVSource`` is what an inference worker reads item KV through: this local pool, or the cluster's
HRCS-placed KV-cache workers (``grserve.cluster.gr.kv_workers``), which also count the bytes moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from grserve.kvcache.paged import PagedKVStore


class ItemKVSource(Protocol):
    def fetch(self, item_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        """KV of the items that are cached, concatenated in request order ([L, 2, Σn, Hkv, D]), and a per-item
        hit flag (False → the caller computes that item)."""
        ...

    def has(self, item_ids: Sequence[int]) -> list[bool]:
        """Whether each item's KV is cached (reachable), without moving any KV."""
        ...


class ItemKVPool:
    def __init__(self, store: PagedKVStore):
        self.store = store

    def __contains__(self, item_id: int) -> bool:
        return item_id in self.store

    def __len__(self) -> int:
        return len(self.store)

    def put(self, item_id: int, kv: torch.Tensor) -> bool:
        return self.store.put(item_id, kv)

    def remove(self, item_id: int) -> bool:
        return self.store.remove(item_id)

    def get(self, item_id: int) -> torch.Tensor:
        return self.store.get(item_id)

    def has(self, item_ids: Sequence[int]) -> list[bool]:
        return [i in self.store for i in item_ids]

    def fetch(self, item_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        hits = [i in self.store for i in item_ids]
        return self.store.get_concat([i for i, h in zip(item_ids, hits) if h]), hits

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes
