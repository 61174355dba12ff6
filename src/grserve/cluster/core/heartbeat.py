"""Liveness of one instance actor, shared by every cluster front end: the long poll is the heartbeat.

``watch`` long-polls ``actor.poll(wait_s)`` until the front end stops or the instance is taken out; each answer goes
to ``on_answer``. The instance is declared down (``on_down(why, silent_s)``) when a poll fails with an actor error
(a killed process: Ray notices in tens of milliseconds) or when no poll has answered for ``heartbeat_timeout_s``
(a hung or frozen process). The caller then **fences** it (``fence``: ``ray.kill``), so a hung instance cannot come
back and deliver late, and moves its requests. ``resync`` fetches an instance's full KV snapshot when the global
index lost track of it (a sequence gap or a new incarnation).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from grserve.cluster.wire import GRPoll, LLMPoll

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from grserve.cluster.core.kv_index import GlobalKVIndex
    from grserve.config import ClusterConfig

log = logging.getLogger("grserve.cluster")
Poll = TypeVar("Poll", LLMPoll, GRPoll)  # what an instance's poll answers (wire.py)


def poll_wait(cc: ClusterConfig) -> float:
    """One poll's longest wait: ``poll_wait_s``, and never more than an eighth of the heartbeat timeout (so a slow
    answer on a loaded machine is not taken for death)."""
    return min(cc.poll_wait_s, cc.heartbeat_timeout_s / 8)


def watch(actor: ActorHandle, cc: ClusterConfig, running: Callable[[], bool],
          on_answer: Callable[[Poll], None], on_down: Callable[[str, float], None], name: str = "instance") -> None:
    """Poll ``actor`` while ``running()``; ``cc`` gives ``poll_wait_s`` and ``heartbeat_timeout_s``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    last_ok, ref = time.monotonic(), None
    while running():
        if ref is None:
            ref = actor.poll.remote(poll_wait(cc))
        try:
            res = ray.get(ref, timeout=min(0.1, cc.heartbeat_timeout_s))
        except GetTimeoutError:
            if time.monotonic() - last_ok > cc.heartbeat_timeout_s:
                on_down("heartbeat timeout", time.monotonic() - last_ok)
                return
            continue
        except RayActorError as exc:
            on_down(f"actor died ({type(exc).__name__})", time.monotonic() - last_ok)
            return
        except Exception:  # noqa: BLE001 - e.g. an error while deserialising: count it as a failed poll
            log.exception("poll of %s failed", name)
            ref = None
            continue
        ref, last_ok = None, time.monotonic()
        try:
            on_answer(res)
        except Exception:  # noqa: BLE001 - a bug handling one answer must not end the heartbeat (no death seen)
            log.exception("handling a poll answer of %s failed", name)


def fence(actor: ActorHandle) -> None:
    """Kill an instance actor for good (a dead one is fine)."""
    import ray

    if not ray.is_initialized():  # no Ray, no actor (and ray.kill would start a Ray)
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass


def resync(index: GlobalKVIndex, instance: int, actor: ActorHandle, timeout_s: float) -> None:
    """Replace ``instance``'s entries in the global KV index by its snapshot when the index asks for one."""
    import ray

    if not index.needs_snapshot(instance):
        return
    try:
        index.apply_snapshot(ray.get(actor.kv_snapshot.remote(), timeout=timeout_s))
    except Exception:  # noqa: BLE001 - the next poll decides whether it is dead
        pass
