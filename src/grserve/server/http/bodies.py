"""Request bodies parsed and validated off the event loop, their cheap length checks first.

FastAPI parses and validates a body on the event loop, before the route runs: a 7 MB list of ints costs ~0.25 s
there, a chat of 100k messages ~2 s (pydantic runs each message's validators), and every other client — ``/health``
included — waits. ``body_route(prechecks)`` is the route class of an app's routes that does that work on a
heavy-work thread (``offload.py``) instead, for bodies over ``INLINE_BYTES`` (smaller ones inline), in this order:

1. ``max_brackets``: a body with more ``[`` and ``{`` bytes than that (an upper bound on its JSON arrays and
   objects) is refused unparsed (413 ``body_too_complex``) — building many containers is what makes the garbage
   collector hold every thread (a full collection walks the whole heap). The house apps set it from their limits
   (their bodies hold numbers: more containers than a valid request can have is refused anyway); the LLM keeps
   ``MAX_BRACKETS``, as prompts may quote code;
2. the JSON is parsed with hooks on every object and number, so the C scanner re-enters the interpreter, which can
   switch to the event loop between two values;
3. the route's precheck (``prechecks[path]``, on the raw JSON: list lengths, characters, message counts — the
   limits a request can be refused by without validating or tokenizing it) raises its 4xx;
4. the route's body model validates it.

The validated body is handed to FastAPI as the request's JSON (``_Prepared``); FastAPI's own validation passes a
model instance through unchanged, so a body is parsed and validated once. Errors are FastAPI's, unchanged: a JSON
syntax error is its ``json_invalid`` validation error, another parse failure its 400, a schema violation its
``RequestValidationError`` — each answered in the app's error shape (``errors.py``).
"""

from __future__ import annotations

import email.message
import json
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from grserve.server.http.errors import ApiError
from grserve.server.http.offload import off_loop

INLINE_BYTES = 64 << 10
MAX_BRACKETS = 1 << 17  # ~1 MB of bracket-dense text: more than any context window holds

Precheck = Callable[[Any], None]
_NOT_PREPARED = object()


class _Prepared(Request):
    """A request whose JSON body was already parsed and validated: ``json()`` returns the validated body."""

    prepared: Any = _NOT_PREPARED

    async def json(self) -> Any:
        if self.prepared is _NOT_PREPARED:
            return await super().json()
        return self.prepared


def _is_json(request: Request) -> bool:
    """FastAPI's rule (strict content type): the body is JSON when it says ``application/json`` or ``+json``."""
    value = request.headers.get("content-type")
    if not value:
        return False
    message = email.message.Message()
    message["content-type"] = value
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _value(v: Any) -> Any:  # Python code between two values: the interpreter may switch threads here
    return v


def _int(s: str) -> int:
    return int(s)


def _float(s: str) -> float:
    return float(s)


def parse(raw: bytes, max_brackets: int = MAX_BRACKETS) -> Any:
    """JSON as FastAPI parses it (``json.loads``), with a Python hook on every object and number (the interpreter
    may switch threads there); refused unparsed past ``max_brackets``."""
    if raw.count(b"[") + raw.count(b"{") > max_brackets:
        raise ApiError(413, f"request body has more than {max_brackets} JSON arrays and objects ('[' and "
                            "'{' characters)", None, "body_too_complex")
    try:
        return json.loads(raw, object_hook=_value, parse_int=_int, parse_float=_float)
    except json.JSONDecodeError as e:  # FastAPI's error for it, word for word
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from None
    except Exception as e:  # noqa: BLE001 - deep nesting, bad UTF-8, a number past int's digit limit: FastAPI's 400
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


def prepare(raw: bytes, precheck: Precheck | None, field: Any, max_brackets: int = MAX_BRACKETS) -> Any:
    """Parse, precheck and validate one body (on a heavy-work thread for a large one)."""
    parsed = parse(raw, max_brackets)
    if parsed is None:  # JSON null: FastAPI's "missing body" error, nothing heavy
        return _NOT_PREPARED
    if precheck is not None:
        precheck(parsed)
    value, errors = field.validate(parsed, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=parsed)
    return value


def body_route(prechecks: Mapping[str, Precheck] | None = None, max_brackets: int = MAX_BRACKETS) -> type[APIRoute]:
    """The route class of an app's (or router's) routes: a route with one JSON body model has it parsed, prechecked
    (``prechecks[path]``) and validated as the module docstring says."""
    checks = dict(prechecks or {})

    class BodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()
            params = self.dependant.body_params
            if len(params) != 1 or self.body_field is None:
                return inner
            field, check = params[0], checks.get(self.path)

            async def handler(request: Request) -> Response:
                prepared = _Prepared(request.scope, request.receive)
                raw = await prepared.body()
                if raw and _is_json(prepared):
                    prepared.prepared = (prepare(raw, check, field, max_brackets) if len(raw) <= INLINE_BYTES
                                         else await off_loop(prepare, raw, check, field, max_brackets))
                return await inner(prepared)

            return handler

    return BodyRoute
