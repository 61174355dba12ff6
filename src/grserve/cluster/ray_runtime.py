"""Ray for the cluster: join an existing cluster or start a local one, and create engine instance actors.

A local Ray is started with no dashboard and ``num_cpus`` logical CPUs (instances ask for 0 CPUs: on a small
machine the OS shares the cores; the actors' torch threads are set per instance). Ray's own processes listen on
ports the OS picks (port 0), so they never collide with fixed ports.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

log = logging.getLogger("grserve.cluster")


def start_ray(address: str | None, num_cpus: int = 2) -> bool:
    """Connect to Ray; returns True when this call started a local Ray (the caller then shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    ray.init(include_dashboard=False, num_cpus=num_cpus, log_to_driver=False, configure_logging=False)
    return True


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


def instance_threads(requested: int, instances: int, cores: int | None = None) -> int:
    """Torch threads per instance actor: ``requested``, or for 0 a share of the cores (torch's default of one thread
    per core in every actor oversubscribes a small machine: 2 x 120 tokens took 34 s with 2 threads in each of 3
    actors on 2 cores vs 1.5 s with 1)."""
    import os

    if requested > 0:
        return requested
    return max(1, (cores or os.cpu_count() or 1) // max(1, instances))


def spawn_instance(index: int, cfg: Any, cluster: Any, incarnation: str) -> Any:
    """One engine instance actor (``cluster/instance.py``), spread over the cluster's nodes; never restarted by
    Ray (the front end decides: a dead instance's requests move, its entries leave the KV index)."""
    import ray

    from grserve.cluster.instance import EngineInstance

    actor_cls = ray.remote(EngineInstance)
    # max_concurrency: calls (coroutines) in flight per actor. Each ``submit`` waits in a worker thread for the
    # engine lock; at 64, an overloaded instance's pending submits filled every slot and its polls (the heartbeat)
    # queued behind them until the front end fenced all three instances (bench cluster, cluster12 session)
    return actor_cls.options(num_cpus=0, max_restarts=0, max_concurrency=4096, scheduling_strategy="SPREAD",
                             name=None).remote(index, cfg, incarnation, cluster.kv_block_size, cluster.kv_snapshot,
                                               instance_threads(cluster.instance_threads, cluster.instances))
