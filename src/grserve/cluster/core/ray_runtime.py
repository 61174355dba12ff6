"""Ray for the cluster: join an existing cluster or start a local one; the front end's SIGTERM; incarnation ids,
torch threads per instance, the node's address (each wing spawns its own instance actors).

A local Ray is started with no dashboard (unless asked) and ``num_cpus`` logical CPUs (instances ask for 0 CPUs: on
a small machine the OS shares the cores; the actors' torch threads are set per instance), on loopback with a token
(``ray_security.py``). Ray's own processes listen on ports the OS picks (port 0), so they never collide with fixed
ports.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import uuid
from types import FrameType

log = logging.getLogger("grserve.cluster")


def start_ray(address: str | None, num_cpus: int = 2, dashboard: bool = False, allow_open: bool = False) -> bool:
    """Connect to Ray; returns True when this call started a local Ray (the caller then shuts it down). How each
    case is secured: ``ray_security.py`` (``OpenRay`` for a cluster to join that it refuses)."""
    import ray

    from grserve.cluster.core.ray_security import check_joined, local_ray_env

    if ray.is_initialized():
        return False
    if address:
        check_joined(address, allow_open)
        with front_end_sigterm():
            ray.init(address=address, log_to_driver=False)
        return False
    with front_end_sigterm(), local_ray_env() as ip:
        ray.init(address="local", include_dashboard=dashboard, num_cpus=num_cpus, log_to_driver=False,
                 configure_logging=False, _node_ip_address=ip)
    return True


_SIGTERM: list[int] = []  # the SIGTERM this process received, if any (``on_sigterm``)


@contextlib.contextmanager
def front_end_sigterm():
    """Around ``ray.init``: replace the SIGTERM handler it installs in the driver (``sys.exit(15)``) by
    ``on_sigterm``. With Ray's, a SIGTERM'd ``serve … --instances N`` drained (uvicorn's handler, while it serves),
    then uvicorn re-raised the signal into Ray's handler and the process exited with status 15, where a
    one-instance server dies by the signal (143 in a shell). (During ``ray.init`` itself Ray's handler runs.)"""
    import signal
    import threading

    main = threading.current_thread() is threading.main_thread()
    if main:  # once per process; it acts only after a SIGTERM
        atexit.unregister(_die_by_signal)
        atexit.register(_die_by_signal)
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, on_sigterm)


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """While Ray is up (launching, or joined with ``--ray-address``): unwind (Ray may turn the exit into status 1
    inside a ``ray.get``); at exit ``_die_by_signal`` shuts Ray down and dies by the signal. After the server's
    drain stopped the instances and shut the local Ray down: die by the signal at once, like a one-instance
    server."""
    import ray

    _SIGTERM.append(signum)
    if ray.is_initialized():
        raise SystemExit(128 + signum)
    _die_by_signal()


def _die_by_signal() -> None:
    import signal

    if not _SIGTERM:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()
    signal.signal(_SIGTERM[0], signal.SIG_DFL)
    signal.raise_signal(_SIGTERM[0])


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


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - only for the start-up line
        pass
    return "127.0.0.1"
