"""The BAT ranking HTTP app (POST /v1/rank, /v1/users, /v1/items, /health, /metrics) around a ranking engine."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response

from grserve.server.app import _MetricsMiddleware, install_error_handlers
from grserve.server.metrics import Metrics
from grserve.server.ranking_routes import RankingLimits, build_router


def create_ranking_app(engine: Any, limits: RankingLimits | None = None, metrics: Metrics | None = None) -> FastAPI:
    metrics = metrics if metrics is not None else Metrics()
    metrics.bind_queue_depth(lambda: engine.queue_depth)
    engine.on_batch = metrics.on_batch
    app = FastAPI(title="grserve ranking", version="0.1.0",
                  description="GR ranking with Bipartite Attention (BAT): user + candidates in, ranked candidates out.")
    app.state.engine = engine
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    install_error_handlers(app, groups=("user", "candidates"))
    app.include_router(build_router(engine, limits))

    @app.get("/health")
    async def health() -> Any:
        r = engine.runner
        return {"status": "ok", "policy": r.policy.name, "users": r.registry.num_users,
                "items": r.registry.num_items, "queue_depth": engine.queue_depth,
                "vocab_size": r.registry.vocab_size}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        payload, content_type = metrics.render()
        return Response(content=payload, media_type=content_type)

    return app
