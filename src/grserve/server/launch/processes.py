"""A server split in processes: one engine-core process and ``--api-servers N`` HTTP front ends.

- N = 1: this process is the front end; it starts the core (``CoreSupervisor``) and serves the app over an
  ``EngineCoreClient``. SIGTERM drains the core through the client, then stops it.
- N > 1: this process binds the port, starts the core, then N front-end processes (spawned) that all accept on the
  one listening socket (the kernel spreads connections over them) and each talk to the core over their own
  sockets. It restarts the core when it dies (the front ends find the new one by its heartbeat) and a front end
  that dies; SIGTERM (or Ctrl-C) goes to every front end, which drain, then the core is stopped.

``front_end(cfg, client, info) -> (app, start-up lines)`` builds a mode's app over the client (a module-level
function: the spawned front ends import it by name).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from grserve.engine_core.client import EngineCoreClient
from grserve.engine_core.core_process import Endpoints
from grserve.engine_core.supervisor import CoreSupervisor
from grserve.flags import UsageError

FrontEnd = Callable[[Any, EngineCoreClient, dict], tuple[Any, list[str]]]


def start_core(kind: str, cfg: Any, max_restarts: int, max_waiting: int | None) -> tuple[CoreSupervisor,
                                                                                       EngineCoreClient, dict]:
    """Spawn the core and wait until it is ready; a core that fails to start is a ``UsageError`` with its reason (a
    bad model, file or flag: the message the engine raised)."""
    sup = CoreSupervisor(kind, cfg, max_restarts).start()
    client = EngineCoreClient(sup.endpoints, max_waiting=max_waiting, on_close=sup.stop)
    sup.listeners.append(client)
    try:
        info = client.wait_ready(sup.alive)
    except RuntimeError as exc:
        try:
            with open(sup.endpoints.error_file) as f:
                reason = f.read()
        except OSError:
            reason = f"{exc}; see its error above"
        client.stop()
        raise UsageError(reason) from None
    sup.started(info)  # the next incarnation keeps this one's thread count
    return sup, client, info


def serve_split(kind: str, cfg: Any, server: Any, process: Any, edge: Any, front_end: FrontEnd) -> int:
    from grserve.server.launch.serving import serve_until_exit

    if process.api_servers > 1:
        return _serve_many(kind, cfg, server, process, edge, front_end)
    sup, client, info = start_core(kind, cfg, process.engine_restarts, edge.max_waiting)
    try:
        app, lines = front_end(cfg, client, info)
    except BaseException:
        client.stop()
        raise
    for line in lines:
        print(f"grserve: {line}", flush=True)
    print(f"grserve: engine process pid {sup.pid}, HTTP front end pid {os.getpid()} (ZeroMQ over Unix sockets "
          f"between them)", flush=True)
    return serve_until_exit(app, server.host, server.port, server.log_level, client.stop)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _serve_many(kind: str, cfg: Any, server: Any, process: Any, edge: Any, front_end: FrontEnd) -> int:
    n = process.api_servers
    sock = _bind(server.host, server.port)
    sup, client, info = start_core(kind, cfg, process.engine_restarts, None)
    share = None if edge.max_waiting is None else max(1, edge.max_waiting // n)
    ctx = multiprocessing.get_context("spawn")

    def spawn(i: int) -> Any:
        p = ctx.Process(target=front_end_process, args=(cfg, sup.endpoints, sock, front_end, share, server, i),
                        name=f"grserve-api-server-{i}")
        p.start()
        return p

    procs = [spawn(i) for i in range(n)]
    for line in info.get("lines", []):
        print(f"grserve: {line}", flush=True)
    print(f"grserve: engine process pid {sup.pid}, {n} HTTP front ends (pids "
          f"{', '.join(str(p.pid) for p in procs)}) on {server.host}:{server.port}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            for i, p in enumerate(procs):
                if p.exitcode is not None:
                    print(f"grserve: HTTP front end {i} (pid {p.pid}) exited ({p.exitcode}); starting another",
                          flush=True)
                    procs[i] = spawn(i)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)  # each drains (the core finishes what is running), then exits
        deadline = time.monotonic() + edge.shutdown_timeout + 15
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        client.stop()
        sock.close()
    return 0


def front_end_process(cfg: Any, endpoints: Endpoints, sock: socket.socket, front_end: FrontEnd,
                      max_waiting: int | None, server: Any, index: int) -> None:
    """A spawned HTTP front end: a client of the running core, the mode's app, uvicorn on the shared socket."""
    from grserve.server.launch.serving import run_uvicorn

    parent = os.getppid()
    client = EngineCoreClient(endpoints, max_waiting=max_waiting, owns_core=False)
    info = client.wait_ready(timeout_s=60)
    app, _lines = front_end(cfg, client, info)

    def orphaned() -> None:  # the server process was killed (-9): drain and go
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=orphaned, name="grserve-parent-watch", daemon=True).start()
    edge = getattr(app.state, "edge", None)
    try:
        run_uvicorn(app, server.host, server.port, server.log_level, client.stop,
                    edge.shutdown_timeout if edge is not None else 30.0, sockets=[sock])
    finally:
        client.stop()
