"""What a BAT ranking request means, below HTTP: a ``/v1/rank`` body → the engine's ``RankingRequest`` (the user
as a registered ``user_id`` or raw ``user_tokens``, the candidates as registered item ids or raw token lists whose
last token is the identifier token), the checks of a registration (``/v1/users``, ``/v1/items``: lengths, tokens,
the ``--max-users`` / ``--max-items`` limits, identifier collisions), and the routes' cheap checks of their raw
bodies. Each failure is the ``ApiError`` it earns (``refusal.py``), its field named; the table of them is
``docs/ranking.md``'s."""

from __future__ import annotations

from typing import Any

import numpy as np

from grserve.config import RankingLimits
from grserve.engine.types import RankingRequest
from grserve.inputs.house_schemas import RankRequest
from grserve.inputs.limits import Precheck
from grserve.inputs.refusal import ApiError, check_length, token_ids, unknown_ids


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


def check_tokens(entries: list, limit: int, vocab: int, field: str, what: str, etype: str) -> None:
    for k, e in enumerate(entries):
        check_length(len(e.tokens), limit, f"{field}[{k}].tokens", f"{what} {getattr(e, what + '_id')}", etype)
        token_ids(e.tokens, vocab, f"{field}[{k}].tokens")


def check_registration(ids: list[int], reg: Any, known: Any, limit: int, field: str, what: str) -> None:
    """409 ``too_many_<what>s`` when registering the new ids of ``ids`` would pass ``limit``."""
    new = {i for i in ids if not known(i)}
    total = reg.num_users if what == "user" else reg.num_items
    if total + len(new) > limit:
        raise ApiError(409, f"{field}: {len(new)} new {what}s would make {total + len(new)}, more than the limit of "
                            f"{limit} (--max-{what}s)", field, f"too_many_{what}s")


def check_identifiers(items: list, reg: Any) -> None:
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


def _lengths(entries: Any, limit: int, field: str, what: str, etype: str) -> None:
    """Each ``entries[k].tokens`` (raw JSON) at most ``limit`` long (as ``check_tokens`` says it)."""
    for k, e in enumerate(entries if isinstance(entries, list) else ()):
        tokens = e.get("tokens") if isinstance(e, dict) else None
        if isinstance(tokens, list):
            check_length(len(tokens), limit, f"{field}[{k}].tokens", f"{what} {e.get(what + '_id')}", etype)


def rank_precheck(limits: RankingLimits) -> Precheck:
    """The cheap length checks of ``/v1/rank`` on its raw JSON (before it is validated): the profile, the number of
    candidates, each raw candidate's tokens."""

    def check(raw: Any) -> None:
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

    return check


def users_precheck(limits: RankingLimits) -> Precheck:
    """``/v1/users``' profiles, each at most ``--max-profile-tokens`` (raw JSON)."""

    def check(raw: Any) -> None:
        if isinstance(raw, dict):
            _lengths(raw.get("users"), limits.max_profile_tokens, "users", "user", "profile_too_long")

    return check


def items_precheck(limits: RankingLimits) -> Precheck:
    """``/v1/items``' items, each at most ``--max-item-tokens`` (raw JSON)."""

    def check(raw: Any) -> None:
        if isinstance(raw, dict):
            _lengths(raw.get("items"), limits.max_item_tokens, "items", "item", "item_too_long")

    return check

