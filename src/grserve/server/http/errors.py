"""The errors of the three HTTP apps: ``ApiError`` (status, message, field, type), its two JSON shapes (one per
API family), the translation of FastAPI/pydantic validation errors into it, the handlers that answer every error
of an app in its family's shape, and the refusals the edge and the request lifecycle share (401, 413, 429, 503).

Error conventions — one per API family, each applied to every route of that family
=====================================================================================

**House API** (``/v1/recommend``, ``/v1/catalog``, ``/v1/rank``, ``/v1/users``, ``/v1/items``, and the retrieval
and ranking servers' unknown routes)::

    {"error": {"message": "...", "field": "history_sids[3][1]" | null, "type": "out_of_range"}}

====== =================================================================================================
status when (``type`` values)
====== =================================================================================================
400    a bad value in a well-formed request: body not valid JSON (``invalid_json``), a value out of range
       (``out_of_range``: token id, SID code, beam_width, top_n; pydantic's ``greater_than_equal`` ...),
       a SID of the wrong depth (``wrong_depth``), an empty list (``too_short``, ``empty_*``), a duplicate
       (``duplicate_candidates``), a catalog file that cannot be loaded or does not fit the served model
       (``catalog_load_failed``, ``catalog_incompatible``)
404    an unknown id (``unknown_items``, ``unknown_user``: the message lists them, ``field`` names the first
       one's position) or an unknown route (``not_found``)
405    a known route with the wrong method (``method_not_allowed``)
401    no or a wrong API key (``invalid_api_key``; with ``WWW-Authenticate: Bearer``)
403    an admin route while ``--admin-api-key`` is unset (``admin_disabled``) or called with the plain API key
       (``admin_key_required``); a catalog reload while ``--catalog-dir`` is unset (``reload_disabled``)
409    a registration over a limit (``too_many_users``, ``too_many_items``) or an item whose identifier token
       is another item's (``identifier_collision``)
413    too large (``body_too_large``, ``prompt_too_long``, ``too_many_candidates``, ``profile_too_long``,
       ``item_too_long``, ``too_many_excluded``, ``catalog_too_large``)
415    a body that is not JSON (``unsupported_media_type``)
422    only schema violations: a wrong type (``int_type``, ``list_type``, ``string_type``,
       ``model_attributes_type``), a missing field (``missing``), an unknown field (``extra_forbidden``),
       exactly-one-of violated (``history_missing`` / ``history_ambiguous``, ``user_*``, ``candidates_*``:
       ``field`` names the group)
500    an unexpected failure (``internal``); logged, the server keeps serving
429    the queue is full (``overloaded``, ``--max-waiting``) or another catalog reload is running
       (``reload_busy``); with ``Retry-After: 1``
503    the request waited in the queue past ``--request-timeout`` and was dropped uncomputed (``queue_timeout``),
       or the server is stopping (``stopped``), or the engine process is restarting and not yet level with the
       front end's state (``stopped``), or answered from an older catalog than the front end serves
       (``engine_state_behind``: never a normal answer from stale state); with ``Retry-After: 1``
504    a catalog reload took longer than ``--catalog-timeout`` (``reload_timeout``; it is never applied)
====== =================================================================================================

**OpenAI API** (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` — on the LLM server and, answered
with SID beams, on the retrieval server — and the LLM server's unknown routes) keeps OpenAI's shape, which OpenAI
clients parse::

    {"error": {"message": "...", "type": "invalid_request_error" | "server_error", "param": "top_p" | null,
               "code": "model_not_found" | ... | null}}

``type`` is ``invalid_request_error`` for every 4xx and ``server_error`` for every 5xx; ``param`` names the
field; ``code`` is the machine-readable kind (the house ``type``). Status: 400 for every invalid request (bad or
non-JSON body, a missing, mistyped or out-of-range parameter, a token id outside the vocabulary, prompt plus
``max_tokens`` over the context: ``context_length_exceeded``), 404 an unknown model (``model_not_found``) or
route, 405 wrong method, 401 no or a wrong API key (``invalid_api_key``), 413 ``body_too_large``, 429 queue full
(``overloaded``, ``Retry-After: 1``), 500 internal, 503 ``queue_timeout`` / ``stopped`` with ``Retry-After: 1``.

Both families: a client that disconnects before its answer has its request cancelled in the engine (its
resources freed) and is logged with status 499 in the metrics (nobody is left to read a body).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("grserve.server")

CLIENT_CLOSED = 499  # nginx's "client closed request": the status the metrics record for a cancelled request

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


class ClientDisconnected(Exception):
    """The client went away before its answer; the request was cancelled in the engine."""


# ----------------------------------------------------------------------------------------------------------
# the two error shapes
# ----------------------------------------------------------------------------------------------------------
def house_error(exc: ApiError) -> JSONResponse:
    return JSONResponse({"error": {"message": exc.message, "field": exc.field, "type": exc.type}},
                        status_code=exc.status, headers=exc.headers)


def openai_error(exc: ApiError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": exc.field, "code": exc.type}},
                        status_code=exc.status, headers=exc.headers)


# ----------------------------------------------------------------------------------------------------------
# validation-error translation
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


def _body_error(exc: RequestValidationError, err: dict) -> ApiError | None:
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


def house_validation_error(exc: RequestValidationError, groups: Sequence[str] = ()) -> ApiError:
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


def openai_validation_error(exc: RequestValidationError) -> ApiError:
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
# the handlers
# ----------------------------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI, render: Callable[[ApiError], JSONResponse],
                           translate: Callable[[RequestValidationError], ApiError],
                           openai_paths: frozenset[str] = frozenset()) -> None:
    """Answer every error of ``app`` through ``render`` (one API family's shape); on ``openai_paths`` (the
    retrieval server's OpenAI beam routes) in OpenAI's shape."""

    def shape(request: Request) -> tuple[Callable[[ApiError], JSONResponse], Callable]:
        if request.url.path in openai_paths:
            return openai_error, openai_validation_error
        return render, translate

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return shape(request)[0](exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        out, tr = shape(request)
        return out(tr(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        render = shape(request)[0]
        if exc.status_code == 404:
            return render(ApiError(404, f"no route {request.url.path}", None, "not_found"))
        if exc.status_code == 405:
            return render(ApiError(405, f"method {request.method} not allowed on {request.url.path}", None,
                                   "method_not_allowed", getattr(exc, "headers", None)))
        return render(ApiError(exc.status_code, str(exc.detail), None, "http_error", getattr(exc, "headers", None)))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # last resort; routes catch their own
        # repr: a percent-decoded path may hold control characters (ESC: terminal escapes in a log viewer)
        log.exception("unhandled error on %s %r", request.method, request.url.path)
        return shape(request)[0](ApiError(500, f"internal error: {type(exc).__name__}", None, "internal"))



# ----------------------------------------------------------------------------------------------------------
# the refusals shared by the edge and the request lifecycle
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
