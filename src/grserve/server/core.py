"""The server core: what the three HTTP apps (retrieval, ranking, LLM) share, and nothing mode-specific.

``new_app`` builds an app around an engine (the ``Engine`` protocol of ``grserve.engine.protocol``): the error
handlers of its API family, the edge middleware (pure ASGI, before any routing or body parsing: the API key, the
admin routes, the request-body size limit; ``EdgeConfig``), the metrics middleware (pure ASGI, so it sees every final status and hides nothing
from the routes — a client disconnect included), ``GET /health`` (``engine.health()`` plus the app's detail;
503 unless ``ok``) and ``GET /metrics``. ``submit`` and ``finish`` take one request through the engine, cancelling it when
the client goes away. The validators turn user values into int64 arrays or a 4xx naming the field.

Error conventions — one per API family, each applied to every route of that family
=====================================================================================

**House API** (``/v1/recommend``, ``/v1/catalog``, ``/v1/rank``, ``/v1/users``, ``/v1/items``, and the retrieval
and ranking servers' unknown routes)::

    {"error": {"message": "...", "field": "history_sids[3][1]" | null, "type": "out_of_range"}}

====== =================================================================================================
status when (``type`` values)
====== =================================================================================================
400    a bad value in a well-formed request: body not valid JSON (``invalid_json``), a value out of range
       (``out_of_range``: token id, SID code, beam_width, top_n; pydantic's ``greater_than_equal`` ...),
       a SID of the wrong depth (``wrong_depth``), an empty list (``too_short``, ``empty_*``), a duplicate
       (``duplicate_candidates``), a catalog file that cannot be loaded or does not fit the served model
       (``catalog_load_failed``, ``catalog_incompatible``)
404    an unknown id (``unknown_items``, ``unknown_user``: the message lists them, ``field`` names the first
       one's position) or an unknown route (``not_found``)
405    a known route with the wrong method (``method_not_allowed``)
401    no or a wrong API key (``invalid_api_key``; with ``WWW-Authenticate: Bearer``)
403    an admin route while ``--admin-api-key`` is unset (``admin_disabled``) or called with the plain API key
       (``admin_key_required``); a catalog reload while ``--catalog-dir`` is unset (``reload_disabled``)
409    a registration over a limit (``too_many_users``, ``too_many_items``) or an item whose identifier token
       is another item's (``identifier_collision``)
413    too large (``body_too_large``, ``prompt_too_long``, ``too_many_candidates``, ``profile_too_long``,
       ``item_too_long``, ``too_many_excluded``, ``catalog_too_large``)
415    a body that is not JSON (``unsupported_media_type``)
422    only schema violations: a wrong type (``int_type``, ``list_type``, ``string_type``,
       ``model_attributes_type``), a missing field (``missing``), an unknown field (``extra_forbidden``),
       exactly-one-of violated (``history_missing`` / ``history_ambiguous``, ``user_*``, ``candidates_*``:
       ``field`` names the group)
500    an unexpected failure (``internal``); logged, the server keeps serving
429    the queue is full (``overloaded``, ``--max-waiting``) or another catalog reload is running
       (``reload_busy``); with ``Retry-After: 1``
503    the request waited in the queue past ``--request-timeout`` and was dropped uncomputed (``queue_timeout``),
       or the server is stopping (``stopped``); with ``Retry-After: 1``
504    a catalog reload took longer than ``--catalog-timeout`` (``reload_timeout``; it is never applied)
====== =================================================================================================

**OpenAI API** (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and the LLM server's unknown
routes) keeps OpenAI's shape, which OpenAI clients parse::

    {"error": {"message": "...", "type": "invalid_request_error" | "server_error", "param": "top_p" | null,
               "code": "model_not_found" | ... | null}}

``type`` is ``invalid_request_error`` for every 4xx and ``server_error`` for every 5xx; ``param`` names the
field; ``code`` is the machine-readable kind (the house ``type``). Status: 400 for every invalid request (bad or
non-JSON body, a missing, mistyped or out-of-range parameter, a token id outside the vocabulary, prompt plus
``max_tokens`` over the context: ``context_length_exceeded``), 404 an unknown model (``model_not_found``) or
route, 405 wrong method, 401 no or a wrong API key (``invalid_api_key``), 413 ``body_too_large``, 429 queue full
(``overloaded``, ``Retry-After: 1``), 500 internal, 503 ``queue_timeout`` / ``stopped`` with ``Retry-After: 1``.

Both families: a client that disconnects before its answer has its request cancelled in the engine (its
resources freed) and is logged with status 499 in the metrics (nobody is left to read a body).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grserve.config import EdgeConfig
from grserve.engine.protocol import (
    EngineOverloaded,
    EngineStopped,
    RequestCancelled,
    RequestHandle,
    RequestTimedOut,
)
from grserve.server.metrics import Metrics

log = logging.getLogger("grserve.server")

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
MAX_LISTED_IDS = 20
CLIENT_CLOSED = 499  # nginx's "client closed request": the status the metrics record for a cancelled request

# pydantic error types that mean "a value of the right type, out of its allowed range": 400, not 422
VALUE_ERRORS = frozenset({
    "greater_than", "greater_than_equal", "less_than", "less_than_equal", "multiple_of", "finite_number",
    "too_short", "too_long", "string_too_short", "string_too_long", "literal_error", "enum", "value_error",
})
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


class ApiError(Exception):
    """A request error: HTTP status, message, the offending field path, and a machine-readable type."""

    def __init__(self, status: int, message: str, field: str | None = None, type: str = "invalid_value",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.type = type
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its answer; the request was cancelled in the engine."""


# ----------------------------------------------------------------------------------------------------------
# the two error shapes
# ----------------------------------------------------------------------------------------------------------
def house_error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message, "field": exc.field, "type": exc.type}},
                        status_code=exc.status, headers=exc.headers)


def openai_error(exc: ApiError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": exc.field, "code": exc.type}},
                        status_code=exc.status, headers=exc.headers)


# ----------------------------------------------------------------------------------------------------------
# validation-error translation
# ----------------------------------------------------------------------------------------------------------
def field_path(loc: Sequence[Any]) -> str | None:
    """("body", "history_sids", 3, 1) -> "history_sids[3][1]"; None for the body itself. Union-member tags
    that pydantic puts in a location ("list[int]", "str", "function-after[...]") are left out."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif str(p).isidentifier() and str(p) not in _UNION_TAGS:
            out += ("." if out else "") + str(p)
    return out or None


def _body_error(exc: RequestValidationError, err: dict) -> ApiError | None:
    """The errors about the body as a whole: not JSON, not JSON-typed, absent, not an object."""
    etype, loc = str(err.get("type")), tuple(err.get("loc", ()))
    if etype == "json_invalid":
        ctx = err.get("ctx") or {}
        pos = loc[1] if len(loc) > 1 else "?"
        return ApiError(400, f"request body is not valid JSON: {ctx.get('error', 'decode error')} at position "
                             f"{pos}", None, "invalid_json")
    if loc == ("body",) and isinstance(getattr(exc, "body", None), (bytes, bytearray)):
        return ApiError(415, "request body must be JSON (Content-Type: application/json)", None,
                        "unsupported_media_type")
    if loc == ("body",) and etype == "missing":
        return ApiError(422, "request body is required", None, etype)
    if loc == ("body",) and etype == "model_attributes_type":
        return ApiError(422, "request body must be a JSON object", None, etype)
    return None


def house_validation_error(exc: RequestValidationError, groups: Sequence[str] = ()) -> ApiError:
    """FastAPI/pydantic validation error → the house ApiError (400 a bad value, 415, 422 a schema violation).
    ``groups`` name the request's one-of field groups: ``<group>_missing`` / ``_ambiguous`` names the group."""
    errors = exc.errors()
    if not errors:
        return ApiError(422, "invalid request", None, "validation_error")
    err = errors[0]
    body = _body_error(exc, err)
    if body is not None:
        return body
    etype = str(err.get("type", "validation_error"))
    group, _, kind = etype.rpartition("_")
    if group in groups and kind in ("missing", "ambiguous"):
        return ApiError(422, str(err.get("msg")), group, etype)
    field = field_path(err.get("loc", ()))
    msg = str(err.get("msg", "invalid value"))
    if etype == "extra_forbidden":
        msg = f"unknown field {field!r}"
    elif field is not None:
        msg = f"{field}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return ApiError(400 if etype in VALUE_ERRORS else 422, msg, field, etype)


def openai_validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI/pydantic validation error → a 400 ApiError worded as OpenAI words it, ``param`` the field."""
    errors = exc.errors()
    err = errors[0] if errors else {"type": "validation_error", "loc": ()}
    body = _body_error(exc, err)
    if body is not None:
        return ApiError(400, body.message, None, body.type)
    param = field_path(err.get("loc", ()))
    if err.get("type") == "missing":
        msg = f"'{param}' is a required property"
    else:
        msg = f"invalid '{param}': {err.get('msg', 'invalid value')}"
    return ApiError(400, msg, param, str(err.get("type", "invalid_value")))


# ----------------------------------------------------------------------------------------------------------
# handlers, middleware, the app
# ----------------------------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI, render: Callable[[ApiError], JSONResponse],
                           translate: Callable[[RequestValidationError], ApiError]) -> None:
    """Answer every error of ``app`` through ``render`` (one API family's shape)."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return render(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return render(translate(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return render(ApiError(404, f"no route {request.url.path}", None, "not_found"))
        if exc.status_code == 405:
            return render(ApiError(405, f"method {request.method} not allowed on {request.url.path}", None,
                                   "method_not_allowed", getattr(exc, "headers", None)))
        return render(ApiError(exc.status_code, str(exc.detail), None, "http_error", getattr(exc, "headers", None)))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # last resort; routes catch their own
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return render(ApiError(500, f"internal error: {type(exc).__name__}", None, "internal"))


class MetricsMiddleware:
    """Pure-ASGI request counter and latency histogram, labelled by route *template* ("/v1/rank"); a path no
    route matches is labelled "unmatched", never verbatim (a bounded label set whatever clients send)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(name, status[0], time.perf_counter() - start)


OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key (load balancers, Prometheus)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def same_key(given: str, key: str) -> bool:
    """Constant-time comparison of a presented key with the configured one."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), key.encode("utf-8"))


def bearer_token(scope: dict) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class EdgeMiddleware:
    """Pure-ASGI gate in front of the routes: the API key (every path but ``OPEN_PATHS``), the admin routes (the
    admin key, off while it is unset), the request-body size limit, checked on the declared ``Content-Length``
    and again while the body streams in (never more than the limit is buffered), and — on the routes that queue
    work in the engine (``queued_routes``) — a full queue (``overloaded``), checked before the body is read, parsed
    or tokenized, so that a refusal under a burst costs almost nothing (the engine's own check at submit stays the
    authority). A refusal is answered here, in the app's error shape, labelled in the metrics by the route it
    targeted (``router``); an accepted body is replayed to the app, then ``receive`` passes through (so the app
    still sees a client disconnect)."""

    def __init__(self, app: Any, edge: EdgeConfig, render: Callable[[ApiError], JSONResponse],
                 admin_routes: frozenset[tuple[str, str]] = frozenset(), engine: Any = None,
                 queued_routes: frozenset[tuple[str, str]] = frozenset(), router: Any = None) -> None:
        self.app, self.edge, self.render, self.admin_routes = app, edge, render, admin_routes
        self.engine, self.queued_routes, self.router = engine, queued_routes, router
        self._routes: list[Any] | None = None

    def overloaded(self, scope: dict) -> ApiError | None:
        """429 when ``scope`` targets a queued route while the engine's queue is at its bound, else None."""
        if (scope["method"], scope["path"]) not in self.queued_routes:
            return None
        bound = getattr(self.engine, "max_waiting", None)
        depth = int(getattr(self.engine, "queue_depth", 0))
        return overloaded(f"{depth} requests waiting (max_waiting={bound})") \
            if bound is not None and depth >= bound else None

    def label(self, scope: dict) -> None:
        """Put the route whose path template ``scope``'s path matches into it (as routing would), for the metrics
        label of a refusal; nothing for a path no route has (labelled "unmatched")."""
        if self._routes is None:  # first request: every route is in place by now
            self._routes = list(_leaf_routes(getattr(self.router, "routes", ())))
        for route in self._routes:
            if route.path_regex.match(scope["path"]):
                scope["route"] = route
                return

    def refusal(self, scope: dict) -> ApiError | None:
        """Why the request may not proceed (401/403), or None."""
        key, admin_key = self.edge.api_key, self.edge.admin_api_key
        given = bearer_token(scope)
        if (scope["method"], scope["path"]) in self.admin_routes:
            if admin_key is None:
                return ApiError(403, "this route changes server state and is off: start the server with "
                                     "--admin-api-key to enable it", None, "admin_disabled")
            if given is not None and same_key(given, admin_key):
                return None
            if given is not None and key is not None and same_key(given, key):
                return ApiError(403, "this route needs the admin API key", None, "admin_key_required")
            return _unauthorized()
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        if given is not None and (same_key(given, key) or (admin_key is not None and same_key(given, admin_key))):
            return None
        return _unauthorized()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        limit = int(self.edge.max_body_bytes)
        declared = _content_length(scope)
        if refusal is None and declared is not None and declared > limit:
            refusal = _too_large(limit)
        if refusal is None:
            refusal = self.overloaded(scope)
        if refusal is not None:
            self.label(scope)
            await self.render(refusal)(scope, receive, send)
            return
        if scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nothing to answer, nothing to compute
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                self.label(scope)
                await self.render(_too_large(limit))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        full = self.overloaded(scope)  # again, now the body is in: the queue may have filled meanwhile
        if full is not None:
            self.label(scope)
            await self.render(full)(scope, receive, send)
            return
        body: list[dict] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)


def _leaf_routes(routes: Sequence[Any]) -> Any:
    """The routes with a path template, descending into included routers (FastAPI wraps an included router in
    one route object; the apps include theirs without a prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _leaf_routes(inner.routes)
        elif hasattr(route, "path_regex") and hasattr(route, "path"):
            yield route


def _unauthorized() -> ApiError:
    return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def overloaded(detail: str = "") -> ApiError:
    """429 ``overloaded`` with ``Retry-After``: the queue is full."""
    return ApiError(429, f"server overloaded: {detail}" if detail else "server overloaded, retry later", None,
                    "overloaded", {"Retry-After": "1"})


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes", None, "body_too_large")


def new_app(engine: Any, metrics: Metrics | None, *, title: str, description: str, openai: bool = False,
            groups: Sequence[str] = (), detail: Callable[[], dict] | None = None, edge: EdgeConfig | None = None,
            admin_routes: frozenset[tuple[str, str]] = frozenset(),
            queued_routes: frozenset[tuple[str, str]] = frozenset()) -> FastAPI:
    """A FastAPI app around ``engine`` with the shared parts installed: the error handlers of one API family
    (``openai``: OpenAI's shape; else the house shape, ``groups`` its one-of field groups), the edge middleware
    (``edge``; ``admin_routes``: the (method, path) pairs that change state; ``queued_routes``: those that queue
    work in the engine, refused at the edge while its queue is full), the metrics middleware (outermost:
    it counts the edge's refusals too), ``GET /health`` (``engine.health()`` plus ``detail()``) and
    ``GET /metrics``."""
    metrics = metrics if metrics is not None else Metrics()
    metrics.bind_queue_depth(lambda: engine.queue_depth)
    app = FastAPI(title=title, version="0.1.0", description=description)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.edge = edge = edge or EdgeConfig()
    render = openai_error if openai else house_error
    app.add_middleware(EdgeMiddleware, edge=edge, render=render, admin_routes=admin_routes, engine=engine,
                       queued_routes=queued_routes, router=app.router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if openai:
        install_error_handlers(app, openai_error, openai_validation_error)
    else:
        install_error_handlers(app, house_error, lambda exc: house_validation_error(exc, groups))

    @app.get("/health")
    async def health() -> JSONResponse:
        h = engine.health()
        body = {"status": h.status, "queue_depth": int(h.queue_depth), "running": int(h.running), **h.detail,
                **(detail() if detail is not None else {})}
        return JSONResponse(body, status_code=200 if h.status == "ok" else 503)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        payload, content_type = metrics.render()
        return Response(content=payload, media_type=content_type)

    return app


# ----------------------------------------------------------------------------------------------------------
# one request through the engine
# ----------------------------------------------------------------------------------------------------------
def submit(engine: Any, request: Any, invalid_field: str | None = None) -> RequestHandle:
    """``engine.submit``: a full queue is a 429, a stopping engine a 503, both with ``Retry-After``; a request the
    engine can never serve (``ValueError``, e.g. an LLM prompt that never fits the KV pool) a 400 naming
    ``invalid_field``."""
    try:
        return engine.submit(request)
    except EngineOverloaded as exc:
        raise overloaded(str(exc)) from None
    except EngineStopped as exc:
        raise _stopped(exc) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), invalid_field, "invalid_value") from None


def _stopped(exc: BaseException) -> ApiError:
    return ApiError(503, f"server is not taking requests: {exc}" if str(exc) else "server is stopping", None,
                    "stopped", {"Retry-After": "1"})


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is already read: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first(request: Request, engine: Any, handle: RequestHandle, work: Awaitable[Any]) -> Any:
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


async def finish(request: Request, engine: Any, handle: RequestHandle,
                 work: Awaitable[Any] | None = None) -> Any:
    """Await a submitted request's result (or ``work``, e.g. collecting its events): 503 when the engine stops
    before it is done, 500 (logged) when it fails, ``ClientDisconnected`` (request cancelled, resources freed)
    when the client leaves first."""
    try:
        return await _first(request, engine, handle, work if work is not None else handle.result())
    except (ApiError, ClientDisconnected):
        raise
    except RequestTimedOut as exc:
        raise ApiError(503, f"{exc}; it was dropped without being computed (server busy, retry later)", None,
                       "queue_timeout", {"Retry-After": "1"}) from None
    except (EngineStopped, RequestCancelled) as exc:
        raise _stopped(exc) from None
    except Exception as exc:  # noqa: BLE001 - every engine failure becomes a JSON answer
        status = getattr(exc, "http_status", None)  # an engine error that names its status (cluster: RequestLost)
        if status is not None:
            raise ApiError(status, str(exc), None, getattr(exc, "error_type", "unavailable")) from None
        log.exception("engine failed on request %s", handle.request_id)
        raise ApiError(500, f"internal error while serving the request: {type(exc).__name__}", None,
                       "internal") from exc


# ----------------------------------------------------------------------------------------------------------
# validators shared by the retrieval and ranking routes
# ----------------------------------------------------------------------------------------------------------
def _clip_int64(values: Any) -> Any:
    if isinstance(values, list):
        return [_clip_int64(v) for v in values]
    return min(max(values, INT64_MIN), INT64_MAX)


def int64_in_range(values: list, lo: int, hi: Any) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """Python ints (a list, or a rectangular list of lists) → (int64 array, None), or (array, index of the first
    value outside [lo, hi)). ``hi`` may be per column. Ints beyond int64 count as out of range, never wrap."""
    try:
        arr = np.asarray(values, dtype=np.int64)
    except OverflowError:  # only on this rare path: a Python pass that saturates them
        arr = np.asarray(_clip_int64(values), dtype=np.int64)
    bad = (arr < lo) | (arr >= hi)
    if not bad.any():
        return arr, None
    return arr, tuple(int(x) for x in np.argwhere(bad)[0])


def token_ids(values: list[int], vocab_size: int, field: str) -> np.ndarray:
    """Token ids → int64 array; 400 ``out_of_range`` naming ``field[i]`` for the first one outside the vocab."""
    arr, bad = int64_in_range(values, 0, vocab_size)
    if bad is not None:
        i = bad[0]
        raise ApiError(400, f"{field}[{i}]: token {values[i]} is out of range [0, {vocab_size})", f"{field}[{i}]",
                       "out_of_range")
    return arr


def check_length(n: int, limit: int, field: str, what: str, type: str) -> None:
    """413 ``type`` when ``what`` has more than ``limit`` tokens."""
    if n > limit:
        raise ApiError(413, f"{field}: {what} has {n} tokens, more than the limit of {limit}", field, type)


def unknown_ids(field: str, values: Sequence[int], positions: Sequence[int], what: str, type: str) -> ApiError:
    """404 listing the distinct unknown ids (at most ``MAX_LISTED_IDS``); ``field`` names the first position."""
    if not positions:  # a batch lookup failed but no single id does: report the list
        return ApiError(404, f"{field}: unknown {what}s", field, type)
    ids = list(dict.fromkeys(values[k] for k in positions))
    shown = ", ".join(str(v) for v in ids[:MAX_LISTED_IDS]) + (", ..." if len(ids) > MAX_LISTED_IDS else "")
    first = positions[0]
    return ApiError(404, f"{field}: {len(ids)} unknown {what}{'s' if len(ids) != 1 else ''}: [{shown}] "
                         f"(first at {field}[{first}])", f"{field}[{first}]", type)


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
                shutdown_timeout_s: float) -> None:
    """Serve ``app`` with uvicorn until SIGTERM/Ctrl-C, shutting down as ``draining_server`` says."""
    import uvicorn

    draining_server(app, uvicorn.Config(app, host=host, port=port, log_level=log_level), stop,
                    shutdown_timeout_s).run()


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
