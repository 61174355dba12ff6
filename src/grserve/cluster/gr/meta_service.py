"""BAT's cache meta service for a ranking cluster's item KV (§5.1), placing it by HRCS (§5.2, Algorithm 1).

It lives in the front end of ``serve ranking --instances N`` (``ClusterRankingEngine.item_kv``) and holds no KV: the
placement (``wire.ItemPlacement``), the items' hotness (the candidates of every routed request) and the KV-cache
worker actors (``kv_workers.py``). It fills the workers at start-up (r = 0: no history, every item on one home
worker; the instances compute the KV, split in chunks), re-places the hot items every ``--hrcs-interval-s``
(``replace``: Algorithm 1 on what was served; replicas copied worker to worker; homes never move), places new and
replaced items (``update``) and rebuilds a dead worker from the instances (``worker_down``); each new placement
goes to every instance as a broadcast. Every change holds the front end's state lock, so broadcasts and a
restarted instance's catch-up never interleave. docs/ranking.md, "HRCS", has the whole story.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from grserve.cluster.core import heartbeat
from grserve.cluster.gr.hrcs import Placement, compute_replication_ratio, hrcs_placement, place_new, replicate
from grserve.cluster.gr.kv_workers import spawn_kv_worker
from grserve.cluster.wire import GRPoll, ItemPlacement
from grserve.kvcache.meta import CacheMetaService

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.cluster.core.front_end import Instance
    from grserve.cluster.wire import StateChange
    from grserve.config import ClusterConfig, HRCSConfig
    from grserve.engine.ranking_runner import RankingStats
    from grserve.engine.types import RankingRequest
    from grserve.ranking.registry import RankingRegistry

log = logging.getLogger("grserve.cluster")
CHUNK = 256  # items per compute call (an instance holds one chunk's KV at a time)


@dataclass
class KVWorker:
    actor: ActorHandle
    up: bool = True
    stats: dict[str, float] = field(default_factory=dict)


class RankingStatsSource(Protocol):
    @property
    def stats(self) -> RankingStats: ...


class RankingFrontEnd(Protocol):
    """What the meta service reads of the front end it lives in (``modes.ClusterRankingEngine``): the cluster
    config, the instances, the state lock, broadcasts, the item registry and the ranking stats."""

    cc: ClusterConfig
    instances: list[Instance]
    _state_lock: threading.RLock

    @property
    def registry(self) -> RankingRegistry: ...

    @property
    def runner(self) -> RankingStatsSource: ...

    def broadcast(self, change: StateChange) -> list[int]: ...


class ItemKVMetaService:
    def __init__(self, engine: RankingFrontEnd, cfg: HRCSConfig, workers: int, page_size: int,
                 window_s: float):
        self.engine, self.cfg, self.n, self.page_size = engine, cfg, workers, page_size
        self.hotness = CacheMetaService(item_window_s=window_s)
        self.workers: list[KVWorker] = []
        self.placed: ItemPlacement | None = None
        self.counters = {"rebuilds": 0, "replacements": 0, "replicas_copied": 0}
        self.served = [0, 0, 0, 0]  # requests, candidates, candidate tokens, profile tokens
        self._stop = threading.Event()

    # ---- life cycle ---------------------------------------------------------------------------------------------
    def start(self) -> ItemKVMetaService:
        items = self.engine.registry.item_ids()
        self.workers = [KVWorker(spawn_kv_worker(w, self.page_size)) for w in range(self.n)]
        with self.engine._state_lock:
            self._place(hrcs_placement(items, {}, 0.0, self.n), items)
        for w in range(self.n):
            self._watch(w)
        if self.cfg.hrcs_interval_s > 0:
            threading.Thread(target=self._every, daemon=True, name="grserve-hrcs-replace").start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for w in self.workers:
            w.up = False
            heartbeat.fence(w.actor)

    def record(self, req: RankingRequest) -> None:
        """A routed request: its candidates' hotness, and the means Algorithm 1 reads."""
        ids = [i for i in (req.item_ids or []) if i is not None]
        self.hotness.record_request(None, ids, time.time())
        s = self.served
        s[0], s[1] = s[0] + 1, s[1] + len(req.item_tokens)
        s[2], s[3] = s[2] + sum(len(t) for t in req.item_tokens), s[3] + len(req.user_tokens)

    # ---- placing ------------------------------------------------------------------------------------------------
    def _place(self, p: Placement, compute: Sequence[int]) -> None:
        """Compute ``compute``'s KV into their owners under ``p``, then send ``p`` (state lock held)."""
        msg = ItemPlacement((self.placed.version if self.placed else 0) + 1, tuple(w.actor for w in self.workers), p)
        self._compute(list(compute), msg)
        self.engine.broadcast(msg)
        self.placed = msg

    def _compute(self, items: list[int], msg: ItemPlacement, rounds: int = 3) -> None:
        """The live instances compute ``items`` in chunks; a chunk whose instance fails goes to another one."""
        import ray

        chunks = [items[k:k + CHUNK] for k in range(0, len(items), CHUNK)]
        for _ in range(rounds):
            live = [inst.actor for inst in self.engine.instances if inst.up]
            if not chunks or not live:
                break
            refs = [live[k % len(live)].compute_items.remote(c, msg) for k, c in enumerate(chunks)]
            failed = []
            for c, ref in zip(chunks, refs):
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - that instance died meanwhile: another computes it
                    log.warning("computing %d items' KV failed (%s); retrying elsewhere", len(c), type(exc).__name__)
                    failed.append(c)
            chunks = failed
        if chunks:
            raise RuntimeError(f"no live instance computed the KV of {sum(map(len, chunks))} items")

    def update(self, item_ids: Sequence[int]) -> None:
        """New or replaced items (already in every instance's registry): KV into their owners, placement sent.
        Before ``start`` (e.g. registrations replayed from a store) nothing: the start-up fill places them all."""
        with self.engine._state_lock:
            if self.placed is None:
                return
            self._place(place_new(self.placed.placement, item_ids), item_ids)

    def replace(self) -> float | None:
        """Algorithm 1 on the hotness served so far; the new hot items replicated. Returns r (None: no traffic)."""
        import ray

        with self.engine._state_lock:
            n_req, cands, cand_tokens, profile_tokens = self.served
            p = self.placed.placement
            if not n_req or not cands:
                return None
            freq = self.hotness.item_frequencies(time.time())
            bpt = self.engine.instances[0].info.kv_bytes_per_token
            ratio = compute_replication_ratio(self.cfg.hrcs_link_gbps * 1e9 / 8 / bpt, [freq.get(i, 0.0) for i in
                                              p.home], profile_tokens / n_req, cand_tokens / cands,
                                              self.cfg.hrcs_alpha, max(1, round(cands / n_req)), self.n,
                                              self._prefill_s())
            new = replicate(p, freq, ratio)
            add, drop = new.replicated - p.replicated, p.replicated - new.replicated
            refs = []
            for h in range(self.n):
                ids = sorted(i for i in add if p.home[i] == h)
                if ids:
                    kv = self.workers[h].actor.get.remote(ids)  # passed on as a Ray object, never through here
                    refs += [w.actor.put.remote(kv) for k, w in enumerate(self.workers) if k != h]
            ray.get(refs)
            self.counters["replicas_copied"] += len(add) * (self.n - 1)
            self._place(new, [])
            ray.get([w.actor.drop.remote(sorted(i for i in drop if p.home[i] != k))
                     for k, w in enumerate(self.workers)])
            self.counters["replacements"] += 1
            return ratio

    def _prefill_s(self) -> float:
        if self.cfg.hrcs_prefill_s is not None:
            return self.cfg.hrcs_prefill_s
        st = self.engine.runner.stats
        return st.forward_s / max(st.requests, 1)

    def _every(self) -> None:
        while not self._stop.wait(self.cfg.hrcs_interval_s):
            try:
                self.replace()
            except Exception:  # noqa: BLE001 - the next round tries again; the placement stays valid
                log.exception("re-placement of the hot items failed")

    # ---- KV-cache workers: heartbeat, rebuild -------------------------------------------------------------------
    def _watch(self, w: int) -> None:
        worker, cc = self.workers[w], self.engine.cc

        def on_poll(res: GRPoll) -> None:
            worker.stats = res.stats

        threading.Thread(target=heartbeat.watch, daemon=True, name=f"grserve-kv-worker-{w}",
                         args=(worker.actor, cc, lambda: worker.up and not self._stop.is_set(), on_poll,
                               lambda why, silent: self.worker_down(w, why), f"KV-cache worker {w}")).start()

    def worker_down(self, w: int, why: str) -> None:
        """Fence worker ``w`` and rebuild its items on a new actor (retried 3 times, 1, 2, 4 s apart)."""
        if not self.workers[w].up or self._stop.is_set():
            return
        self.workers[w].up = False
        log.warning("KV-cache worker %d is down (%s); rebuilding its items", w, why)
        heartbeat.fence(self.workers[w].actor)
        for attempt in range(3):
            new = KVWorker(spawn_kv_worker(w, self.page_size))
            try:
                with self.engine._state_lock:
                    self.workers[w] = new
                    p = self.placed.placement
                    self._place(p, p.items_on(w))
            except Exception as exc:  # noqa: BLE001 - e.g. the new actor died too: another one
                log.warning("rebuilding KV-cache worker %d failed (%s)", w, exc)
                new.up = False
                heartbeat.fence(new.actor)
                time.sleep(2 ** attempt)
                continue
            self.counters["rebuilds"] += 1
            self._watch(w)
            return

    def describe(self) -> str:
        p = self.placed.placement if self.placed else None
        return (f"item KV on {self.n} KV-cache workers (HRCS): {len(p.home) if p else 0:,} items, "
                f"{len(p.replicated) if p else 0:,} replicated, re-placed every {self.cfg.hrcs_interval_s:g} s")
