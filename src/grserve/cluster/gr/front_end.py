"""The cluster front end for retrieval and ranking: N ``GRInstance`` actors behind the one Engine contract.

``ClusterRetrievalEngine`` / ``ClusterRankingEngine`` are what ``grserve serve --instances N`` / ``grserve serve
ranking --instances N`` hand the unchanged retrieval / ranking app instead of a ``RetrievalEngine`` /
``RankingEngine``. A request is single-step, so the front end's journal is just the request itself:

- **routing** (``core/router.Router``, the LLM cluster's, given the request as the app built it): cost(i) = tokens
  booked on i + the request's tokens − ``cache_weight`` · its tokens cached on i. Retrieval: the prompt's longest
  block prefix held by i's prompt-prefix cache, as the global KV index says (the instances publish their prefix
  blocks; load alone without ``--prefix-cache-tokens``; ``round_robin`` for comparison). Ranking: the user's profile tokens count as cached
  on every instance whose BAT user cache holds the user, as the global KV index says (key ``user_key(user_id)``,
  kept from the instances' user-cache events, resynced from a snapshot after a gap or a restart). Load is booked at
  the decision and released with the answer;
- **the answer** is the actor call's own result (``ObjectRef.future()``: no poll in between);
- **death**: the call fails with an actor error, or the instance's heartbeat (``heartbeat.watch``) stops: the
  instance is fenced and every request it held is re-submitted to a live one — recompute is the recovery of a
  single-step request — at most ``migration_limit`` times, then ``RequestLost`` (HTTP 503);
- **state changes** (``wire.StateChange``) reach every live instance before the admin route answers
  (``broadcast``): a catalog reload (retrieval), replaced users and new or replaced items (ranking). An instance
  that fails to apply one is fenced, so no instance keeps serving stale state;
- **restart** (``--restart-instances``, ``respawn.py``): a dead instance's index gets a new actor under a new
  incarnation; before it takes requests it is sent every state change so far (``broadcast_log.py``) and checked
  against a live peer (catalog fingerprint and version, or registry fingerprint). Broadcasts and a catch-up never
  interleave (one state lock), so the new instance cannot miss a change made while it was loading.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grserve.cluster.core import heartbeat
from grserve.cluster.core.front_end import FrontEndLifecycle, Instance, instance_line, launch_actors
from grserve.cluster.core.front_end import fail_handle as _fail
from grserve.cluster.core.kv_index import GlobalKVIndex
from grserve.cluster.core.recovery import RequestLost, limit_reached
from grserve.cluster.core.router import NoInstance, Router
from grserve.cluster.gr.broadcast_log import BroadcastLog
from grserve.cluster.wire import GRInstanceInfo, GRPoll, StateChange
from grserve.engine.protocol import (
    EngineError,
    EngineHealth,
    EngineOverloaded,
    EngineStopped,
    RequestCancelled,
    RequestHandle,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

    from grserve.config import ClusterConfig, RankingServeConfig, ServeConfig
    from grserve.engine.ranking_runner import RankingResult
    from grserve.engine.types import RankingRequest, RetrievalRequest, RetrievalResult

    GRRequest = RetrievalRequest | RankingRequest
    GRResult = RetrievalResult | RankingResult

log = logging.getLogger("grserve.cluster")
SUMMED_STATS = ("batches_run", "batches_failed", "requests_done", "requests_expired", "queue_depth", "running")


class InstanceOverloaded(EngineError):
    """The chosen instance's queue was full (HTTP 429)."""

    http_status = 429
    error_type = "overloaded"


@dataclass
class GRRecord:
    request: GRRequest
    handle: RequestHandle[GRResult]
    instance: int = -1
    attempt: int = 0
    moves: int = 0
    ref: ObjectRef | None = None  # the current attempt's ObjectRef (kept alive until the answer)


class ClusterGREngine(FrontEndLifecycle):
    """The mode-free part: instances, routing, answers, deaths, broadcasts, lifecycle, stats."""

    mode = ""

    def __init__(self, actors: list[ActorHandle], infos: list[GRInstanceInfo], cluster: ClusterConfig,
                 owns_ray: bool = False, max_waiting: int | None = None):
        self.cc = cluster
        self.instances = [Instance(i, a, info) for i, (a, info) in enumerate(zip(actors, infos))]
        self.owns_ray = owns_ray
        self.index = GlobalKVIndex()
        for inst in self.instances:
            self.index.register(inst.index, inst.info.incarnation)
        self.router = Router(len(self.instances), cluster.routing, block_size=1, index=self.index,
                             decode_weight=0.0, cache_weight=cluster.cache_weight)
        self.records: dict[str, GRRecord] = {}
        self._lock = threading.RLock()
        self._status = "stopped"
        self._max_waiting = max_waiting
        self.counters = {"migrated": 0, "recomputed": 0, "lost": 0, "instance_deaths": 0, "restarts": 0,
                         "finished": 0, "failed": 0}
        self.on_batch: Callable[[int, int], None] | None = None  # the app's batch histograms: every batch run
        self.on_death: list[Callable[[int, float], None]] = []  # (instance, seconds since its last answer): tests
        self._answers: queue.SimpleQueue[_Answer | None] = queue.SimpleQueue()
        self._answerer: threading.Thread | None = None
        self.serve_cfg: ServeConfig | RankingServeConfig | None = None  # what the instances run: a restart needs it
        self.broadcasts = BroadcastLog()
        self._state_lock = threading.RLock()  # a broadcast and a restarted instance's catch-up never interleave

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> ClusterGREngine:
        self._start_polling(self._watch)
        return self

    def _watch(self, inst: Instance) -> None:
        heartbeat.watch(inst.actor, self.cc, lambda: self._status != "stopped" and inst.up,
                        lambda res: self._on_poll(inst, res),
                        lambda why, silent: self.instance_down(inst.index, why, silent), f"instance {inst.index}")

    def stop(self) -> None:
        self._stop_instances()
        if self._answerer is not None:
            self._answers.put(None)
            self._answerer.join(timeout=5)
            self._answerer = None
        self._shutdown_ray()

    def __enter__(self) -> ClusterGREngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests -------------------------------------------------------------------------------------------------
    def submit(self, request: GRRequest) -> RequestHandle[GRResult]:
        if self._status != "ok":
            raise EngineStopped(f"engine is {self._status}")
        handle: RequestHandle[GRResult] = RequestHandle(request.request_id, self.cancel)
        rec = GRRecord(request, handle)
        with self._lock:
            if request.request_id in self.records:
                raise ValueError(f"request id {request.request_id} is already running")
            self.records[request.request_id] = rec
            try:
                self._send(rec, recovery=False)
            except RequestLost:
                del self.records[request.request_id]
                raise EngineStopped("no live instance") from None
        return handle

    def _send(self, rec: GRRecord, recovery: bool) -> None:
        """Route one attempt of ``rec`` and call its instance (lock held)."""
        try:
            d = self.router.route(rec.request, recovery=recovery)
        except NoInstance:
            raise RequestLost("no live instance is left") from None
        rec.instance, rec.attempt = d.instance, rec.attempt + 1
        ref = rec.ref = self.instances[d.instance].actor.run.remote(rec.request)
        attempt = rec.attempt
        self._answer_thread()
        # Ray's callback thread only queues the answer: our lock and further Ray calls there could deadlock
        ref.future().add_done_callback(lambda fut: self._answers.put(_Answer(rec, attempt, d.instance, fut)))

    def _answer_thread(self) -> None:
        """Start the thread that handles the instances' answers (once; lock held)."""
        if self._answerer is None or not self._answerer.is_alive():
            self._answerer = threading.Thread(target=self._answer_loop, daemon=True, name="grserve-cluster-answers")
            self._answerer.start()

    def _answer_loop(self) -> None:
        while True:
            item = self._answers.get()
            if item is None:
                return
            try:
                self._on_answer(item)
            except Exception:  # noqa: BLE001 - one bad answer must not stop the others
                log.exception("answer of request %s failed", item.rec.request.request_id)

    def _on_answer(self, answer: _Answer) -> None:
        """The instance answered the call: a result, the engine's error, or the actor's death."""
        from ray.exceptions import RayActorError, RayTaskError

        rec, attempt, instance, fut = answer.rec, answer.attempt, answer.instance, answer.future
        exc = fut.exception()
        with self._lock:
            if self.records.get(rec.request.request_id) is not rec or rec.attempt != attempt:
                return  # cancelled, or an older attempt of a moved request
        if isinstance(exc, RayActorError):
            self.instance_down(instance, f"actor died ({type(exc).__name__})")
            return
        if isinstance(exc, RayTaskError):  # the engine's own error (overloaded, timed out, ...): the client's answer
            exc = getattr(exc, "cause", None) or exc
        if isinstance(exc, EngineOverloaded):  # raised after submit returned: it must carry its own status
            exc = InstanceOverloaded(str(exc))
        with self._lock:
            if self.records.get(rec.request.request_id) is not rec or rec.attempt != attempt:
                return
            self._end(rec)
        if exc is not None:
            self.counters["failed"] += 1
            _fail(rec.handle, exc)
        elif not rec.handle.future.done():
            self.counters["finished"] += 1
            rec.handle.future.set_result(fut.result())

    def _end(self, rec: GRRecord) -> None:
        self.records.pop(rec.request.request_id, None)
        self.router.release(rec.request.request_id)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            rec = self.records.get(request_id)
            if rec is None:
                return False
            self._end(rec)
            inst = self.instances[rec.instance]
            if inst.up:
                inst.actor.cancel.remote(request_id)
        _fail(rec.handle, RequestCancelled(f"request {request_id} cancelled"))
        return True

    # ---- instances: polls, deaths, broadcasts ----------------------------------------------------------------------
    def _on_poll(self, inst: Instance, res: GRPoll) -> None:
        with self._lock:
            if not inst.up:
                return  # a fenced instance's late answer
            inst.stats = {**res.stats, "users_cached": res.users_cached}
            self.index.apply(inst.index, res.kv_events, res.kv_next_seq)
        if self.on_batch is not None:
            for b in res.batches:
                self.on_batch(b.requests, b.tokens)
        heartbeat.resync(self.index, inst.index, inst.actor, self.cc.heartbeat_timeout_s)

    def instance_down(self, index: int, why: str, silent_s: float = 0.0) -> None:
        """Take an instance out (fencing it first) and re-submit every request it held elsewhere."""
        inst = self.instances[index]
        with self._lock:
            if not inst.up or self._status == "stopped":
                return
            inst.up, inst.down_at, inst.down_reason = False, time.perf_counter(), why
            self.counters["instance_deaths"] += 1
            self.router.mark_down(index)
            self.index.drop_instance(index)
        log.warning("instance %d is down (%s); re-submitting its requests", index, why)
        heartbeat.fence(inst.actor)
        lost = []
        with self._lock:
            for rec in [r for r in self.records.values() if r.instance == index]:
                self.router.release(rec.request.request_id)
                try:
                    why = limit_reached(rec.moves, self.cc.migration_limit)
                    if why is not None:
                        raise RequestLost(f"request {rec.request.request_id} lost: {why}")
                    rec.moves += 1
                    self._send(rec, recovery=True)
                    self.counters["recomputed"] += 1
                except RequestLost as exc:
                    self.counters["lost"] += 1
                    self.records.pop(rec.request.request_id, None)
                    lost.append((rec, exc))
        for rec, exc in lost:
            _fail(rec.handle, exc)
        for cb in self.on_death:
            cb(index, silent_s)
        if getattr(self.cc, "restart_instances", False) and self.serve_cfg is not None and self._status == "ok":
            from grserve.cluster.core import respawn

            respawn.respawn_later(self, index)  # a new actor, a new incarnation, caught up (instance_up)

    def spawn_actor(self, index: int, incarnation: str) -> ActorHandle:
        """A new instance actor for ``index`` from the instances' config (``respawn.py``)."""
        from grserve.cluster.gr.instance import spawn_gr_instance

        assert self.serve_cfg is not None
        return spawn_gr_instance(index, self.mode, self.serve_cfg, self.cc, incarnation)

    def instance_up(self, index: int, actor: ActorHandle, info: GRInstanceInfo) -> bool:
        """A restarted instance takes dead ``index``'s place: every recorded state change is replayed on it, its
        state is checked against a live peer's (``RuntimeError`` on a mismatch: the restart attempt failed), then
        it is registered in the index, the router and polled. False if ``index`` is up or the engine stopped."""
        import ray

        timeout = max(30.0, self.cc.heartbeat_timeout_s)
        with self._state_lock:
            self.broadcasts.replay(lambda change: ray.get(actor.apply.remote(change), timeout=timeout))
            info = call_info(actor, timeout)
            peer = next((i for i in self.instances if i.up and i.index != index), None)
            if peer is not None and call_info(peer.actor, timeout).state != info.state:
                raise RuntimeError(f"restarted instance {index} does not serve the live instances' state after its "
                                   "catch-up")
            return self._rejoin(index, actor, info, self._watch)

    def broadcast(self, change: StateChange) -> list[int]:
        """Apply ``change`` on every live instance and wait for all; an instance that fails to apply it is taken
        out (so none serves stale state). Returns the live instances' answers."""
        import ray

        with self._state_lock:  # recorded first: an instance restarted later (or now down) is sent it too
            self.broadcasts.record(change)
            calls = [(inst, inst.actor.apply.remote(change)) for inst in self.instances if inst.up]
            out = []
            for inst, ref in calls:
                try:
                    out.append(ray.get(ref, timeout=max(30.0, self.cc.heartbeat_timeout_s)))
                except Exception as exc:  # noqa: BLE001 - dead, hung or refused: fenced
                    self.instance_down(inst.index, f"{type(change).__name__} failed ({type(exc).__name__})")
        if not any(inst.up for inst in self.instances):
            raise RequestLost("no live instance is left")
        return out

    # ---- state ------------------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return int(sum(inst.stats.get("queue_depth", 0) for inst in self.instances if inst.up))

    @property
    def max_waiting(self) -> int | None:
        """The edge's queue bound, per live instance (each instance's engine queue has it)."""
        if self._max_waiting is None:
            return None
        return self._max_waiting * max(1, sum(inst.up for inst in self.instances))

    def health_detail(self) -> dict[str, int | str]:
        return {}

    def health(self) -> EngineHealth:
        up = sum(inst.up for inst in self.instances)
        status = self._status if up or self._status != "ok" else "stopped"
        stats = self.stats()
        return EngineHealth(status, int(stats["queue_depth"]), int(stats["running"]),  # type: ignore[arg-type]
                            {"instances_up": up, "instances": len(self.instances), "routing": self.cc.routing,
                             **self.health_detail()})

    def stats(self) -> dict[str, float]:
        return self._cluster_stats(SUMMED_STATS)

    def describe(self) -> list[str]:
        """What runs where (the start-up lines)."""
        import os
        import socket

        lines = [f"front end: pid {os.getpid()} on {socket.gethostname()}, {self.mode}, routing {self.cc.routing}, "
                 f"heartbeat timeout {self.cc.heartbeat_timeout_s}s, migration limit {self.cc.migration_limit}"]
        for inst in self.instances:
            assert isinstance(inst.info, GRInstanceInfo)
            lines.append(instance_line(inst, f"{inst.info.torch_threads} torch threads, "
                                             f"{self._instance_facts(inst.info)}"))
        return lines

    def _instance_facts(self, info: GRInstanceInfo) -> str:
        return ""


@dataclass(frozen=True)
class _Answer:
    """An instance's answer to one attempt, queued by Ray's callback thread for the answer thread."""

    rec: GRRecord
    attempt: int
    instance: int
    future: Future[GRResult]


def call_info(actor: ActorHandle, timeout: float) -> GRInstanceInfo:
    import ray

    return ray.get(actor.info.remote(), timeout=timeout)


def launch_instances(mode: str, cfg: ServeConfig | RankingServeConfig, cluster: ClusterConfig
                     ) -> tuple[list[ActorHandle], list[GRInstanceInfo], bool]:
    """Start (or join) Ray, create ``cluster.instances`` instance actors of ``mode`` from ``cfg`` and wait until every
    one has built its engine; returns (actors, their infos, whether this call started Ray)."""
    from grserve.cluster.gr.instance import spawn_gr_instance

    return launch_actors(lambda i, inc: spawn_gr_instance(i, mode, cfg, cluster, inc), cluster)
