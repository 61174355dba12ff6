"""The two modes of the retrieval/ranking cluster front end (``cluster/gr/front_end.py``), each with what its unchanged
app reads from an engine:

- ``ClusterRetrievalEngine``: ``catalogs`` (the front end's own ``CatalogStore``, used to lay histories out as
  tokens; a reload — ``POST /v1/catalog`` — replaces it here, then on every instance: ``BroadcastCatalogStore``),
  ``vocab_size``, ``search``. Routing: the prompt's prefix blocks cached on each instance (the instances' prefix
  caches publish their blocks to the global KV index; none without ``--prefix-cache-tokens``) plus load
  (``core/router.py`` reads a ``RetrievalRequest``'s tokens).
- ``ClusterRankingEngine``: ``registry`` (the front end's own ``RankingRegistry``, built from the same flags as the
  instances'; a fingerprint check at start-up), ``runner`` (``FrontRunner``: the policy name, the instances' summed
  ranking stats, ``add_items`` → every instance). Routing: the user's cached KV (the global index's
  ``user_key(user_id)`` entries, as the router reads a ``RankingRequest``) plus load. A replaced user or item (the
  registry's change listener) and new items reach every instance before the admin route answers; a new user needs
  nothing there (a request carries the user's tokens; the user's KV is admitted where the request runs). The item
  KV lives on KV-cache workers placed by HRCS (``item_kv``, ``meta_service.py``) unless ``--kv-cache-workers 0``
  (then every instance precomputes the whole item pool).

The front end owns the state store (``--state-dir``, ``state/store.py``: the routes commit every admin write there
before applying it); a restarted front end's ``restore`` replays it on its own state and broadcasts it to the
instances, which records it in the broadcast log, so an instance restarted later is caught up with it too; the
restored items' KV is then computed into the KV-cache workers like a registration's.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from grserve.cluster.core.front_end import abandon_actors
from grserve.cluster.gr.front_end import ClusterGREngine, launch_instances
from grserve.cluster.gr.instance import catalog_digest, registry_digest
from grserve.cluster.gr.kv_workers import kv_cache_workers
from grserve.cluster.gr.state_change import BroadcastCatalogStore, replaced_entry, restore_updates
from grserve.cluster.gr.meta_service import ItemKVMetaService
from grserve.cluster.wire import GRInstanceInfo, RegistryUpdate
from grserve.state.store import StoredState, restore_catalog

if TYPE_CHECKING:
    from collections.abc import Iterator

    from prometheus_client.metrics_core import Metric
    from ray.actor import ActorHandle

    from grserve.config import ClusterConfig, RankingConfig, RankingServeConfig, ServeConfig
    from grserve.engine.protocol import RequestHandle
    from grserve.engine.ranking_runner import RankingStats
    from grserve.engine.types import RankingRequest, RankingResult
    from grserve.ranking.registry import RankingRegistry

log = logging.getLogger("grserve.cluster")


class _Launch:
    mode = ""

    @classmethod
    def launch(cls, cfg: ServeConfig | RankingServeConfig, cluster: ClusterConfig):
        """Start (or join) Ray, start ``cluster.instances`` instances from ``cfg`` and build the front end."""
        actors, infos, owns = launch_instances(cls.mode, cfg, cluster)
        try:
            return cls(actors, infos, cluster, cfg, owns)
        except Exception:
            abandon_actors(actors, owns)
            raise


# ---- retrieval ------------------------------------------------------------------------------------------------
class ClusterRetrievalEngine(_Launch, ClusterGREngine):
    mode = "retrieval"

    def __init__(self, actors: list[ActorHandle], infos: list[GRInstanceInfo], cluster: ClusterConfig,
                 cfg: ServeConfig, owns_ray: bool = False):
        from grserve.catalog.sid_text import bind_catalog
        from grserve.engine.retrieval_engine import build_catalog
        from grserve.engine.tokenizer import model_tokenizer

        super().__init__(actors, infos, cluster, owns_ray, max_waiting=cfg.edge.max_waiting)
        self.serve_cfg = cfg
        self.router.block_size = cfg.prefix.prefix_block_size  # the instances' prefix blocks are the index's keys
        self.vocab_size = int(infos[0].vocab_size)
        self.search = cfg.search
        self.tokenizer = model_tokenizer(cfg.model.source)  # the OpenAI routes encode prompts here, as one engine
        catalog, self.layout_note = bind_catalog(build_catalog(cfg), self.tokenizer)
        self.catalogs = BroadcastCatalogStore(catalog, self.vocab_size, self.broadcast)
        self.catalogs.bind = lambda c: bind_catalog(c, self.tokenizer)[0]  # reloads: bound here, then broadcast
        cat = self.catalogs.current()
        for info in infos:
            if (info.catalog, info.catalog_version) != (catalog_digest(cat), cat.version):
                raise ValueError(f"instance {info.index} serves another catalog than the front end (fingerprint "
                                 f"{info.catalog} version {info.catalog_version} vs {catalog_digest(cat)} version "
                                 f"{cat.version}): the catalog flags must name the same catalog on every node")

    def restore(self, state: StoredState) -> None:
        """The front end's store after a restart of the front end: the stored catalog at its version, here and on
        every instance (recorded: an instance restarted later is sent it too)."""
        restore_catalog(self.catalogs, state.catalog)

    def health_detail(self) -> dict[str, int | str]:
        return {"catalog_version": self.catalogs.current().version}

    def stats(self) -> dict[str, float]:
        """The cluster's totals; with prefix caches, their counters and bytes summed over the live instances and
        the hit rate of the sums (``/metrics`` as one engine's)."""
        out = super().stats()
        if self.serve_cfg is not None and self.serve_cfg.prefix.enabled:
            keys = {k for inst in self.instances if inst.up for k in inst.stats
                    if k.startswith("prefix_") and k != "prefix_hit_rate"}
            for k in keys:
                out[k] = float(sum(inst.stats.get(k, 0) for inst in self.instances if inst.up))
            looked = out.get("prefix_prompt_tokens", 0.0)
            out["prefix_hit_rate"] = out.get("prefix_reused_tokens", 0.0) / looked if looked else 0.0
        return out

    def _instance_facts(self, info: GRInstanceInfo) -> str:
        return f"catalog {info.catalog_items:,} items (version {info.catalog_version})"


# ---- ranking --------------------------------------------------------------------------------------------------
class FrontRunner:
    """What the ranking routes read from ``engine.runner``: ``registry``, ``policy.name``, ``stats.summary()`` (the
    live instances' ranking stats, summed) and ``add_items`` (precomputed on every instance)."""

    def __init__(self, engine: ClusterRankingEngine, registry: RankingRegistry, policy: str, cfg: RankingConfig):
        self.engine, self.registry, self.cfg = engine, registry, cfg
        self.policy = SimpleNamespace(name=policy)

    def add_items(self, item_ids: list[int]) -> int:
        self.engine.broadcast(RegistryUpdate("item", tuple((int(i), self.registry.item_tokens(i)) for i in item_ids)))
        if self.engine.item_kv is not None:
            self.engine.item_kv.update(item_ids)
        return len(item_ids)

    @property
    def stats(self) -> RankingStats:
        from grserve.engine.ranking_runner import RankingStats

        live = [inst.stats for inst in self.engine.instances if inst.up]
        return RankingStats(**{f.name: type(f.default)(sum(s.get(f.name, 0) for s in live))
                               for f in dataclasses.fields(RankingStats)})


class ClusterRankingEngine(_Launch, ClusterGREngine):
    mode = "ranking"

    def __init__(self, actors: list[ActorHandle], infos: list[GRInstanceInfo], cluster: ClusterConfig,
                 cfg: RankingServeConfig, owns_ray: bool = False):
        from grserve.ranking.startup_data import build_registry

        super().__init__(actors, infos, cluster, owns_ray, max_waiting=cfg.edge.max_waiting)
        self.serve_cfg = cfg
        reg = build_registry(cfg.data, int(infos[0].vocab_size))
        mine = registry_digest(reg)
        for info in infos:
            if info.registry != mine:
                raise ValueError(f"instance {info.index} built different users/items than the front end: the "
                                 "users/items flags (and files) must be the same on every node")
        self.runner = FrontRunner(self, reg, infos[0].policy, cfg.ranking)
        self.cfg = cfg.ranking
        n = kv_cache_workers(cfg, len(actors))
        self.item_kv = ItemKVMetaService(self, cfg.hrcs, n, cfg.ranking.page_size, cfg.ranking.item_window_s) \
            if n else None
        reg.on_change(self._changed)

    def start(self) -> ClusterRankingEngine:
        """Polling, then (once) the KV-cache workers filled and placed before the first request."""
        super().start()
        if self.item_kv is not None and self.item_kv.placed is None:
            self.item_kv.start()
        return self

    def stop(self) -> None:
        if self.item_kv is not None:
            self.item_kv.stop()
        super().stop()

    def submit(self, request: RankingRequest) -> RequestHandle[RankingResult]:
        if self.item_kv is not None:
            self.item_kv.record(request)
        return super().submit(request)

    def describe(self) -> list[str]:
        return super().describe() + ([self.item_kv.describe()] if self.item_kv is not None else [])

    @property
    def registry(self) -> RankingRegistry:
        return self.runner.registry

    def restore(self, state: StoredState) -> None:
        """The front end's store after a restart of the front end: replayed on its registry, then broadcast as one
        change per kind (recorded: an instance restarted later is sent it too). New users stay here, as when they
        were registered (a request carries the user's tokens); replaced ones reach the instances."""
        for change in restore_updates(self.registry, state):
            self.broadcast(change)
        if self.item_kv is not None and state.items:
            self.item_kv.update([int(key) for key, _ in state.items])

    def _changed(self, kind: str, key: int) -> None:
        """The front end's registry replaced a user's or an item's tokens: every instance follows."""
        self.broadcast(replaced_entry(self.registry, kind, key))
        if kind == "item" and self.item_kv is not None:
            self.item_kv.update([key])

    def health_detail(self) -> dict[str, int | str]:
        reg = self.registry
        return {"policy": self.runner.policy.name, "users": reg.num_users, "items": reg.num_items}

    def _instance_facts(self, info: GRInstanceInfo) -> str:
        return (f"ranking policy {info.policy}, {info.users:,} users, {info.items:,} items, user cache "
                f"{info.user_cache_bytes / 2**20:.0f} MiB, item pool {info.item_pool_bytes / 2**20:.0f} MiB")


# ---- metrics ----------------------------------------------------------------------------------------------------
class GRClusterCollector:
    """Per-instance retrieval/ranking facts beside ``cluster/metrics.ClusterCollector``'s (which the front end also
    registers): batches and requests each instance ran, users in its KV cache, requests the front end answered."""

    _PER_INSTANCE = (("batches_run", "Batches the instance ran."), ("requests_done", "Requests the instance ran."),
                     ("users_cached", "Users whose KV the instance's user cache holds (ranking)."),
                     ("user_hits", "Ranking requests that read the user's KV from the instance's cache."),
                     ("items_fetched_remote", "Item KV entries the instance read from a KV-cache worker not its own."),
                     ("item_bytes_fetched_remote", "Item KV bytes the instance read from a KV-cache worker not its "
                                                   "own."))

    def __init__(self, engine: ClusterGREngine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self) -> Iterator[Metric]:
        e = self.engine
        for key, help_text in self._PER_INSTANCE:
            fam = GaugeMetricFamily(f"grserve_cluster_instance_{key}", help_text, labels=["instance"])
            for inst in e.instances:
                fam.add_metric([str(inst.index)], float(inst.stats.get(key, 0)))
            yield fam
        for key in ("finished", "failed"):
            yield CounterMetricFamily(f"grserve_cluster_requests_{key}", f"Requests the front end answered: {key}.",
                                      value=e.counters[key])
        kv = getattr(e, "item_kv", None)
        if kv is not None:
            fam = GaugeMetricFamily("grserve_cluster_kv_worker_stored_bytes", "Item KV bytes a KV-cache worker "
                                    "holds (HRCS: its shard and the replicated hot items).", labels=["worker"])
            for w, worker in enumerate(kv.workers):
                fam.add_metric([str(w)], worker.stats.get("stored_bytes", 0.0))
            yield fam
            yield CounterMetricFamily("grserve_cluster_kv_worker_rebuilds", "KV-cache workers rebuilt after a death.",
                                      value=kv.counters["rebuilds"])
