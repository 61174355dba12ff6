"""One retrieval or ranking engine instance of the cluster: a ``RetrievalEngine`` or ``RankingEngine`` inside a Ray
actor (``serve --instances N``, ``serve ranking --instances N``).

The front end (``cluster/gr/front_end.py``) calls, all as Ray actor calls:

- ``run(request)``: one ``RetrievalRequest`` / ``RankingRequest`` through this instance's own batching engine; the
  call's result is the ``RetrievalResult`` / ``RankingResult`` (single step: there is nothing to stream). Requests
  from the front end batch here exactly as they would in one process;
- ``poll(wait_s)`` → ``wire.GRPoll``: the heartbeat — engine stats, the batches run since the last poll (the front
  end's batch histograms) and, for ranking, the **user-cache events**: which users' KV this instance's BAT user
  cache gained or lost, as ordered ``KVEvent``\\ s (key ``user_key(user_id)``, the instance's incarnation,
  sequence numbers) for the front end's ``GlobalKVIndex``; ``kv_snapshot()`` is the full set (resync after a gap).
  The user set is diffed after every request and every poll; a poll returns at once when a batch ended, so the
  index follows within milliseconds. For retrieval with ``--prefix-cache-tokens``, the **prefix-block events**: the
  prefix cache's listener is the publisher (block keys = the cache's chained block hashes, one per stored or
  evicted block), so the front end routes a request where most of its prompt's prefix is;
- ``cancel(request_id)``; ``apply(change)``: a ``wire.CatalogReplace`` (retrieval reload) or a
  ``wire.RegistryUpdate`` (ranking: a replaced user's KV is dropped; new or replaced items are registered and their
  KV precomputed), or a ``wire.ItemPlacement``;
- ranking with KV-cache workers (BAT's HRCS, ``kv_workers.py``): the instance holds no item pool; it reads item KV
  from the workers by the newest ``ItemPlacement`` (``ClusterItemSource``) and ``compute_items(ids, placement)``
  computes items' KV into their owner workers (the front end's meta service splits that work over the instances).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import socket
import time
from typing import TYPE_CHECKING

import numpy as np

from grserve.cluster.core.kv_index import KVEventPublisher, user_key
from grserve.cluster.gr.kv_workers import ClusterItemSource, item_kv, kv_cache_workers
from grserve.cluster.wire import (
    BatchRun,
    CatalogReplace,
    GRInstanceInfo,
    GRPoll,
    ItemPlacement,
    KVSnapshot,
    RegistryUpdate,
    StateChange,
    Tier,
)
from grserve.engine.types import RankingRequest, RetrievalRequest, RetrievalResult

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.catalog import Catalog
    from grserve.config import ClusterConfig, RankingServeConfig, ServeConfig
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingResult
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.ranking.registry import RankingRegistry

MODES = ("retrieval", "ranking")


def registry_digest(reg: RankingRegistry) -> str:
    """A fingerprint of a ranking registry (users, items, instruction): the front end and every instance must
    build the same one from the same flags."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray(reg.instruction, dtype=np.int64).tobytes())
    for kind, ids, tokens in (("u", reg.user_ids(), reg.user_tokens), ("i", reg.item_ids(), reg.item_tokens)):
        for i in sorted(ids):
            h.update(f"{kind}{i}:".encode())
            h.update(np.asarray(tokens(i), dtype=np.int64).tobytes())
    return h.hexdigest()


def catalog_digest(catalog: Catalog) -> str:
    """A fingerprint of a retrieval catalog (item ids and their SIDs, in the catalog's order)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(np.ascontiguousarray(catalog.item_ids, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(catalog.sids, dtype=np.int64).tobytes())
    return h.hexdigest()


def build_ranking_engine(cfg: RankingServeConfig, item_source: ClusterItemSource | None = None) -> RankingEngine:
    """The single-process ranking engine of ``serve ranking`` (model, registry, runner, engine); with an
    ``item_source`` it reads item KV there instead of precomputing an item pool."""
    from grserve.engine.ranking_engine import RankingEngine
    from grserve.engine.ranking_runner import RankingRunner
    from grserve.model import load_model
    from grserve.ranking.startup_data import build_registry

    m = cfg.model
    model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed, quantization=m.quantization)
    runner = RankingRunner(model, build_registry(cfg.data, model.spec.vocab_size), cfg.ranking, item_source)
    return RankingEngine(runner, edge=cfg.edge)


class GRInstance:
    def __init__(self, index: int, mode: str, cfg: ServeConfig | RankingServeConfig, incarnation: str,
                 torch_threads: int = 1):
        import torch

        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if torch_threads > 0:
            torch.set_num_threads(torch_threads)
        self.index, self.mode, self.cfg = index, mode, cfg
        self.engine: RetrievalEngine | RankingEngine
        self.items: ClusterItemSource | None = None  # ranking's item KV on KV-cache workers
        if mode == "retrieval":
            from grserve.engine.retrieval_engine import RetrievalEngine

            self.engine = RetrievalEngine.build(cfg)  # type: ignore[arg-type]
        else:
            if kv_cache_workers(cfg, 1):  # type: ignore[arg-type]
                self.items = ClusterItemSource(index, cfg.cluster.heartbeat_timeout_s)
            self.engine = build_ranking_engine(cfg, self.items)  # type: ignore[arg-type]
        self.engine.on_batch = self._on_batch
        tier: Tier = "hbm" if str(cfg.model.device).startswith("cuda") else "dram"
        prefix = getattr(self.engine, "prefix", None)  # retrieval's prompt-prefix cache (--prefix-cache-tokens)
        self.publisher = KVEventPublisher(index, incarnation, prefix.block_size if prefix is not None else 1, tier)
        if prefix is not None:  # its stored / evicted blocks are events of the global KV index (the router's)
            prefix.listener = self.publisher
        self._users: set[int] = set()
        self._batches: list[BatchRun] = []
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine.start()

    def info(self) -> GRInstanceInfo:
        from grserve.cluster.core.ray_runtime import node_ip

        where = dict(index=self.index, incarnation=self.publisher.incarnation, pid=os.getpid(),
                     host=socket.gethostname(), node_ip=node_ip(), device=str(self.cfg.model.device),
                     torch_threads=_threads())
        e = self.engine
        if self.mode == "retrieval":
            cat = e.catalogs.current()
            return GRInstanceInfo(**where, mode="retrieval", vocab_size=int(e.vocab_size), catalog_items=len(cat),
                                  catalog_version=int(cat.version), catalog=catalog_digest(cat))
        r = e.runner
        uc = r.user_cache
        return GRInstanceInfo(**where, mode="ranking", vocab_size=int(r.model.spec.vocab_size), policy=r.policy.name,
                              users=r.registry.num_users, items=r.registry.num_items,
                              registry=registry_digest(r.registry),
                              user_cache_bytes=int(uc.store.capacity_bytes) if uc is not None else 0,
                              item_pool_bytes=r.item_pool.used_bytes if r.item_pool is not None else 0,
                              kv_bytes_per_token=r.kv_bytes_per_token)

    # ---- requests --------------------------------------------------------------------------------------------
    async def run(self, request: RetrievalRequest | RankingRequest) -> RetrievalResult | RankingResult:
        """One request through this instance's engine (its own clock starts the queue time)."""
        self._loop = asyncio.get_running_loop()
        request = dataclasses.replace(request, arrival=time.perf_counter())
        handle = self.engine.submit(request)  # type: ignore[arg-type]
        try:
            return await asyncio.wrap_future(handle.future)
        finally:
            self._publish_users()

    async def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    def _on_batch(self, num_requests: int, num_tokens: int) -> None:
        """The engine thread: one batch ended."""
        self._batches.append(BatchRun(num_requests, num_tokens))
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wake.set)

    # ---- the front end's view ----------------------------------------------------------------------------------
    def _publish_users(self) -> None:
        """Diff the BAT user cache's users against what was published; publish what changed (event loop only)."""
        uc = getattr(getattr(self.engine, "runner", None), "user_cache", None) if self.mode == "ranking" else None
        if uc is None:
            return
        with uc._lock:  # the cache's own lock: a consistent list while the engine thread admits/evicts
            now = set(uc.users())
        gone, new = self._users - now, now - self._users
        if gone:
            self.publisher.publish("evict", [user_key(u) for u in sorted(gone)])
        if new:
            self.publisher.publish("store", [user_key(u) for u in sorted(new)])
        self._users = now

    async def poll(self, wait_s: float = 0.05) -> GRPoll:
        self._loop = asyncio.get_running_loop()
        if self._wake is None:
            self._wake = asyncio.Event()
        if not self._batches and wait_s > 0:
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        self._wake.clear()
        self._publish_users()
        batches, self._batches = self._batches, []
        events, next_seq = self.publisher.take_events()
        stats = {**self.engine.stats(), **(self.items.counters if self.items is not None else {})}
        stats["waiting"] = stats.get("queue_depth", 0)
        return GRPoll(stats, batches, events, next_seq, len(self._users))

    async def kv_snapshot(self) -> KVSnapshot:
        self._publish_users()
        return self.publisher.snapshot()

    # ---- state changes from the front end ------------------------------------------------------------------------
    async def apply(self, change: StateChange) -> int:
        """A catalog reload (the next version, or a restarted instance's catch-up at the front end's ``version``),
        or replaced users / new or replaced items. Returns the catalog version or the entries applied."""
        if isinstance(change, CatalogReplace):
            return await asyncio.to_thread(self.engine.catalogs.replace, change.catalog, change.version)
        if isinstance(change, ItemPlacement):
            assert self.items is not None, "an item placement for an instance without KV-cache workers"
            self.items.place(change)
            return change.version
        n = await asyncio.to_thread(self._update, change)
        self._publish_users()
        return n

    def _update(self, change: RegistryUpdate) -> int:
        """One change (items may hand identifiers over among themselves: a restored front end's replay)."""
        from grserve.cluster.gr.state_change import apply_change

        return apply_change(self.engine, change)

    async def compute_items(self, item_ids: list[int], placed: ItemPlacement) -> int:
        """Compute these items' KV (the one engine's precompute) and put it on every worker that is to hold it."""
        return await asyncio.to_thread(self._compute_items, item_ids, placed)

    def _compute_items(self, item_ids: list[int], placed: ItemPlacement) -> int:
        import ray

        from grserve.engine.ranking_runner import precompute_item_kv

        r = self.engine.runner
        out: dict[int, list] = {}  # worker → (item, KV) it is to hold

        def put(item: int, kv) -> None:
            for w in placed.placement.owners(item):
                out.setdefault(w, []).append((item, kv))

        with r._lock:  # between two batches, like a local pool's precompute
            n = precompute_item_kv(r.model, [(i, r.registry.item_tokens(i)) for i in item_ids], put, r.notation,
                                   r.notation_kv, r.cfg.precompute_batch_tokens)
        ray.get([placed.workers[w].put.remote(item_kv(items)) for w, items in out.items()])
        return n

    def pid(self) -> int:
        return os.getpid()

    def stop(self) -> None:
        self.engine.stop()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def spawn_gr_instance(index: int, mode: str, cfg: ServeConfig | RankingServeConfig, cluster: ClusterConfig,
                      incarnation: str) -> ActorHandle:
    """One retrieval/ranking instance actor, spread over the cluster's nodes, never restarted by Ray (the front end
    decides: a dead instance's requests are re-submitted elsewhere)."""
    import ray

    from grserve.cluster.core.ray_runtime import instance_threads

    actor_cls = ray.remote(GRInstance)
    return actor_cls.options(num_cpus=0, max_restarts=0, max_concurrency=256, scheduling_strategy="SPREAD").remote(
        index, mode, cfg, incarnation, instance_threads(cluster.instance_threads, cluster.instances))
