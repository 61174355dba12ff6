"""The process around an app: uvicorn until SIGTERM / Ctrl-C, whose shutdown drains the engine first
(``draining_server``), and the one run-and-stop of the three ``grserve serve`` commands (``serve_until_exit``)."""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from grserve.config import EdgeConfig

log = logging.getLogger("grserve.server")

SHUTDOWN_GRACE_S = 5.0  # after the engine is stopped: time for the last answers to be written


def draining_server(app: FastAPI, config: Any, stop: Callable[[], None], shutdown_timeout_s: float) -> Any:
    """A uvicorn server whose shutdown (SIGTERM, Ctrl-C) first stops accepting connections, drains the engine
    for up to ``shutdown_timeout_s`` (queued and running requests finish), then stops it (``stop()``) — whatever is
    left fails with ``EngineStopped``, which its waiting client receives as a 503 ``stopped`` — and only then lets
    uvicorn close the connections (``SHUTDOWN_GRACE_S`` more, then it cancels what still runs)."""
    import uvicorn

    engine = app.state.engine

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()  # no new connections while draining
            loop = asyncio.get_running_loop()
            finished = await loop.run_in_executor(None, engine.drain, shutdown_timeout_s)
            if not finished:
                log.warning("shutdown: requests still running after %.1f s; ending them", shutdown_timeout_s)
            await loop.run_in_executor(None, stop)
            await super().shutdown(sockets)

    config.timeout_graceful_shutdown = SHUTDOWN_GRACE_S
    return DrainingServer(config)


def run_uvicorn(app: FastAPI, host: str, port: int, log_level: str, stop: Callable[[], None],
                shutdown_timeout_s: float, sockets: list[Any] | None = None) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/Ctrl-C, shutting down as ``draining_server`` says (``sockets``:
    accept on these bound sockets instead of binding ``host:port``: ``--api-servers``)."""
    import uvicorn

    server = draining_server(app, uvicorn.Config(app, host=host, port=port, log_level=log_level), stop,
                             shutdown_timeout_s)
    settle_heap()
    server.run(sockets=sockets)


def settle_heap() -> None:
    """Move everything built at start-up (model, catalog, tokenizer, libraries) out of the cyclic garbage
    collector's sight (``gc.freeze``): a full collection, which holds every thread, then walks only what requests
    allocated — a request that builds many objects cannot stall the others for the time it takes to walk the
    whole heap."""
    gc.collect()
    gc.freeze()


def serve_until_exit(app: FastAPI, host: str, port: int, log_level: str, stop: Callable[[], None]) -> int:
    """Serve until SIGTERM/Ctrl-C (``run_uvicorn``: drain for the app's ``EdgeConfig.shutdown_timeout``, then
    stop the engine), and ``stop()`` the engine whatever happens. Returns the exit code: 0, or uvicorn's (it
    exits 1 when it cannot bind)."""
    edge: EdgeConfig = getattr(getattr(app, "state", None), "edge", None) or EdgeConfig()
    try:
        run_uvicorn(app, host, port, log_level, stop, edge.shutdown_timeout)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 1
    finally:
        stop()
    return 0
