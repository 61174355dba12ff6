"""Restart of a dead instance (``--restart-instances``): a new actor under a new incarnation takes the dead one's
place. The same loop serves the LLM cluster and the retrieval/ranking cluster: the engine supplies
``spawn_actor(index, incarnation)`` and ``instance_up(index, actor, info)`` (the GR one first replays every state
change the live instances got: ``broadcast_log.py``).

When the front end takes an instance out (actor death, or fenced after a heartbeat timeout), its requests move
first (``recovery.py``); then, with ``ClusterConfig.restart_instances``, a background thread spawns a fresh
``EngineInstance`` actor with the same index and a new incarnation id and waits until it has loaded its model.
``ClusterLLMEngine.instance_up`` then puts it back: the KV index registers the new incarnation (no entries until its
first snapshot, which the instance's poller fetches at once: the resync of ``kv_index.py``), the router takes it
back with an empty booking, ``grserve_cluster_instance_up`` shows 1 again and ``grserve_cluster_instance_restarts``
counts it. The dead actor is never reused (it was fenced: ``ray.kill``), so nothing it says can come back.

A spawn that fails (or loads for longer than ``load_timeout_s``) is retried after 1, 2, 4 … s, at most
``attempts`` times; an engine that stops meanwhile kills what was spawned.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

from grserve.cluster.core.heartbeat import fence

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.cluster.wire import InstanceInfo

log = logging.getLogger("grserve.cluster")


class Respawnable(Protocol):
    """What a restart needs of a front end (``ClusterLLMEngine``, ``ClusterGREngine``)."""

    _status: str

    def spawn_actor(self, index: int, incarnation: str) -> ActorHandle: ...

    def instance_up(self, index: int, actor: ActorHandle, info: InstanceInfo) -> bool: ...


def respawn_later(engine: Respawnable, index: int) -> threading.Thread:
    """Restart instance ``index`` in a background thread (the caller is a poller or a death callback)."""
    t = threading.Thread(target=respawn, args=(engine, index), daemon=True, name=f"grserve-cluster-respawn-{index}")
    t.start()
    return t


def respawn(engine: Respawnable, index: int, attempts: int = 3, load_timeout_s: float = 300.0,
            backoff_s: float = 1.0) -> bool:
    """Spawn a new actor for instance ``index``, wait for its model, and hand it to ``engine.instance_up``.
    Returns True when the instance is back."""
    import ray

    from grserve.cluster.core.ray_runtime import new_incarnation

    for attempt in range(attempts):
        if engine._status == "stopped":
            return False
        actor = engine.spawn_actor(index, new_incarnation())
        try:
            info = ray.get(actor.info.remote(), timeout=load_timeout_s)
            up = engine._status != "stopped" and engine.instance_up(index, actor, info)
        except Exception as exc:  # noqa: BLE001 - a failed start or catch-up: kill what was spawned, retry later
            log.warning("restart of instance %d failed (attempt %d): %s", index, attempt + 1, exc)
            fence(actor)
            time.sleep(backoff_s * 2 ** attempt)
            continue
        if not up:
            fence(actor)
            return False
        log.warning("instance %d restarted: pid %s, incarnation %s", index, info.pid, info.incarnation)
        return True
    return False
