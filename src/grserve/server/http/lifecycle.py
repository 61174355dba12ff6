"""One request through the engine, seen from a route: ``submit`` (the engine's refusals as 429 / 503 / 400) and
``finish`` (await the result, or the route's own work on its events; the engine's failures as 503 / 500; a client
that disconnects first has its request cancelled in the engine, which frees what it holds)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from fastapi import Request

from grserve.engine.protocol import (
    Engine,
    EngineOverloaded,
    EngineStopped,
    RequestCancelled,
    RequestHandle,
    RequestTimedOut,
)
from grserve.server.http.edge import hand_over
from grserve.inputs.refusal import ApiError, overloaded, queue_timeout, stopped
from grserve.server.http.errors import ClientDisconnected

log = logging.getLogger("grserve.server")


class Cancels(Protocol):
    """What ``finish`` cancels when the client leaves: an engine, or a group of its requests (``n > 1``)."""

    def cancel(self, request_id: str) -> Any: ...


def submit(engine: Engine, request: Any, invalid_field: str | None = None) -> RequestHandle:
    """``engine.submit``: a full queue is a 429, a stopping engine a 503, both with ``Retry-After``; a request the
    engine can never serve (``ValueError``, e.g. an LLM prompt that never fits the KV pool) a 400 naming
    ``invalid_field``."""
    try:
        return engine.submit(request)
    except EngineOverloaded as exc:
        raise overloaded(str(exc)) from None
    except EngineStopped as exc:
        raise stopped(exc) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), invalid_field, "invalid_value") from None


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first(request: Request, engine: Cancels, handle: RequestHandle, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client disconnects first — or this task is cancelled — cancel the request in the
    engine, which frees what it holds, and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        engine.cancel(handle.request_id)
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task not in done:
        engine.cancel(handle.request_id)
        task.cancel()
        raise ClientDisconnected(handle.request_id)
    return task.result()


async def finish(request: Request, engine: Cancels, handle: RequestHandle,
                 work: Awaitable[Any] | None = None) -> Any:
    """Await a submitted request's result (or ``work``, e.g. collecting its events): 503 when the engine stops
    before it is done, 500 (logged) when it fails, ``ClientDisconnected`` (request cancelled, resources freed)
    when the client leaves first."""
    hand_over(request.scope)  # in the engine's queue now: admission no longer counts it as pending
    try:
        return await _first(request, engine, handle, work if work is not None else handle.result())
    except (ApiError, ClientDisconnected):
        raise
    except Exception as exc:  # noqa: BLE001 - every engine failure becomes a JSON answer
        error = engine_failure(exc, handle.request_id)
        raise error from (exc if error.type == "internal" else None)


def engine_failure(exc: BaseException, request_id: str) -> ApiError:
    """The answer to a request the engine failed (call it in the ``except`` block: a 500 is logged with its
    traceback): 503 ``queue_timeout`` past its queue deadline, 503 ``stopped`` when the engine stopped (a planned
    drain) or cancelled it, the status an engine error names (cluster: ``RequestLost``, ``InstanceOverloaded``;
    a 429 or 503 with ``Retry-After``), else 500 ``internal``."""
    if isinstance(exc, RequestTimedOut):
        return queue_timeout(exc)
    if isinstance(exc, (EngineStopped, RequestCancelled)):
        return stopped(exc)
    status = getattr(exc, "http_status", None)
    if status is not None:  # a 429 or 503 says when to retry, as the edge's and the engine's own do
        retry = {"Retry-After": "1"} if status in (429, 503) else None
        return ApiError(status, str(exc), None, getattr(exc, "error_type", "unavailable"), retry)
    log.exception("engine failed on request %s", request_id)
    return ApiError(500, f"internal error while serving the request: {type(exc).__name__}", None, "internal")


def check_catalog_version(result: Any, catalog: Any) -> Any:
    """``result`` if it was computed on the catalog the request was checked against or a newer one (a reload that
    landed meanwhile). An engine behind its front end — one that lost a reload — never answers normally: 503
    ``engine_state_behind`` with ``Retry-After`` (engine_core/client.py brings a restarted engine level first;
    this is the last guard)."""
    served, wanted = int(result.catalog_version), int(catalog.version)
    if 0 < served < wanted:  # 0: not reported (a stand-in engine); a catalog store counts from 1
        log.error("engine answered from catalog version %d, the front end serves %d: refused", served, wanted)
        raise ApiError(503, f"the engine serves catalog version {served}, older than the front end's {wanted}; "
                            "retry shortly", None, "engine_state_behind", {"Retry-After": "1"})
    return result
