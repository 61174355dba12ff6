"""What a request earns when it is refused, below any transport: ``ApiError`` (status, message, field, type), the
refusals the edge and the request lifecycle share (401, 413, 429, 503), pydantic validation errors worded as the
house and as OpenAI word them, and the validators the retrieval and ranking inputs share (user values, possibly
beyond int64, into int64 arrays, or a 4xx naming the field ``field[i]``). The HTTP apps answer an ``ApiError`` in
their family's JSON shape (``server/http/errors.py``); the offline APIs raise their own errors from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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


# ----------------------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------------------
def unauthorized() -> ApiError:
    return ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", None, "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"})


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than the limit of {limit} bytes", None, "body_too_large")


def overloaded(detail: str = "") -> ApiError:
    """429 ``overloaded`` with ``Retry-After``: the queue is full."""
    return ApiError(429, f"server overloaded: {detail}" if detail else "server overloaded, retry later", None,
                    "overloaded", {"Retry-After": "1"})


def stopped(exc: BaseException) -> ApiError:
    """503 ``stopped`` with ``Retry-After``: the server is draining or stopped."""
    return ApiError(503, f"server is not taking requests: {exc}" if str(exc) else "server is stopping", None,
                    "stopped", {"Retry-After": "1"})


def queue_timeout(exc: BaseException) -> ApiError:
    """503 ``queue_timeout`` with ``Retry-After``: the request waited past its deadline, dropped uncomputed."""
    return ApiError(503, f"{exc}; it was dropped without being computed (server busy, retry later)", None,
                    "queue_timeout", {"Retry-After": "1"})


# ----------------------------------------------------------------------------------------------------------
# validation errors, as each API family words them
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


def _body_error(exc: Any, err: dict) -> ApiError | None:
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


def house_validation_error(exc: Any, groups: Sequence[str] = ()) -> ApiError:
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


def openai_validation_error(exc: Any) -> ApiError:
    """FastAPI/pydantic validation error → a 400 ApiError worded as OpenAI words it, ``param`` the field."""
    errors = exc.errors()
    err = errors[0] if errors else {"type": "validation_error", "loc": ()}
    body = _body_error(exc, err)
    if body is not None:
        return ApiError(400, body.message, None, body.type)
    param = field_path(err.get("loc", ()))
    if err.get("type") == "missing":
        msg = f"'{param}' is a required property"
    elif param is None:  # a check of the whole request: its message alone, never "invalid 'None'"
        msg = str(err.get("msg", "invalid value"))
    else:
        msg = f"invalid '{param}': {err.get('msg', 'invalid value')}"
    return ApiError(400, msg, param, str(err.get("type", "invalid_value")))


# ----------------------------------------------------------------------------------------------------------
# validators
# ----------------------------------------------------------------------------------------------------------
INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
MAX_LISTED_IDS = 20


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
