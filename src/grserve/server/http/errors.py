"""The errors of the three HTTP apps: the two JSON shapes of an ``ApiError`` (one per API family; the error itself,
the refusals and the wording of validation errors are transport-free: ``inputs/refusal.py``) and the handlers that
answer every error of an app in the shape its route table gives (``routes.py``).

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
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grserve.inputs.refusal import ApiError, house_validation_error, openai_validation_error
from grserve.server.http.routes import RouteTable

log = logging.getLogger("grserve.server")

CLIENT_CLOSED = 499  # nginx's "client closed request": the status the metrics record for a cancelled request


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
# the handlers
# ----------------------------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI, table: RouteTable) -> None:
    """Answer every error of ``app`` in the shape its route table gives the path (``routes.py``: OpenAI's, or the
    house shape with the table's one-of field groups)."""

    def shape(request: Request) -> tuple[Callable[[ApiError], JSONResponse], Callable]:
        if table.openai_shape(request.url.path):
            return openai_error, openai_validation_error
        return house_error, lambda exc: house_validation_error(exc, table.groups)

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
