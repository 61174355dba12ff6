"""The app every server starts from: ``new_app`` builds a FastAPI app around an engine (the ``Engine`` protocol of
``grserve.engine.protocol``) and the app's route table (``routes.py``) with what the three servers share and nothing
mode-specific: the error handlers (``errors.py``: each route's shape), the edge middleware (``edge.py``: API key,
admin routes, body limit, full queue), the metrics middleware (outermost, pure ASGI: it sees every final status,
the edge's refusals and a client disconnect included), the route class of the app's routes (``bodies.py``: bodies
prechecked, parsed and validated off the event loop), ``GET /health`` (``engine.health()`` plus the app's detail;
503 unless ``ok``) and ``GET /metrics``. The mode's routes are then added by its app module."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from grserve.config import EdgeConfig
from grserve.engine.protocol import Engine
from grserve.server.http.bodies import body_route
from grserve.server.http.edge import Admission, EdgeMiddleware
from grserve.server.http.errors import install_error_handlers
from grserve.server.http.metrics import Metrics, MetricsMiddleware
from grserve.server.http.routes import Route, RouteTable


def new_app(engine: Engine, metrics: Metrics | None, table: RouteTable, *, title: str, description: str,
            detail: Callable[[], dict] | None = None, edge: EdgeConfig | None = None) -> FastAPI:
    """A FastAPI app around ``engine`` with the shared parts installed, each reading ``table`` (the mode's routes
    and their policy; the rows of ``/health`` and ``/metrics`` are added here): the error handlers, the edge
    middleware (``edge``), the metrics middleware (outermost: it counts the edge's refusals too), the body route
    class, ``GET /health`` (``engine.health()`` plus ``detail()``) and ``GET /metrics``."""
    metrics = metrics if metrics is not None else Metrics()
    metrics.bind_queue_depth(lambda: engine.queue_depth)
    admission = Admission(engine)
    metrics.bind_pending(lambda: admission.pending)
    table.add(Route("GET", "/health", openai=table.openai), Route("GET", "/metrics", openai=table.openai))
    app = FastAPI(title=title, version="0.1.0", description=description)
    app.router.route_class = body_route(table)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.routes = table
    app.state.edge = edge = edge or EdgeConfig()
    app.add_middleware(EdgeMiddleware, edge=edge, table=table, admission=admission, router=app.router)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    install_error_handlers(app, table)

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
