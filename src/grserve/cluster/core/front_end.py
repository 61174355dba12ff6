"""What every cluster front end shares (``ClusterLLMEngine``, ``ClusterGREngine``): the record of one instance
as the front end sees it, and the engine-contract life cycle around the instances — drain (take no new work, wait
until every request record is gone) and stop (fail what is left with ``EngineStopped``, join the pollers, fence
every actor, shut down a Ray this process started)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from grserve.cluster.core import heartbeat
from grserve.cluster.wire import InstanceInfo
from grserve.engine.protocol import EngineStopped, RequestHandle

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.cluster.core.kv_index import GlobalKVIndex
    from grserve.cluster.core.router import Router
    from grserve.config import ClusterConfig


@dataclass
class Instance:
    """An instance as its front end sees it: its actor, what it said of itself, its last stats, up or down."""

    index: int
    actor: ActorHandle
    info: InstanceInfo
    up: bool = True
    stats: dict[str, float] = field(default_factory=dict)
    down_at: float | None = None
    down_reason: str = ""
    thread: threading.Thread | None = None


class Journaled(Protocol):
    """What the life cycle reads of a wing's request record: the client's handle."""

    handle: RequestHandle


class FrontEndLifecycle:
    """Mixed into a front end that has ``_lock``, ``_status``, ``records`` (request id → a record with a
    ``handle``), ``instances``, ``owns_ray``, and for restarts ``index``, ``router`` and ``counters``."""

    _lock: threading.RLock
    _status: str
    records: dict[str, Journaled]  # request id → the wing's record (``RequestRecord``, ``GRRecord``)
    instances: list[Instance]
    owns_ray: bool
    index: GlobalKVIndex
    router: Router
    counters: dict[str, int]

    def drain(self, timeout_s: float | None = None) -> bool:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            if self._status == "ok":
                self._status = "draining"
        while self.records:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def _rejoin(self, index: int, actor: ActorHandle, info: InstanceInfo, poll: Callable[[Instance], None]) -> bool:
        """A restarted instance takes dead ``index``'s place (``respawn.py``): registered in the KV index (resynced
        by its first snapshot), back in the router with an empty booking, counted, polled by ``poll`` in a new
        thread. False (nothing changed) if ``index`` is up or the engine stopped."""
        inst = self.instances[index]
        with self._lock:
            if inst.up or self._status == "stopped":
                return False
            inst.actor, inst.info, inst.stats = actor, info, {}
            inst.up, inst.down_at, inst.down_reason = True, None, ""
            self.index.register(index, info.incarnation)
            self.router.mark_up(index)
            self.counters["restarts"] += 1
            self._poll_thread(inst, poll)
        return True

    def _start_polling(self, poll: Callable[[Instance], None]) -> None:
        """``start()``: status ok (once), then a poll thread for every live instance that has none."""
        with self._lock:
            if self._status == "ok":
                return
            self._status = "ok"
        for inst in self.instances:
            if inst.up and inst.thread is None:
                self._poll_thread(inst, poll)

    @staticmethod
    def _poll_thread(inst: Instance, poll: Callable[[Instance], None]) -> None:
        inst.thread = threading.Thread(target=poll, args=(inst,), daemon=True,
                                       name=f"grserve-cluster-poll-{inst.index}")
        inst.thread.start()

    def _cluster_stats(self, summed: tuple[str, ...]) -> dict[str, float]:
        """``stats()``'s common part: the live instances' ``summed`` stats added up, the front end's counters (as
        ``cluster_*``), the instances up and the requests in flight."""
        out: dict[str, float] = {k: 0.0 for k in summed}
        for inst in self.instances:
            if inst.up:
                for k in summed:
                    out[k] += float(inst.stats.get(k, 0))
        out.update({f"cluster_{k}": float(v) for k, v in self.counters.items()})
        out["instances_up"] = float(sum(inst.up for inst in self.instances))
        out["in_flight"] = float(len(self.records))
        return out

    def _stop_instances(self) -> None:
        """Stopped: fail every request still held, join the pollers, fence every instance actor."""
        with self._lock:
            self._status = "stopped"
            left = list(self.records.values())
            self.records.clear()
        for rec in left:
            fail_handle(rec.handle, EngineStopped("engine stopped"))
        for inst in self.instances:
            if inst.thread is not None:
                inst.thread.join(timeout=5)
                inst.thread = None
        for inst in self.instances:
            heartbeat.fence(inst.actor)

    def _shutdown_ray(self) -> None:
        import ray

        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def instance_line(inst: Instance, facts: str) -> str:
    """One start-up line of ``describe()``: where an instance runs, ``facts`` about its engine, its incarnation."""
    i = inst.info
    return (f"instance {inst.index}: Ray actor pid {i.pid} on {i.host} ({i.node_ip}), {i.device}, {facts}, "
            f"incarnation {i.incarnation}")


def fail_handle(handle: RequestHandle, exc: BaseException) -> None:
    """Fail a request's future with ``exc`` unless it already has its result."""
    if not handle.future.done():
        handle.future.set_exception(exc)


def launch_actors(spawn: Callable[[int, str], ActorHandle], cluster: ClusterConfig
                  ) -> tuple[list[ActorHandle], list[InstanceInfo], bool]:
    """Start (or join) Ray, create ``cluster.instances`` actors with ``spawn(index, incarnation)`` and wait until
    every one answers ``info()`` (its engine is built); on a failure fence them all (and stop a Ray started here).
    Returns (actors, their infos, whether this call started Ray)."""
    from grserve.cluster.core.ray_runtime import new_incarnation, start_ray
    from grserve.cluster.core.start_progress import wait_ready

    owns = start_ray(cluster.ray_address, dashboard=cluster.ray_dashboard, allow_open=cluster.allow_open_ray)
    actors = [spawn(i, new_incarnation()) for i in range(cluster.instances)]
    try:
        infos = wait_ready(actors)  # a line per instance as it becomes ready (cluster/core/start_progress.py)
    except Exception:
        abandon_actors(actors, owns)
        raise
    return actors, infos, owns


def abandon_actors(actors: list[ActorHandle], owns_ray: bool) -> None:
    """A launch that failed: fence every instance actor it spawned and stop the Ray it started."""
    import ray

    for a in actors:
        heartbeat.fence(a)
    if owns_ray:
        ray.shutdown()
