"""The edge: a pure-ASGI gate in front of every route of the three apps, before routing and before the body is
read or parsed (``EdgeConfig``, docs/security.md): the API key (every path but ``OPEN_PATHS``), the admin routes
(the admin key; off while it is unset), the request-body size limit, and admission on the routes that queue work
(``Admission``, below). Which routes want the admin key and which queue is the app's route table (``routes.py``). A
refusal costs no parsing; it is answered in the route's error shape and labelled in the metrics by the route it
targeted.

Admission on the routes that queue work: a request accepted at the edge counts against ``--max-waiting`` from
that moment — while its body arrives, is parsed, validated, tokenized — until the engine's queue takes it
(``hand_over``, which ``lifecycle.finish`` calls) or its answer ends. So a burst past capacity is refused at the
edge, before its bodies are read (429 ``overloaded`` with ``Retry-After``), instead of piling up in front of an
engine queue that looks short (the issue: 500 concurrent LLM requests, ``--max-waiting 64``, never a 429, 40 s at the
median). The engine's own check at submit stays the authority for its queue.

Only the event loop touches the count (the edge and the routes run there): no lock.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse

from grserve.config import EdgeConfig
from grserve.engine.protocol import Engine
from grserve.inputs.refusal import ApiError, body_too_large, overloaded, unauthorized
from grserve.server.http.errors import house_error, openai_error
from grserve.server.http.routes import RouteTable

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key (load balancers, Prometheus)
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
TICKET = "grserve.admission"  # the scope key of an admitted request's place


class Admission:
    """Requests admitted at the edge and not yet in the engine's queue (``pending``), bounded together with the
    engine's queue by its ``max_waiting``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending = 0

    def refusal(self, holding: bool = False) -> ApiError | None:
        """429 when the engine's queue and the pending requests fill ``max_waiting`` (``holding``: the asking
        request is admitted already and does not count against itself), else None."""
        bound = getattr(self.engine, "max_waiting", None)  # the engine's queue bound (absent or None: none)
        if bound is None:
            return None
        depth, pending = int(self.engine.queue_depth), self.pending - int(holding)
        if depth + pending < bound:
            return None
        return overloaded(f"{depth} requests waiting and {pending} being read or tokenized (max_waiting={bound})")

    def admit(self, scope: dict) -> None:
        self.pending += 1
        scope[TICKET] = self


def hand_over(scope: dict) -> None:
    """The request is in the engine's queue now, or its answer has ended: it no longer counts as pending (a second
    call does nothing)."""
    admission = scope.pop(TICKET, None)
    if admission is not None:
        admission.pending -= 1


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
    work (``queued`` in the route table: in the engine, or in the heavy-work pool) — admission: the engine's
    queue and the requests admitted before it, checked before the body is read, parsed or tokenized, so that a
    refusal under a burst costs almost nothing. A refusal is answered here, in the app's error shape, labelled in the
    metrics by the route it targeted (``router``); an accepted body is replayed to the app, then ``receive`` passes
    through (so the app still sees a client disconnect)."""

    def __init__(self, app: Any, edge: EdgeConfig, render: Callable[[ApiError], JSONResponse] | None = None,
                 table: RouteTable | None = None, admission: Admission | None = None, router: Any = None) -> None:
        """``table``: the app's route table (admin and queued routes, each route's error shape); ``render``: one
        error shape for every path instead (a middleware in front of an app without a table)."""
        self.app, self.edge, self._render, self.admission, self.router = app, edge, render, admission, router
        self.table = table if table is not None else RouteTable(())
        self._routes: list[Any] | None = None

    def render(self, exc: ApiError, scope: dict) -> JSONResponse:
        if self._render is not None:
            return self._render(exc)
        return (openai_error if self.table.openai_shape(scope["path"]) else house_error)(exc)

    def queued(self, scope: dict) -> bool:
        return self.admission is not None and self.table.queued(scope["method"], scope["path"])

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
        if self.table.admin(scope["method"], scope["path"]):
            if admin_key is None:
                return ApiError(403, "this route changes server state and is off: start the server with "
                                     "--admin-api-key to enable it", None, "admin_disabled")
            if given is not None and same_key(given, admin_key):
                return None
            if given is not None and key is not None and same_key(given, key):
                return ApiError(403, "this route needs the admin API key", None, "admin_key_required")
            return unauthorized()
        if key is None or scope["path"] in OPEN_PATHS:
            return None
        if given is not None and (same_key(given, key) or (admin_key is not None and same_key(given, admin_key))):
            return None
        return unauthorized()

    def gate(self, scope: dict) -> ApiError | None:
        """The refusals answered before a byte of the body is read: key, declared size, admission."""
        refusal = self.refusal(scope)
        limit = int(self.edge.max_body_bytes)
        declared = _content_length(scope)
        if refusal is None and declared is not None and declared > limit:
            refusal = body_too_large(limit)
        if refusal is None and self.queued(scope):
            refusal = self.admission.refusal()  # type: ignore[union-attr]
        return refusal

    async def refuse(self, refusal: ApiError, scope: dict, receive: Any, send: Any) -> None:
        self.label(scope)
        await self.render(refusal, scope)(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.gate(scope)
        if refusal is not None:
            await self.refuse(refusal, scope, receive, send)
            return
        if self.queued(scope):
            self.admission.admit(scope)  # type: ignore[union-attr]
        try:
            if scope["method"] in _BODY_METHODS:
                await self.with_body(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            hand_over(scope)

    async def with_body(self, scope: dict, receive: Any, send: Any) -> None:
        """Read the whole body (at most the limit), check admission again, then replay it to the app."""
        limit = int(self.edge.max_body_bytes)
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left while sending: nothing to answer, nothing to compute
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await self.refuse(body_too_large(limit), scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        full = self.admission.refusal(holding=True) if self.queued(scope) else None  # the queue may have filled
        if full is not None:
            await self.refuse(full, scope, receive, send)
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

