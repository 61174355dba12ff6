"""Where a server's engine runs, chosen once for the three modes (retrieval, ranking, LLM):

- ``cluster``: ``--instances N`` > 1 or ``--ray-address``: N engine instances (Ray actors) behind this front end
  (``cluster/``);
- ``engine process``: ``--engine-process`` (the default): the engine in an engine-core process of its own, this
  process (or ``--api-servers N`` processes) the HTTP front end (``processes.py``);
- ``in-thread``: ``--no-engine-process``: one process, the engine on a thread.

A mode's command gives its three ways to run (``Deployments``) and ``deploy`` runs the chosen one. Also here, what
two modes' cluster deployments share: the app around a cluster front end (``cluster_app``) and the replay of the
front end's state store on the started instances (``restore_started``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grserve.flags import UsageError

IN_THREAD, ENGINE_PROCESS, CLUSTER = "in-thread", "engine process", "cluster"


@dataclass(frozen=True)
class Deployments:
    """A mode's three ways to run, each ``cfg -> exit code``."""

    in_thread: Callable[[Any], int]
    engine_process: Callable[[Any], int]
    cluster: Callable[[Any], int]


def deployment(cfg: Any) -> str:
    """Where ``cfg``'s engine runs (a mode's serve config: its ``cluster`` and ``process``); ``--api-servers`` > 1
    without an engine process is a usage error (the front ends share one engine process)."""
    if cfg.cluster.instances > 1 or cfg.cluster.ray_address:
        return CLUSTER
    if cfg.process.api_servers > 1 and not cfg.process.engine_process:
        raise UsageError("--api-servers > 1 needs --engine-process (the front ends share one engine process)")
    return ENGINE_PROCESS if cfg.process.engine_process else IN_THREAD


def deploy(cfg: Any, ways: Deployments) -> int:
    """Run the mode the way ``deployment`` chooses."""
    run = {IN_THREAD: ways.in_thread, ENGINE_PROCESS: ways.engine_process, CLUSTER: ways.cluster}[deployment(cfg)]
    return run(cfg)


def usage_error(exc: Exception) -> UsageError:
    """A start-up error the user can fix (a bad catalog file, a vocab mismatch, a missing key) as a usage error."""
    return UsageError(exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc))


def cluster_app(engine: Any, make_app: Callable[[Any], Any]) -> Any:
    """The unchanged app of a GR mode around a cluster front end, its /metrics with the cluster's collectors and
    every instance's batches in the batch histograms."""
    from grserve.cluster.core.metrics import ClusterCollector
    from grserve.cluster.gr.modes import GRClusterCollector
    from grserve.server.http.metrics import Metrics

    metrics = Metrics()
    app = make_app(metrics)
    engine.on_batch = metrics.on_batch
    metrics.registry.register(ClusterCollector(engine))
    metrics.registry.register(GRClusterCollector(engine))
    return app


def restore_started(engine: Any, stored: Any) -> None:
    """The front end's store replayed on a started cluster (``engine.restore``): an instance that fails to apply it
    is fenced and restarted with it. A store that does not fit the served model stops the engine (usage error)."""
    try:
        engine.restore(stored)
    except BaseException as exc:
        engine.stop()
        if isinstance(exc, ValueError):
            raise usage_error(exc) from None
        raise
