"""The BAT ranking app: ``POST /v1/rank``, ``POST /v1/users``, ``POST /v1/items``, ``GET /v1/ranking/stats`` on the
shared app (``server/http/app.py``: house errors, metrics, ``/health`` with the prefix policy and registry sizes,
``/metrics``); each route's policy is its row of ``routes()``, what a request means is ``inputs/ranking.py``.

``POST /v1/rank`` takes a user (``user_id`` of a registered user, or raw ``user_tokens``) and candidates
(registered ``candidates`` item ids, or raw ``candidate_tokens`` lists whose last token is the identifier token)
and returns the candidates ranked by the softmax over their identifier-token logits (``score``, relative to the
request's candidates), each with its identifier token's log-probability over the whole vocabulary (``logprob``,
comparable across requests; ``ranking/scoring.py``). Raw users/items are never cached. Errors: the house convention
(``server/http/errors.py``) — 404 ``unknown_user`` / ``unknown_items``; 400
``duplicate_candidates``, ``identifier_collision`` (raw candidates sharing an identifier token), ``empty_*``,
``out_of_range`` tokens; 413 ``too_many_candidates``, ``profile_too_long``, ``item_too_long``; 422 exactly-one-of
violations; 429 ``overloaded``. ``POST /v1/users`` and ``/v1/items`` change state: they need the admin key
(``EdgeConfig.admin_api_key``; off while it is unset) and refuse, all or nothing, with 409 a registration past
``--max-users`` / ``--max-items`` (``too_many_users`` / ``too_many_items``) or an item whose identifier token is
another item's (``identifier_collision``: both would always score the same). They run one at a time; with a state
store (``--state-dir``) each is committed there before it is applied and answered (500 ``state_write_failed``:
nothing was registered).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute

from grserve.config import EdgeConfig, RankingLimits
from grserve.engine.protocol import RankingService
from grserve.inputs.house_schemas import ItemsRequest, RankedItem, RankResponse, RankRequest, RegisterResponse, Timing, \
    UsersRequest
from grserve.inputs.ranking import check_identifiers, check_registration, check_tokens, items_precheck, rank_precheck, \
    rank_request, users_precheck
from grserve.inputs.refusal import ApiError
from grserve.ranking.registry import RegistryError
from grserve.server.http.app import new_app
from grserve.server.http.lifecycle import finish, submit
from grserve.server.http.metrics import Metrics
from grserve.server.http.routes import Route, RouteTable, documented
from grserve.state.store import StateError, StateStore

MAX_CONTAINERS = 1 << 15  # JSON arrays + objects of a body: 256 candidates, or 16k registrations a call


def routes(limits: RankingLimits) -> RouteTable:
    """The ranking app's route table (house error shape; registrations are admin routes)."""
    return RouteTable([
        Route("POST", "/v1/rank", queued=True, precheck=rank_precheck(limits)),
        Route("POST", "/v1/users", admin=True, precheck=users_precheck(limits)),
        Route("POST", "/v1/items", admin=True, precheck=items_precheck(limits)),
        Route("GET", "/v1/ranking/stats"),
    ], groups=("user", "candidates"), max_brackets=max(MAX_CONTAINERS, limits.max_candidates + 64))


def create_ranking_app(engine: RankingService, limits: RankingLimits | None = None, metrics: Metrics | None = None,
                       edge: EdgeConfig | None = None, store: StateStore | None = None) -> FastAPI:
    """The ranking app around a started (or to-be-started) ranking engine or cluster front end (the
    ``RankingService`` protocol); the caller owns start/stop. ``store``: where registrations are kept (memory only
    without one)."""
    runner = engine.runner
    limits = limits or RankingLimits()
    app = new_app(engine, metrics, routes(limits), title="grserve ranking",
                  description="GR ranking with Bipartite Attention (BAT): user + candidates in, ranked candidates out.",
                  detail=lambda: {"policy": runner.policy.name, "users": runner.registry.num_users,
                                  "items": runner.registry.num_items, "vocab_size": runner.registry.vocab_size},
                  edge=edge)
    engine.on_batch = app.state.metrics.on_batch
    app.state.metrics.bind_gr_stats(engine.stats, lambda: runner.stats.summary())
    app.include_router(build_router(engine, limits, store, app.router.route_class))
    return app


async def _durable(store: StateStore | None, kind: str, entries: list) -> None:
    """Commit a registration to the state store (off the event loop) before it is applied; without a store, nothing."""
    if store is None:
        return
    try:
        await run_in_threadpool(store.put_registry, kind, [(getattr(e, f"{kind}_id"), e.tokens) for e in entries])
    except StateError as exc:
        logging.getLogger("grserve.server").error("%s", exc)
        raise ApiError(500, f"{kind}s: the registration could not be stored; nothing was registered", None,
                       "state_write_failed") from None


def build_router(engine: RankingService, limits: RankingLimits, store: StateStore | None = None,
                 route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """Routes around a ranking engine (``engine.registry``, ``engine.runner``); ``store``: ``--state-dir``'s;
    ``route_class``: the app's (``bodies.body_route``)."""
    router = APIRouter(route_class=route_class)
    writes = asyncio.Lock()  # registrations one at a time: checked, stored and applied against the same registry

    @router.post("/v1/rank", response_model=RankResponse, responses=documented(400, 401, 404, 413, 415, 422, 429, 500, 503))
    async def rank(body: RankRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        req = rank_request(body, engine.registry, limits)
        res = await finish(request, engine, submit(engine, req))
        ranked = [RankedItem(index=k, item_id=req.item_ids[k], score=s, logprob=lp)  # type: ignore[index]
                  for k, s, lp in zip(res.order, res.scores, res.logprobs)]
        return RankResponse(
            request_id=body.request_id or res.request_id, items=ranked, layout=res.layout, total_tokens=res.total_tokens,
            computed_tokens=res.computed_tokens, cached_tokens=res.cached_tokens, user_cache_hit=res.user_cache_hit,
            batch_size=res.batch_size,
            timing=Timing(queue_ms=res.queue_ms, compute_ms=res.compute_ms, total_ms=(time.perf_counter() - t0) * 1e3))

    @router.post("/v1/users", response_model=RegisterResponse, responses=documented(400, 401, 403, 409, 413, 415, 422, 500))
    async def register_users(body: UsersRequest) -> Any:
        """Admin: register or replace users (all or nothing)."""
        reg = engine.registry
        async with writes:
            check_tokens(body.users, limits.max_profile_tokens, reg.vocab_size, "users", "user", "profile_too_long")
            check_registration([u.user_id for u in body.users], reg, reg.has_user, limits.max_users, "users", "user")
            await _durable(store, "user", body.users)
            replaced = sum(reg.add_user(u.user_id, u.tokens) for u in body.users)
            return RegisterResponse(registered=len(body.users), replaced=replaced, total=reg.num_users)

    @router.post("/v1/items", response_model=RegisterResponse, responses=documented(400, 401, 403, 409, 413, 415, 422, 500))
    async def register_items(body: ItemsRequest) -> Any:
        """Admin: register or replace items (all or nothing); their KV is precomputed."""
        reg = engine.registry
        async with writes:
            check_tokens(body.items, limits.max_item_tokens, reg.vocab_size, "items", "item", "item_too_long")
            check_registration([i.item_id for i in body.items], reg, reg.has_item, limits.max_items, "items", "item")
            check_identifiers(body.items, reg)
            await _durable(store, "item", body.items)
            new, replaced = [], 0
            for it in body.items:
                try:
                    known = reg.has_item(it.item_id)
                    replaced += reg.add_item(it.item_id, it.tokens)  # a change re-precomputes that item's KV
                except RegistryError as e:  # pragma: no cover - validated above
                    raise ApiError(400, str(e), "items", "invalid_item") from None
                if not known:
                    new.append(it.item_id)
            if new:
                await run_in_threadpool(engine.runner.add_items, new)  # precompute their KV (item-as-prefix)
            return RegisterResponse(registered=len(body.items), replaced=replaced, total=reg.num_items)

    @router.get("/v1/ranking/stats")
    async def stats() -> Any:
        return {"policy": engine.runner.policy.name, **engine.runner.stats.summary()}

    return router
