"""HTTP routes of BAT ranking: ``POST /v1/rank``, ``POST /v1/users``, ``POST /v1/items``, ``GET /v1/ranking/stats``.

``POST /v1/rank`` takes a user (``user_id`` of a registered user, or raw ``user_tokens``) and candidates
(registered ``candidates`` item ids, or raw ``candidate_tokens`` lists whose last token is the identifier token)
and returns the candidates ranked by the softmax over their identifier-token logits. Raw users/items are never
cached. Errors use the house shape ``{"error": {"message", "field", "type"}}``:

- 422 ``unknown_user`` / ``unknown_items`` (the message lists them; ``field`` names the first position),
  ``duplicate_candidates``, ``empty_candidates``, ``out_of_range`` tokens, exactly-one-of violations;
- 413 ``too_many_candidates`` (> ``max_candidates``), ``profile_too_long`` (> ``max_profile_tokens``),
  ``item_too_long`` (> ``max_item_tokens``);
- 503 ``overloaded`` when the engine queue is full.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from grserve.engine.ranking import EngineOverloaded, RankingRequest
from grserve.ranking.registry import RegistryError
from grserve.server.app import ApiError

MAX_LISTED = 20


@dataclass(frozen=True)
class RankingLimits:
    max_candidates: int = 256
    max_profile_tokens: int = 8192
    max_item_tokens: int = 64
    max_top_k: int = 256


# ---- schemas ------------------------------------------------------------------------------------------------
class RankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: StrictInt | None = None
    user_tokens: list[StrictInt] | None = None
    candidates: list[StrictInt] | None = None
    candidate_tokens: list[list[StrictInt]] | None = None
    top_k: Annotated[StrictInt, Field(ge=1)] = 10
    request_id: Annotated[StrictStr, Field(min_length=1, max_length=128)] | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "RankRequest":
        for a, b, what in (("user_id", "user_tokens", "user"), ("candidates", "candidate_tokens", "candidates")):
            given = [n for n in (a, b) if getattr(self, n) is not None]
            if len(given) != 1:
                raise PydanticCustomError(
                    f"{what}_missing" if not given else f"{what}_ambiguous",
                    "exactly one of {a}, {b} is required" if not given else "exactly one of {a}, {b} may be given",
                    {"a": a, "b": b})
        return self


class RankedItem(BaseModel):
    index: int  # position in the request's candidate list
    item_id: int | None  # None for raw candidates
    score: float  # softmax probability over the candidates


class RankTiming(BaseModel):
    queue_ms: float
    compute_ms: float
    total_ms: float


class RankResponse(BaseModel):
    request_id: str
    items: list[RankedItem]  # best first
    layout: str  # "user_prefix" | "item_prefix"
    total_tokens: int
    computed_tokens: int
    cached_tokens: int
    user_cache_hit: bool
    batch_size: int
    timing: RankTiming


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    user_id: StrictInt
    tokens: Annotated[list[StrictInt], Field(min_length=1)]


class ItemIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item_id: StrictInt
    tokens: Annotated[list[StrictInt], Field(min_length=1)]  # the last token is the identifier token


class UsersRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    users: Annotated[list[UserIn], Field(min_length=1)]


class ItemsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: Annotated[list[ItemIn], Field(min_length=1)]


class RegisterResponse(BaseModel):
    registered: int
    replaced: int
    total: int


# ---- helpers ------------------------------------------------------------------------------------------------
def _tokens(values: list[int], vocab: int, field: str) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.int64)
        bad = np.flatnonzero((arr < 0) | (arr >= vocab))
    except OverflowError:
        bad = np.asarray([k for k, v in enumerate(values) if not 0 <= v < vocab])
    if bad.size:
        i = int(bad[0])
        raise ApiError(422, f"{field}[{i}]: token {values[i]} is out of range [0, {vocab})", f"{field}[{i}]",
                       "out_of_range")
    return arr


def _too_long(n: int, limit: int, field: str, what: str, etype: str) -> None:
    if n > limit:
        raise ApiError(413, f"{field}: {what} has {n} tokens, more than the limit of {limit}", field, etype)


def build_router(engine: Any, limits: RankingLimits | None = None) -> APIRouter:
    """Routes around a started ``RankingEngine`` (``engine.registry``, ``engine.runner``, ``engine.rank``)."""
    limits = limits or RankingLimits()
    router = APIRouter()

    @router.post("/v1/rank", response_model=RankResponse,
                 responses={413: {}, 415: {}, 422: {}, 500: {}, 503: {}})
    async def rank(body: RankRequest) -> Any:
        t0 = time.perf_counter()
        reg = engine.registry
        vocab = reg.vocab_size
        # user
        if body.user_id is not None:
            if not reg.has_user(body.user_id):
                raise ApiError(422, f"user_id: unknown user {body.user_id}", "user_id", "unknown_user")
            user = reg.user_tokens(body.user_id)
            _too_long(len(user), limits.max_profile_tokens, "user_id", f"the profile of user {body.user_id}",
                      "profile_too_long")
        else:
            if not body.user_tokens:
                raise ApiError(422, "user_tokens: the profile must not be empty", "user_tokens", "empty_profile")
            _too_long(len(body.user_tokens), limits.max_profile_tokens, "user_tokens", "the profile",
                      "profile_too_long")
            user = _tokens(body.user_tokens, vocab, "user_tokens")
        # candidates
        field = "candidates" if body.candidates is not None else "candidate_tokens"
        cands = body.candidates if body.candidates is not None else body.candidate_tokens
        if not cands:
            raise ApiError(422, f"{field}: at least one candidate is required", field, "empty_candidates")
        if len(cands) > limits.max_candidates:
            raise ApiError(413, f"{field}: {len(cands)} candidates, more than the limit of {limits.max_candidates}",
                           field, "too_many_candidates")
        if body.candidates is not None:
            unknown = [k for k, i in enumerate(cands) if not reg.has_item(i)]
            if unknown:
                ids = list(dict.fromkeys(cands[k] for k in unknown))
                shown = ", ".join(map(str, ids[:MAX_LISTED])) + (", ..." if len(ids) > MAX_LISTED else "")
                raise ApiError(422, f"candidates: {len(ids)} unknown item id{'s' if len(ids) != 1 else ''}: "
                                    f"[{shown}] (first at candidates[{unknown[0]}])",
                               f"candidates[{unknown[0]}]", "unknown_items")
            seen: dict[int, int] = {}
            for k, i in enumerate(cands):
                if i in seen:
                    raise ApiError(422, f"candidates[{k}]: item {i} is listed twice (first at candidates[{seen[i]}])",
                                   f"candidates[{k}]", "duplicate_candidates")
                seen[i] = k
            items = [reg.item_tokens(i) for i in cands]
            item_ids: list[int | None] = list(cands)
        else:
            items = []
            for k, toks in enumerate(cands):
                if not toks:
                    raise ApiError(422, f"candidate_tokens[{k}]: an item needs at least its identifier token",
                                   f"candidate_tokens[{k}]", "empty_item")
                _too_long(len(toks), limits.max_item_tokens, f"candidate_tokens[{k}]", "the item", "item_too_long")
                items.append(_tokens(toks, vocab, f"candidate_tokens[{k}]"))
            item_ids = [None] * len(items)
        top_k = min(body.top_k, len(items), limits.max_top_k)
        req = RankingRequest(user, items, user_id=body.user_id, item_ids=item_ids, top_k=top_k)
        if body.request_id:
            req.request_id = body.request_id
        try:
            res = await engine.rank(req)
        except EngineOverloaded as e:
            raise ApiError(503, f"server overloaded: {e}", None, "overloaded", {"Retry-After": "1"}) from None
        ranked = [RankedItem(index=k, item_id=item_ids[k], score=s) for k, s in zip(res.order, res.scores)]
        return RankResponse(
            request_id=res.request_id, items=ranked, layout=res.layout, total_tokens=res.total_tokens,
            computed_tokens=res.computed_tokens, cached_tokens=res.cached_tokens, user_cache_hit=res.user_cache_hit,
            batch_size=res.batch_size,
            timing=RankTiming(queue_ms=res.queue_ms, compute_ms=res.compute_ms,
                              total_ms=(time.perf_counter() - t0) * 1e3))

    @router.post("/v1/users", response_model=RegisterResponse, responses={413: {}, 422: {}})
    async def register_users(body: UsersRequest) -> Any:
        reg = engine.registry
        for k, u in enumerate(body.users):
            _too_long(len(u.tokens), limits.max_profile_tokens, f"users[{k}].tokens", f"user {u.user_id}",
                      "profile_too_long")
            _tokens(u.tokens, reg.vocab_size, f"users[{k}].tokens")
        replaced = 0
        for u in body.users:
            replaced += reg.add_user(u.user_id, u.tokens)
        return RegisterResponse(registered=len(body.users), replaced=replaced, total=reg.num_users)

    @router.post("/v1/items", response_model=RegisterResponse, responses={413: {}, 422: {}})
    async def register_items(body: ItemsRequest) -> Any:
        reg = engine.registry
        for k, it in enumerate(body.items):
            _too_long(len(it.tokens), limits.max_item_tokens, f"items[{k}].tokens", f"item {it.item_id}",
                      "item_too_long")
            _tokens(it.tokens, reg.vocab_size, f"items[{k}].tokens")
        new, replaced = [], 0
        for it in body.items:
            try:
                known = reg.has_item(it.item_id)
                changed = reg.add_item(it.item_id, it.tokens)  # a change re-precomputes that item's KV
            except RegistryError as e:  # pragma: no cover - validated above
                raise ApiError(422, str(e), "items", "invalid_item") from None
            replaced += changed
            if not known:
                new.append(it.item_id)
        if new:
            from fastapi.concurrency import run_in_threadpool

            await run_in_threadpool(engine.runner.add_items, new)  # precompute their KV (item-as-prefix)
        return RegisterResponse(registered=len(body.items), replaced=replaced, total=reg.num_items)

    @router.get("/v1/ranking/stats")
    async def stats() -> Any:
        return {"policy": engine.runner.policy.name, **engine.runner.stats.summary()}

    return router
