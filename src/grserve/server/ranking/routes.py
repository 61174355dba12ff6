"""HTTP routes of BAT ranking: ``POST /v1/rank``, ``POST /v1/users``, ``POST /v1/items``, ``GET /v1/ranking/stats``.

``POST /v1/rank`` takes a user (``user_id`` of a registered user, or raw ``user_tokens``) and candidates
(registered ``candidates`` item ids, or raw ``candidate_tokens`` lists whose last token is the identifier token)
and returns the candidates ranked by the softmax over their identifier-token logits (``score``, relative to the
request's candidates), each with its identifier token's log-probability over the whole vocabulary (``logprob``,
comparable across requests; ``ranking/scoring.py``). Raw users/items are never cached. Errors: the house convention (``server/http/errors.py``) — 404 ``unknown_user`` / ``unknown_items``; 400
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

import numpy as np
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool

from grserve.config import RankingLimits
from grserve.engine.protocol import RankingService
from grserve.engine.types import RankingRequest
from grserve.ranking.registry import RegistryError
from grserve.server.http.bodies import Precheck, body_route
from grserve.server.http.errors import ApiError
from grserve.state.store import StateError, StateStore
from grserve.server.http.lifecycle import finish, submit
from grserve.inputs.refusal import check_length, token_ids, unknown_ids
from grserve.inputs.house_schemas import (
    ItemsRequest,
    RankedItem,
    RankRequest,
    RankResponse,
    RegisterResponse,
    Timing,
    UsersRequest,
)

_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 404, 413, 415, 422, 429, 500, 503)}
_ADMIN_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 403, 409, 413, 415, 422, 500)}
ADMIN_ROUTES = frozenset({("POST", "/v1/users"), ("POST", "/v1/items")})
MAX_CONTAINERS = 1 << 15  # JSON arrays + objects of a body: 256 candidates, or 16k registrations a call


def _user(body: RankRequest, reg: Any, limits: RankingLimits) -> np.ndarray:
    """The request's user profile as tokens: a registered user's, or raw ``user_tokens`` (checked)."""
    if body.user_id is not None:
        if not reg.has_user(body.user_id):
            raise ApiError(404, f"user_id: unknown user {body.user_id}", "user_id", "unknown_user")
        user = reg.user_tokens(body.user_id)
        check_length(len(user), limits.max_profile_tokens, "user_id", f"the profile of user {body.user_id}",
                     "profile_too_long")
        return user
    if not body.user_tokens:
        raise ApiError(400, "user_tokens: the profile must not be empty", "user_tokens", "empty_profile")
    check_length(len(body.user_tokens), limits.max_profile_tokens, "user_tokens", "the profile", "profile_too_long")
    return token_ids(body.user_tokens, reg.vocab_size, "user_tokens")


def _registered_items(cands: list[int], reg: Any) -> list[np.ndarray]:
    """Registered candidates' tokens: 404 listing unknown ids, 400 for a candidate listed twice."""
    unknown = [k for k, i in enumerate(cands) if not reg.has_item(i)]
    if unknown:
        raise unknown_ids("candidates", cands, unknown, "item id", "unknown_items")
    seen: dict[int, int] = {}
    for k, i in enumerate(cands):
        if i in seen:
            raise ApiError(400, f"candidates[{k}]: item {i} is listed twice (first at candidates[{seen[i]}])",
                           f"candidates[{k}]", "duplicate_candidates")
        seen[i] = k
    return [reg.item_tokens(i) for i in cands]


def _raw_items(cands: list[list[int]], vocab: int, limits: RankingLimits) -> list[np.ndarray]:
    items: list[np.ndarray] = []
    seen: dict[int, int] = {}  # identifier token -> candidate index
    for k, toks in enumerate(cands):
        if not toks:
            raise ApiError(400, f"candidate_tokens[{k}]: an item needs at least its identifier token",
                           f"candidate_tokens[{k}]", "empty_item")
        check_length(len(toks), limits.max_item_tokens, f"candidate_tokens[{k}]", "the item", "item_too_long")
        items.append(token_ids(toks, vocab, f"candidate_tokens[{k}]"))
        ident = int(toks[-1])
        if ident in seen:
            raise ApiError(400, f"candidate_tokens[{k}]: identifier token {ident} is also the identifier of "
                                f"candidate_tokens[{seen[ident]}] (they would always score the same)",
                           f"candidate_tokens[{k}]", "identifier_collision")
        seen[ident] = k
    return items


def _check_candidates(n: int, field: str, limits: RankingLimits) -> None:
    if n > limits.max_candidates:
        raise ApiError(413, f"{field}: {n} candidates, more than the limit of {limits.max_candidates}", field,
                       "too_many_candidates")


def rank_request(body: RankRequest, reg: Any, limits: RankingLimits) -> RankingRequest:
    """A validated ``RankingRequest`` from the wire body (every check above, in the order a reader expects)."""
    user = _user(body, reg, limits)
    field = "candidates" if body.candidates is not None else "candidate_tokens"
    cands: list = body.candidates if body.candidates is not None else body.candidate_tokens  # type: ignore[assignment]
    if not cands:
        raise ApiError(400, f"{field}: at least one candidate is required", field, "empty_candidates")
    _check_candidates(len(cands), field, limits)
    if body.candidates is not None:
        items, item_ids = _registered_items(cands, reg), list(cands)
    else:
        items = _raw_items(cands, reg.vocab_size, limits)
        item_ids = [None] * len(items)
    top_k = min(body.top_k, len(items), limits.max_top_k)
    # the engine's key is the server's own; a client's request_id is only echoed (no client can cancel another's)
    return RankingRequest(user, items, user_id=body.user_id, item_ids=item_ids, top_k=top_k)


def _check_tokens(entries: list, limit: int, vocab: int, field: str, what: str, etype: str) -> None:
    for k, e in enumerate(entries):
        check_length(len(e.tokens), limit, f"{field}[{k}].tokens", f"{what} {getattr(e, what + '_id')}", etype)
        token_ids(e.tokens, vocab, f"{field}[{k}].tokens")


def _check_registration(ids: list[int], reg: Any, known: Any, limit: int, field: str, what: str) -> None:
    """409 ``too_many_<what>s`` when registering the new ids of ``ids`` would pass ``limit``."""
    new = {i for i in ids if not known(i)}
    total = reg.num_users if what == "user" else reg.num_items
    if total + len(new) > limit:
        raise ApiError(409, f"{field}: {len(new)} new {what}s would make {total + len(new)}, more than the limit of "
                            f"{limit} (--max-{what}s)", field, f"too_many_{what}s")


def _check_identifiers(items: list, reg: Any) -> None:
    """409 ``identifier_collision`` for an item whose identifier token is another item's (registered, or earlier
    in this request)."""
    batch: dict[int, tuple[int, int]] = {}  # identifier -> (item id, index)
    for k, it in enumerate(items):
        ident = int(it.tokens[-1])
        owner = reg.item_with_identifier(ident)
        earlier = batch.get(ident)
        if earlier is not None and earlier[0] != it.item_id:
            owner, where = earlier[0], f" (items[{earlier[1]}])"
        else:
            where = ""
        if owner is not None and owner != it.item_id:
            raise ApiError(409, f"items[{k}].tokens: identifier token {ident} of item {it.item_id} is already the "
                                f"identifier of item {owner}{where}; identifiers must be unique (both would always "
                                f"score the same)", f"items[{k}].tokens", "identifier_collision")
        batch[ident] = (it.item_id, k)


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


def _lengths(entries: Any, limit: int, field: str, what: str, etype: str) -> None:
    """Each ``entries[k].tokens`` (raw JSON) at most ``limit`` long (as ``_check_tokens`` says it)."""
    for k, e in enumerate(entries if isinstance(entries, list) else ()):
        tokens = e.get("tokens") if isinstance(e, dict) else None
        if isinstance(tokens, list):
            check_length(len(tokens), limit, f"{field}[{k}].tokens", f"{what} {e.get(what + '_id')}", etype)


def prechecks(limits: RankingLimits) -> dict[str, Precheck]:
    """The cheap length checks of the ranking routes on their raw JSON (``bodies.py``: before validation)."""

    def rank(raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        if isinstance(raw.get("user_tokens"), list):
            check_length(len(raw["user_tokens"]), limits.max_profile_tokens, "user_tokens", "the profile",
                         "profile_too_long")
        for field in ("candidates", "candidate_tokens"):
            if isinstance(raw.get(field), list):
                _check_candidates(len(raw[field]), field, limits)
        cands = raw.get("candidate_tokens")
        for k, toks in enumerate(cands if isinstance(cands, list) else ()):
            if isinstance(toks, list):
                check_length(len(toks), limits.max_item_tokens, f"candidate_tokens[{k}]", "the item",
                             "item_too_long")

    def users(raw: Any) -> None:
        if isinstance(raw, dict):
            _lengths(raw.get("users"), limits.max_profile_tokens, "users", "user", "profile_too_long")

    def items(raw: Any) -> None:
        if isinstance(raw, dict):
            _lengths(raw.get("items"), limits.max_item_tokens, "items", "item", "item_too_long")

    return {"/v1/rank": rank, "/v1/users": users, "/v1/items": items}


def build_router(engine: RankingService, limits: RankingLimits, store: StateStore | None = None) -> APIRouter:
    """Routes around a ranking engine (``engine.registry``, ``engine.runner``); ``store``: ``--state-dir``'s."""
    containers = max(MAX_CONTAINERS, limits.max_candidates + 64)
    router = APIRouter(route_class=body_route(prechecks(limits), containers))
    writes = asyncio.Lock()  # registrations one at a time: checked, stored and applied against the same registry

    @router.post("/v1/rank", response_model=RankResponse, responses=_ERRORS)
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

    @router.post("/v1/users", response_model=RegisterResponse, responses=_ADMIN_ERRORS)
    async def register_users(body: UsersRequest) -> Any:
        """Admin: register or replace users (all or nothing)."""
        reg = engine.registry
        async with writes:
            _check_tokens(body.users, limits.max_profile_tokens, reg.vocab_size, "users", "user", "profile_too_long")
            _check_registration([u.user_id for u in body.users], reg, reg.has_user, limits.max_users, "users", "user")
            await _durable(store, "user", body.users)
            replaced = sum(reg.add_user(u.user_id, u.tokens) for u in body.users)
            return RegisterResponse(registered=len(body.users), replaced=replaced, total=reg.num_users)

    @router.post("/v1/items", response_model=RegisterResponse, responses=_ADMIN_ERRORS)
    async def register_items(body: ItemsRequest) -> Any:
        """Admin: register or replace items (all or nothing); their KV is precomputed."""
        reg = engine.registry
        async with writes:
            _check_tokens(body.items, limits.max_item_tokens, reg.vocab_size, "items", "item", "item_too_long")
            _check_registration([i.item_id for i in body.items], reg, reg.has_item, limits.max_items, "items", "item")
            _check_identifiers(body.items, reg)
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
