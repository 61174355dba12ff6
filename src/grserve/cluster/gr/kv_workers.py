"""KV-cache workers (BAT §5.1) and how a ranking instance reads item KV from them.

- ``KVCacheWorker``, a Ray actor: item KV in a paged store at item granularity (its HRCS share: the replicated hot
  items and its shard), ``put`` / ``get`` / ``drop`` as ``wire.ItemKV``; its store grows with what it is given; its
  ``poll`` is the heartbeat the front end's meta service watches (``meta_service.py``).
- ``ClusterItemSource``: an instance's ``ItemKVSource`` when the item KV lives on the workers. Per request it asks
  each worker for the candidates it is to read there — its colocated worker (index = instance index mod workers)
  for replicated items, an item's home worker otherwise — all at once, and reassembles the answers in request
  order. An item it cannot get (no placement yet, a replaced item not recomputed yet, a dead worker, a replica
  just dropped) is a miss: the runner computes it inline, so a request never fails for lack of item KV. Remote
  items and bytes (from a worker other than its own) and the time spent fetching are counted.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from grserve.cluster.wire import GRPoll, ItemKV, ItemPlacement
from grserve.kvcache.paged import PagedKVStore

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.config import RankingServeConfig


def kv_cache_workers(cfg: RankingServeConfig, instances: int) -> int:
    """How many KV-cache workers a ranking cluster of ``instances`` runs: ``--kv-cache-workers`` (default: one per
    instance), none when the prefix policy reads no item KV."""
    from grserve.scheduler.prefix_choice import PREFIX_POLICIES

    n = cfg.hrcs.kv_cache_workers
    if not PREFIX_POLICIES.get(cfg.ranking.policy).uses_item_cache:
        return 0
    return instances if n is None else n


def item_kv(items: Sequence[tuple[int, torch.Tensor]]) -> ItemKV:
    """(item id, KV [L, 2, n, Hkv, D]) pairs as one message."""
    return ItemKV(tuple(i for i, _ in items), tuple(int(kv.shape[2]) for _, kv in items),
                  torch.cat([kv for _, kv in items], dim=2))


class KVCacheWorker:
    def __init__(self, index: int, page_size: int = 16):
        self.index, self.page_size = index, page_size
        self.store: PagedKVStore | None = None  # shaped by the first KV it is given

    async def put(self, items: ItemKV) -> int:
        off = 0
        for i, n in zip(items.item_ids, items.lengths):
            kv = items.kv[:, :, off:off + n]
            off += n
            if self.store is None:
                L, _, _, h, d = kv.shape
                self.store = PagedKVStore(L, h, d, num_pages=0, page_size=self.page_size, dtype=kv.dtype)
            while not self.store.put(int(i), kv):
                self.store.grow(max(self.store.pages_for(n), self.store.num_pages // 2, 64))
        return len(items.item_ids)

    async def get(self, item_ids: Sequence[int]) -> ItemKV:
        s = self.store
        held = [int(i) for i in item_ids if s is not None and int(i) in s]
        kv = s.get_concat(held) if held else torch.zeros(0)
        return ItemKV(tuple(held), tuple(s.length(i) for i in held) if held else (), kv)

    async def drop(self, item_ids: Sequence[int]) -> int:
        return sum(self.store.remove(int(i)) for i in item_ids) if self.store is not None else 0

    async def poll(self, wait_s: float = 0.25) -> GRPoll:
        await asyncio.sleep(wait_s)
        s = self.store
        return GRPoll({"items": float(len(s)) if s else 0.0, "stored_bytes": float(s.used_bytes) if s else 0.0})

    def pid(self) -> int:
        return os.getpid()


def spawn_kv_worker(index: int, page_size: int) -> ActorHandle:
    import ray

    return ray.remote(KVCacheWorker).options(num_cpus=0, max_restarts=0, max_concurrency=64,
                                             scheduling_strategy="SPREAD").remote(index, page_size)


class ClusterItemSource:
    """Instance ``index``'s view of the item KV on the KV-cache workers (module docstring)."""

    def __init__(self, index: int, timeout_s: float = 10.0):
        self.index, self.timeout_s = index, timeout_s
        self.placed: ItemPlacement | None = None
        self.forgotten: set[int] = set()  # replaced here, not yet recomputed into the workers
        self.counters = {"items_fetched": 0, "items_fetched_remote": 0, "item_bytes_fetched_remote": 0,
                         "item_fetch_failures": 0}

    def place(self, placed: ItemPlacement) -> None:
        """The front end's newest placement (it is sent after every item it lists has its KV in the workers)."""
        self.placed, self.forgotten = placed, set()

    def forget(self, item_id: int) -> None:
        self.forgotten.add(int(item_id))

    def has(self, item_ids: Sequence[int]) -> list[bool]:
        p = self.placed
        return [p is not None and int(i) in p.placement.home and int(i) not in self.forgotten for i in item_ids]

    def fetch(self, item_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        import ray

        p = self.placed
        want: dict[int, list[int]] = {}
        for i, ok in zip(item_ids, self.has(item_ids)):
            if ok:
                local = self.index % len(p.workers)
                w = local if int(i) in p.placement.replicated else p.placement.home[int(i)]
                want.setdefault(w, []).append(int(i))
        refs = {w: p.workers[w].get.remote(ids) for w, ids in want.items()}  # every worker at once
        got: dict[int, torch.Tensor] = {}
        for w, ref in refs.items():
            try:
                ans: ItemKV = ray.get(ref, timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - a dead or hung worker: its items are computed here until rebuilt
                self.counters["item_fetch_failures"] += 1
                continue
            off = 0
            for i, n in zip(ans.item_ids, ans.lengths):
                got[i] = ans.kv[:, :, off:off + n]
                off += n
            if w != self.index % len(p.workers):
                self.counters["items_fetched_remote"] += len(ans.item_ids)
                self.counters["item_bytes_fetched_remote"] += ans.kv.numel() * ans.kv.element_size()
        hits = [int(i) in got for i in item_ids]
        self.counters["items_fetched"] += len(got)
        parts = [got[int(i)] for i in item_ids if int(i) in got]
        return (torch.cat(parts, dim=2) if parts else torch.zeros(0)), hits
