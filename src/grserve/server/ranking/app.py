"""The BAT ranking app: the ranking routes (``ranking_routes.py``) on the shared app (``app.py``) (house errors,
metrics, ``/health`` with the prefix policy and registry sizes, ``/metrics``)."""

from __future__ import annotations

from fastapi import FastAPI

from grserve.config import EdgeConfig, RankingLimits
from grserve.engine.protocol import RankingService
from grserve.server.http.app import new_app
from grserve.server.http.metrics import Metrics
from grserve.server.ranking.routes import ADMIN_ROUTES, build_router
from grserve.state.store import StateStore


def create_ranking_app(engine: RankingService, limits: RankingLimits | None = None, metrics: Metrics | None = None,
                       edge: EdgeConfig | None = None, store: StateStore | None = None) -> FastAPI:
    """The ranking app around a started (or to-be-started) ranking engine or cluster front end (the
    ``RankingService`` protocol); the caller owns start/stop. ``store``: where registrations are kept (memory only
    without one)."""
    runner = engine.runner
    app = new_app(engine, metrics, title="grserve ranking",
                  description="GR ranking with Bipartite Attention (BAT): user + candidates in, ranked candidates out.",
                  groups=("user", "candidates"),
                  detail=lambda: {"policy": runner.policy.name, "users": runner.registry.num_users,
                                  "items": runner.registry.num_items, "vocab_size": runner.registry.vocab_size},
                  edge=edge, admin_routes=ADMIN_ROUTES, queued_routes=frozenset({("POST", "/v1/rank")}))
    engine.on_batch = app.state.metrics.on_batch
    app.state.metrics.bind_gr_stats(engine.stats, lambda: runner.stats.summary())
    app.include_router(build_router(engine, limits or RankingLimits(), store))
    return app
