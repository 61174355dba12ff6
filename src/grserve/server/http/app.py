"""The app every server starts from: ``new_app`` builds a FastAPI app around an engine (the ``Engine`` protocol of
``grserve.engine.protocol``) with what the three servers share and nothing mode-specific: the error handlers of
its API family (``errors.py``), the edge middleware (``edge.py``: API key, admin routes, body limit, full queue),
the metrics middleware (outermost, pure ASGI: it sees every final status, the edge's refusals and a client
disconnect included), ``GET /health`` (``engine.health()`` plus the app's detail; 503 unless ``ok``) and
``GET /metrics``. The mode's routes are then added by its app module."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from grserve.config import EdgeConfig
from grserve.engine.protocol import Engine
from grserve.server.http.admission import Admission
from grserve.server.http.bodies import MAX_BRACKETS, Precheck, body_route
from grserve.server.http.edge import EdgeMiddleware
from grserve.server.http.errors import house_error, house_validation_error, install_error_handlers, openai_error, \
    openai_validation_error
from grserve.server.http.metrics import Metrics, MetricsMiddleware


def new_app(engine: Engine, metrics: Metrics | None, *, title: str, description: str, openai: bool = False,
            groups: Sequence[str] = (), detail: Callable[[], dict] | None = None, edge: EdgeConfig | None = None,
            admin_routes: frozenset[tuple[str, str]] = frozenset(),
            queued_routes: frozenset[tuple[str, str]] = frozenset(),
            prechecks: Mapping[str, Precheck] | None = None, max_brackets: int = MAX_BRACKETS,
            openai_paths: frozenset[str] = frozenset()) -> FastAPI:
    """A FastAPI app around ``engine`` with the shared parts installed: the error handlers of one API family
    (``openai``: OpenAI's shape; else the house shape, ``groups`` its one-of field groups), the edge middleware
    (``edge``; ``admin_routes``: the (method, path) pairs that change state; ``queued_routes``: those that queue
    work, counted by admission from the edge on and refused there past ``max_waiting``), the metrics middleware
    (outermost: it counts the edge's refusals too), ``GET /health`` (``engine.health()`` plus ``detail()``),
    ``GET /metrics``, and the route class of the routes added to the app itself (``bodies.py``: bodies parsed
    and validated off the event loop, ``prechecks`` first, by path; at most ``max_brackets`` containers).
    ``openai_paths``: paths of a house app answered in OpenAI's error shape (the retrieval server's OpenAI beam
    routes)."""
    metrics = metrics if metrics is not None else Metrics()
    metrics.bind_queue_depth(lambda: engine.queue_depth)
    admission = Admission(engine)
    metrics.bind_pending(lambda: admission.pending)
    app = FastAPI(title=title, version="0.1.0", description=description)
    app.router.route_class = body_route(prechecks, max_brackets)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.edge = edge = edge or EdgeConfig()
    render = openai_error if openai else house_error
    app.add_middleware(EdgeMiddleware, edge=edge, render=render, admin_routes=admin_routes, admission=admission,
                       queued_routes=queued_routes, router=app.router, openai_paths=openai_paths)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    if openai:
        install_error_handlers(app, openai_error, openai_validation_error)
    else:
        install_error_handlers(app, house_error, lambda exc: house_validation_error(exc, groups), openai_paths)

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
