"""The cluster front end: N LLM engine instances (Ray actors) behind the one Engine contract.

``ClusterLLMEngine`` is what ``grserve serve llm --instances N`` hands the LLM app instead of an
``AsyncLLMEngine``: ``submit(LLMRequest)`` → a ``RequestHandle`` streaming ``TokenEvent``\\ s, ``cancel``,
``stats``, ``health``, ``drain``, ``start``, ``stop``, ``queue_depth``. Inside:

- ``router.Router`` picks the instance (KV-aware, least-loaded or round-robin) and books the load;
- one poller thread per instance long-polls it (``EngineInstance.poll`` → ``wire.LLMPoll``): token reports go to
  the requests' streams (``stream.TokenStream``: each position once), KV events to ``kv_index.GlobalKVIndex`` (a
  gap or a new incarnation → a snapshot), the prompt K/V of finished prefills to the request journal
  (``journal.RequestRecord``); the text a client sees is the instances' own (each report carries the text its
  tokens add; a moved request's next attempt continues it: ``engine.types.Handover``), never decoded here;
- death: a poll that fails with an actor error, or none answering for ``heartbeat_timeout_s`` (then the actor is
  fenced: killed, so it cannot deliver late), takes the instance out of the router and the index and moves each
  request it held (``recovery.plan``: migrate with its snapshot, or recompute).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from grserve.cluster.core.front_end import FrontEndLifecycle, Instance, instance_line, launch_actors
from grserve.cluster.core.front_end import fail_handle as _fail
from grserve.cluster.core.kv_index import GlobalKVIndex
from grserve.cluster.core.recovery import RecoveryCost, RequestLost, plan
from grserve.cluster.core.router import NoInstance, Router
from grserve.cluster.llm.admission import FrontAdmission
from grserve.cluster.llm.journal import RequestRecord
from grserve.cluster.llm.stream import TokenStream
from grserve.cluster.wire import Attempt, LLMInstanceInfo, LLMPoll, TokenReport
from grserve.engine.async_llm import EngineStepFailed
from grserve.engine.llm import TokenEvent
from grserve.engine.protocol import EngineHealth, EngineStopped, RequestCancelled, RequestHandle, RequestTimedOut
from grserve.engine.types import LLMRequest, LLMResult

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.cluster.llm.pd_disagg import PDCoordinator
    from grserve.config import ClusterConfig, EdgeConfig, LLMServeConfig
    from grserve.engine.tokenizer import HFTokenizer

log = logging.getLogger("grserve.cluster")
SUMMED_STATS = ("running", "waiting", "free_blocks", "total_blocks", "preemptions", "prefix_hit_tokens",
                "prefill_tokens", "iterations", "errors")
SUMMED_STATS += ("offline_preemptions", "offline_deferred", "running_online", "running_offline",  # co-location
                 "waiting_online", "waiting_offline")


class ClusterLLMEngine(FrontEndLifecycle):
    def __init__(self, actors: list[ActorHandle], infos: list[LLMInstanceInfo], cluster: ClusterConfig,
                 tokenizer: HFTokenizer | None = None, owns_ray: bool = False, eos_token_id: int | None = None,
                 edge: EdgeConfig | None = None):
        self.cc = cluster
        self.admission = FrontAdmission(edge)  # --max-waiting / --request-timeout at the front end (admission.py)
        self.serve_cfg: LLMServeConfig | None = None  # what the instances run (set by launch): a restart needs it
        self.instances = [Instance(i, a, info) for i, (a, info) in enumerate(zip(actors, infos))]
        self.tokenizer = tokenizer
        self.owns_ray = owns_ray
        self.index = GlobalKVIndex()
        for inst in self.instances:
            self.index.register(inst.index, inst.info.incarnation)
        self.router = self._new_router()
        self.cost = RecoveryCost()
        self.records: dict[str, RequestRecord] = {}
        self._lock = threading.RLock()
        self._status = "stopped"
        self.counters = {"migrated": 0, "recomputed": 0, "lost": 0, "instance_deaths": 0, "kv_snapshots_taken": 0,
                         "duplicate_tokens": 0, "finished": 0, "expired": 0, "restarts": 0}
        self.on_death: list[Callable[[int, float], None]] = []  # (instance, seconds since its last answer): benches
        self.keep_finished = False  # keep ended requests' records in ``finished`` (benchmarks, tests)
        self.finished: list[RequestRecord] = []
        self.pd: PDCoordinator | None = None  # with --pd (attach_pd)
        self.fit = infos[0].fit  # what an instance can ever hold (the instances run one config)
        self.max_model_len = self.fit.max_model_len

    # ---- building -----------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, cfg: LLMServeConfig, cluster: ClusterConfig) -> ClusterLLMEngine:
        """Start (or join) Ray, create ``cluster.instances`` instance actors from ``cfg`` (an LLMServeConfig) and
        wait until every one has loaded its model."""
        from grserve.cluster.llm.instance import spawn_instance
        from grserve.engine.tokenizer import load_tokenizer

        pd = getattr(cfg, "pd", None)
        if pd is not None and pd.pd:
            from grserve.cluster.llm.pd_disagg import check_pd

            check_pd(pd, cluster, cfg.llm.prefix_cache_tokens)
        actors, infos, owns = launch_actors(lambda i, inc: spawn_instance(i, cfg, cluster, inc), cluster)
        # the instances' tokenizer (AsyncLLMEngine.build): --tokenizer, else the model's; a preset's under
        # --tokenizer-cache, written for the same context length (so both write byte-identical files)
        tok = load_tokenizer(cfg.api.tokenizer or cfg.model.source, infos[0].vocab_size, infos[0].max_model_len,
                             cfg.api.tokenizer_cache)
        eng = cls(actors, infos, cluster, tok, owns, tok.eos_token_id, cfg.edge)
        eng.serve_cfg = cfg
        if pd is not None and pd.pd:
            from grserve.cluster.llm.pd_disagg import attach_pd
            from grserve.cluster.llm.pd_roles import RoleMonitor

            attach_pd(eng, pd, cfg.slo, RoleMonitor)
        return eng

    def describe(self) -> list[str]:
        """What runs where (the start-up lines)."""
        import os
        import socket

        lines = [f"front end: pid {os.getpid()} on {socket.gethostname()}, routing {self.cc.routing}, "
                 f"KV index blocks of {self.cc.kv_block_size} tokens, heartbeat timeout {self.cc.heartbeat_timeout_s}s"]
        for inst in self.instances:
            i = inst.info
            assert isinstance(i, LLMInstanceInfo)
            lines.append(instance_line(inst, f"{i.num_blocks} blocks x {i.block_size}, prefix cache "
                                             f"{i.prefix_cache_tokens} tokens"))
        if self.pd is not None:
            lines.append(self.pd.describe())
        return lines

    # ---- lifecycle ------------------------------------------------------------------------------------------------
    def start(self) -> ClusterLLMEngine:
        self._start_polling(self._poll_loop)
        return self

    def stop(self) -> None:
        self._stop_instances()
        self._shutdown_ray()

    def __enter__(self) -> ClusterLLMEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def reset(self, routing: str | None = None) -> None:
        """Benchmarks: empty every live instance's prefix cache (new incarnations), a fresh KV index, router and
        counters (``routing``: a new policy). Call while no request runs."""
        import dataclasses

        import ray

        from grserve.cluster.core.ray_runtime import new_incarnation

        if self.records:
            raise RuntimeError("reset() with requests in flight")
        if routing is not None:
            self.cc = dataclasses.replace(self.cc, routing=routing)
        live = [inst for inst in self.instances if inst.up]
        incs = {inst.index: new_incarnation() for inst in live}
        ray.get([inst.actor.reset.remote(incs[inst.index]) for inst in live])
        with self._lock:
            self.index = GlobalKVIndex()
            for inst in self.instances:
                if inst.up:
                    self.index.register(inst.index, incs[inst.index])
                else:
                    self.index.drop_instance(inst.index)
            self.router = self._new_router()
            for inst in self.instances:
                if not inst.up:
                    self.router.mark_down(inst.index)
            self.counters = {k: 0 for k in self.counters}
            self.finished = []

    def _new_router(self) -> Router:
        c = self.cc
        return Router(len(self.instances), c.routing, block_size=c.kv_block_size, index=self.index,
                      decode_weight=c.decode_weight, cache_weight=c.cache_weight)

    # ---- requests ---------------------------------------------------------------------------------------------------
    def submit(self, req: LLMRequest) -> RequestHandle[LLMResult]:
        if self._status != "ok":
            raise EngineStopped(f"engine is {self._status}")
        self.fit.check(len(req.prompt_ids), req.params.max_tokens)  # ValueError: no instance could ever run it
        handle: RequestHandle[LLMResult] = RequestHandle(req.request_id, self.cancel)
        rec = RequestRecord(req.request_id, list(req.prompt_ids), req.params, handle, TokenStream(),
                            submitted_at=time.perf_counter(), priority=req.priority)
        with self._lock:
            if req.request_id in self.records:
                raise ValueError(f"request id {req.request_id} is already running")
            self.admission.admit(req.request_id)  # EngineOverloaded beyond --max-waiting
            self.records[req.request_id] = rec
            try:
                self._send(rec, rec.next_attempt(), recovery=False)
            except RequestLost:
                del self.records[req.request_id]
                self.admission.started(req.request_id)
                raise EngineStopped("no live instance") from None
        return handle

    def _send(self, rec: RequestRecord, attempt: Attempt, recovery: bool) -> None:
        """Route and submit one attempt of ``rec`` (lock held)."""
        if self.pd is not None and not recovery and self.pd.route(rec, attempt):
            return  # PD placed it (split, or whole on a decode-role instance)
        try:
            d = self.router.route(attempt, recovery=recovery)
        except NoInstance:
            raise RequestLost("no live instance is left") from None
        rec.instance = d.instance
        self.instances[d.instance].actor.submit.remote(attempt)

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            rec = self.records.pop(request_id, None)
            if rec is None:
                return False
            self.router.release(request_id)
            self.admission.started(request_id)
            if self.pd is not None:
                self.pd.forget(request_id)  # between its phases: nothing runs anywhere, its snapshot goes
            inst = self.instances[rec.instance]
            if inst.up:
                inst.actor.cancel.remote(request_id)
        _fail(rec.handle, RequestCancelled(f"request {request_id} cancelled"))
        return True

    # ---- instances: polls, heartbeats, deaths -----------------------------------------------------------------
    def _poll_loop(self, inst: Instance) -> None:
        from grserve.cluster.core import heartbeat

        def answered(res: LLMPoll) -> None:
            self._on_poll(inst, res)
            self._expire()
            heartbeat.resync(self.index, inst.index, inst.actor, self.cc.heartbeat_timeout_s)

        heartbeat.watch(inst.actor, self.cc, lambda: self._status != "stopped" and inst.up, answered,
                        lambda why, silent: self.instance_down(inst.index, why, fence=True, silent_s=silent),
                        f"instance {inst.index}")

    def _on_poll(self, inst: Instance, res: LLMPoll) -> None:
        with self._lock:
            if not inst.up:
                return  # a fenced instance's late answer
            inst.stats = res.stats
            self.index.apply(inst.index, res.kv_events, res.kv_next_seq)
            for pk in res.prompt_kv:
                rec = self.records.get(pk.request_id)
                if rec is not None and rec.stream.attempt == pk.attempt and rec.instance == inst.index:
                    rec.snapshot = pk.kv
                    self.counters["kv_snapshots_taken"] += 1
                    if self.pd is not None:
                        self.pd.on_snapshot(rec)
            for report in res.tokens:
                try:
                    self._on_tokens(inst, report)
                except Exception as exc:  # noqa: BLE001 - e.g. a token gap: that request fails, the poller lives
                    log.exception("bad token report from instance %d", inst.index)
                    rec = self.records.get(report.request_id)
                    if rec is not None:
                        self._end(rec, None, exc)
            if self.pd is not None and self.pd.monitor is not None:
                self.pd.monitor.tick()

    def _on_tokens(self, inst: Instance, report: TokenReport) -> None:
        rid, attempt, finished, reason = report.request_id, report.attempt, report.finished, report.finish_reason
        rec = self.records.get(rid)
        if rec is None or rec.stream.attempt != attempt or rec.instance != inst.index:
            return
        st = rec.stream
        before = st.duplicates
        new, text = st.accept(report)
        self.counters["duplicate_tokens"] += st.duplicates - before
        if new:
            if rec.first_token_at is None:
                rec.first_token_at, rec.first_token_attempt = time.perf_counter(), attempt
                rec.cached_tokens = report.cached_tokens
                self.admission.started(rid)
                if self.pd is not None:
                    self.pd.on_first_token(rec)
            self.router.on_tokens(rid, len(new))
        rec.take_phases(attempt, report.phases)
        paused = finished and reason == "pause"  # PD: the prefill attempt ended, the request goes on elsewhere
        if finished and not paused and reason not in ("stop", "length"):
            if reason == "error":
                self._end(rec, None, EngineStepFailed(f"request {rid} failed in an engine step"))
            return  # "abort": cancelled by us (the handle is already failed)
        if paused and (self.pd is None or not self.pd.prefill_ended(rec)):
            self._end(rec, None, EngineStepFailed(f"request {rid}: an attempt paused with nowhere to go on"))
            return
        done = finished and not paused
        if new or done:
            rec.handle.push(TokenEvent(0, new, text, done, reason if done else None))
        if done:
            self._end(rec, LLMResult(rid, list(st.output_ids), st.text, reason or "stop", len(rec.prompt_ids),
                                     rec.migrations, rec.cached_tokens, **rec.result_phases(attempt, time.perf_counter())),
                      None)
        elif paused:
            self.pd.try_handoff(rec)

    def _expire(self) -> None:
        """Fail every request that waited for its first token past ``--request-timeout`` (``admission.py``)."""
        with self._lock:
            for rid in self.admission.expired():
                rec = self.records.get(rid)
                if rec is None:
                    continue
                inst = self.instances[rec.instance]
                if inst.up:
                    inst.actor.cancel.remote(rid)
                self.counters["expired"] += 1
                self._end(rec, None, RequestTimedOut(f"request {rid} waited more than "
                                                     f"{self.admission.request_timeout_s:g} s for its first token"))

    def _end(self, rec: RequestRecord, result: LLMResult | None, exc: BaseException | None) -> None:
        self.records.pop(rec.request_id, None)
        self.admission.started(rec.request_id)
        self.router.release(rec.request_id)
        if self.pd is not None:
            self.pd.forget(rec.request_id)
        if self.keep_finished:
            self.finished.append(rec)
        if exc is not None:
            _fail(rec.handle, exc)
        elif not rec.handle.future.done():
            self.counters["finished"] += 1
            rec.handle.future.set_result(result)

    def instance_down(self, index: int, why: str, fence: bool = True, silent_s: float = 0.0) -> None:
        """Take an instance out (fencing it first) and move every request it held."""
        import ray

        inst = self.instances[index]
        with self._lock:
            if not inst.up:
                return
            inst.up, inst.down_at, inst.down_reason = False, time.perf_counter(), why
            self.counters["instance_deaths"] += 1
            self.router.mark_down(index)
            self.index.drop_instance(index)
        log.warning("instance %d is down (%s); moving its requests", index, why)
        if fence:
            try:
                ray.kill(inst.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        with self._lock:
            for rec in [r for r in self.records.values() if r.instance == index]:
                self._recover(rec)
        for cb in self.on_death:
            cb(index, silent_s)
        if getattr(self.cc, "restart_instances", False) and self.serve_cfg is not None and self._status == "ok":
            from grserve.cluster.core import respawn

            respawn.respawn_later(self, index)  # a new actor, a new incarnation (respawn.py)

    def spawn_actor(self, index: int, incarnation: str) -> ActorHandle:
        """A new engine instance actor for ``index`` from the instances' config (``respawn.py``)."""
        from grserve.cluster.llm.instance import spawn_instance

        assert self.serve_cfg is not None
        return spawn_instance(index, self.serve_cfg, self.cc, incarnation)

    def instance_up(self, index: int, actor: ActorHandle, info: LLMInstanceInfo) -> bool:
        """A restarted instance (a new actor under a new incarnation) takes dead ``index``'s place: registered in
        the KV index (resynced by its first snapshot), back in the router, polled. False if ``index`` is up."""
        return self._rejoin(index, actor, info, self._poll_loop)

    def _recover(self, rec: RequestRecord) -> None:
        self.router.release(rec.request_id)
        if self.pd is not None:
            self.pd.forget(rec.request_id)  # moved like any request; an ordinary request from now on
        p = plan(rec, self.cc.migration_limit, self.cost)
        if p.action == "fail":
            self.counters["lost"] += 1
            self._end(rec, None, RequestLost(f"request {rec.request_id} lost: {p.reason}"))
            return
        snapshot = rec.snapshot[:, :, :p.snapshot_tokens] if p.action == "migrate" and rec.snapshot is not None \
            else None
        rec.migrations += 1
        rec.recovered.append(p.action)
        rec.stream.new_attempt()
        self.counters["migrated" if p.action == "migrate" else "recomputed"] += 1
        try:
            self._send(rec, rec.next_attempt(snapshot), recovery=True)
        except RequestLost as exc:
            self.counters["lost"] += 1
            self._end(rec, None, RequestLost(f"request {rec.request_id} lost: {exc}"))

    # ---- state ------------------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Requests waiting for their first token (the edge's ``--max-waiting`` bounds it; ``admission.py``)."""
        return self.admission.depth

    @property
    def max_waiting(self) -> int | None:
        return self.admission.max_waiting

    def health(self) -> EngineHealth:
        up = [inst.index for inst in self.instances if inst.up]
        status = self._status if up or self._status != "ok" else "stopped"
        stats = self.stats()
        return EngineHealth(status, int(stats["waiting"]), int(stats["running"]),  # type: ignore[arg-type]
                            {"instances_up": len(up), "instances": len(self.instances), "routing": self.cc.routing})

    def stats(self) -> dict[str, float]:
        out = self._cluster_stats(SUMMED_STATS)
        if self.pd is not None:
            out.update(self.pd.stats())
        return out
