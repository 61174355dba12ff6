"""KV-cache workers and the cache meta service as Ray actors (BAT §5.1), or plain objects in one process.

- ``KVCacheWorker`` holds item KV in a paged store (its HRCS share: the replicated area + its shard).
- ``MetaServiceActor`` wraps ``CacheMetaService`` (index + hotness).
- ``ClusterItemSource`` is an inference worker's ``ItemKVSource``: items its colocated KV-cache worker holds are
  read locally; the others are fetched from an owner (through Ray when the workers are actors), and every
  remote byte is counted (``bytes_moved``). Candidate KV order does not matter to attention (keys are a set), so
  local and remote parts are simply concatenated.

``WorkerHandle.call(method, *args)`` is the one calling convention: a direct call in process, or
``ray.get(actor.method.remote(*args))``; ``submit``/``wait`` overlap several remote reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grserve.kvcache.meta import CacheMetaService
from grserve.kvcache.paged import PagedKVStore


class KVCacheWorker:
    def __init__(self, worker_id: int, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, dtype: torch.dtype = torch.float32):
        self.worker_id = worker_id
        self.store = PagedKVStore(num_layers, num_kv_heads, head_dim, num_pages=num_pages, page_size=page_size,
                                  dtype=dtype)

    def put_items(self, item_ids: Sequence[int], kv: torch.Tensor, lengths: Sequence[int]) -> int:
        """Store items given as one concatenated [L, 2, Σn, Hkv, D] tensor and their lengths."""
        off, n_ok = 0, 0
        for i, n in zip(item_ids, lengths):
            n_ok += self.store.put(int(i), kv[:, :, off:off + n])
            off += n
        return n_ok

    def drop_items(self, item_ids: Sequence[int]) -> int:
        return sum(self.store.remove(int(i)) for i in item_ids)

    def has(self, item_ids: Sequence[int]) -> list[bool]:
        return [int(i) in self.store for i in item_ids]

    def get_items(self, item_ids: Sequence[int]) -> torch.Tensor:
        return self.store.get_concat([int(i) for i in item_ids])

    def stored_bytes(self) -> int:
        return self.store.used_bytes

    def num_items(self) -> int:
        return len(self.store)


class MetaServiceActor:
    def __init__(self, user_window_s: float = 300.0, item_window_s: float = 3600.0):
        self.meta = CacheMetaService(user_window_s, item_window_s)

    def record_request(self, user_id, item_ids, now):
        return self.meta.record_request(user_id, item_ids, now)

    def item_frequencies(self, now):
        return self.meta.item_frequencies(now)

    def set_item_locations(self, locations):
        self.meta.set_item_locations(locations)

    def item_locations(self, item_ids):
        return self.meta.item_locations(item_ids)


class WorkerHandle:
    """A KV-cache worker (or meta service) reached in process or through Ray."""

    def __init__(self, obj=None, actor=None):
        self.obj, self.actor = obj, actor

    @property
    def is_remote(self) -> bool:
        return self.actor is not None

    def submit(self, method: str, *args):
        if self.actor is None:
            return getattr(self.obj, method)(*args)
        return getattr(self.actor, method).remote(*args)

    def wait(self, pending):
        if self.actor is None:
            return pending
        import ray

        return ray.get(pending)

    def call(self, method: str, *args):
        return self.wait(self.submit(method, *args))


def make_worker(worker_id: int, use_ray: bool, **kw) -> WorkerHandle:
    if not use_ray:
        return WorkerHandle(obj=KVCacheWorker(worker_id, **kw))
    import ray

    return WorkerHandle(actor=ray.remote(KVCacheWorker).options(num_cpus=0).remote(worker_id, **kw))


def make_meta_service(use_ray: bool, **kw) -> WorkerHandle:
    if not use_ray:
        return WorkerHandle(obj=MetaServiceActor(**kw))
    import ray

    return WorkerHandle(actor=ray.remote(MetaServiceActor).options(num_cpus=0).remote(**kw))


def start_workers(placement, pool, use_ray: bool = False, chunk: int = 512, headroom: float = 0.1
                  ) -> list[WorkerHandle]:
    """Create ``placement.workers`` KV-cache workers and load each with its items' KV from ``pool``; each gets
    ``headroom`` spare pages (fraction) for re-replication."""
    store = pool.store
    handles = []
    for w in range(placement.workers):
        ids = [i for i in placement.items_on(w) if i in pool]
        pages = sum(store.entry_pages(i) for i in ids)
        h = make_worker(w, use_ray, num_layers=store.num_layers, num_kv_heads=store.num_kv_heads,
                        head_dim=store.head_dim, num_pages=pages + max(8, int(headroom * pages)),
                        page_size=store.page_size, dtype=store.pages.dtype)
        for k in range(0, len(ids), chunk):
            part = ids[k:k + chunk]
            h.call("put_items", part, store.get_concat(part), [store.length(i) for i in part])
        handles.append(h)
    return handles


def stop_workers(handles: list[WorkerHandle]) -> None:
    for h in handles:
        if h.actor is not None:
            import ray

            ray.kill(h.actor)


class ClusterItemSource:
    """Inference worker ``local``'s view of the item KV: local reads, remote fetches, bytes counted."""

    def __init__(self, local: int, workers: list[WorkerHandle], placement):
        self.local = local
        self.workers = workers
        self.placement = placement
        self.bytes_moved = 0
        self.remote_items = 0
        self.items = 0

    def _owner(self, item: int) -> int | None:
        if item not in self.placement.home:
            return None
        owners = self.placement.owners(item)
        return self.local if self.local in owners else min(owners)

    def has(self, item_ids: Sequence[int]) -> list[bool]:
        return [int(i) in self.placement.home for i in item_ids]

    def fetch(self, item_ids: Sequence[int]) -> tuple[torch.Tensor, list[bool]]:
        by_worker: dict[int, list[int]] = {}
        hits = []
        for i in item_ids:
            w = self._owner(int(i))
            hits.append(w is not None)
            if w is not None:
                by_worker.setdefault(w, []).append(int(i))
        pending = {w: self.workers[w].submit("get_items", ids) for w, ids in by_worker.items()}  # overlapped
        parts = []
        for w, p in pending.items():
            kv = self.workers[w].wait(p)
            parts.append(kv)
            if w != self.local:
                self.bytes_moved += kv.numel() * kv.element_size()
                self.remote_items += len(by_worker[w])
        self.items += sum(hits)
        if not parts:
            return torch.zeros(0), hits
        return torch.cat(parts, dim=2), hits
