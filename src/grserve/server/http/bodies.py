"""Request bodies parsed and validated off the event loop, their cheap length checks first.

FastAPI parses and validates a body on the event loop, before the route runs: a 7 MB list of ints costs ~0.25 s
there, a chat of 100k messages ~2 s (pydantic runs each message's validators), and every other client — ``/health``
included — waits. ``body_route(prechecks)`` is the route class of an app's routes that does that work on a
heavy-work thread (``off_loop``, below) instead, for bodies over ``INLINE_BYTES`` (smaller ones inline), in this
order:

1. ``max_brackets``: a body with more ``[`` and ``{`` bytes than that (an upper bound on its JSON arrays and
   objects) is refused unparsed (413 ``body_too_complex``) — building many containers is what makes the garbage
   collector hold every thread (a full collection walks the whole heap). The house apps set it from their limits
   (their bodies hold numbers: more containers than a valid request can have is refused anyway); the LLM keeps
   ``MAX_BRACKETS``, as prompts may quote code;
2. the JSON is parsed with hooks on every object and number, so the C scanner re-enters the interpreter, which can
   switch to the event loop between two values;
3. the route's precheck (its row of the app's route table, ``routes.py``; on the raw JSON: list lengths,
   characters, message counts — the limits a request can be refused by without validating or tokenizing it) raises its 4xx;
4. the route's body model validates it.

The validated body is handed to FastAPI as the request's JSON (``_Prepared``); FastAPI's own validation passes a
model instance through unchanged, so a body is parsed and validated once. Errors are FastAPI's, unchanged: a JSON
syntax error is its ``json_invalid`` validation error, another parse failure its 400, a schema violation its
``RequestValidationError`` — each answered in the app's error shape (``errors.py``).

Heavy request work off the event loop (``off_loop``): JSON parsing and validation of large bodies, tokenization,
chat-template rendering. It runs in one small pool of ``HEAVY_WORKERS`` threads shared by every app of the process,
so a huge request costs a worker, never the event loop that answers ``/health`` and every other client; how many
requests can wait for a worker is bounded by admission (``--max-waiting``, ``edge.py``) on the routes that queue
work. The tokenizers' Rust code releases the GIL while it encodes; pure-Python work (templates, validators) lets the
interpreter switch threads every few milliseconds; C work that holds the GIL (the JSON scanner) is bounded by the
body limit and made interruptible by the hooks of ``parse``.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from grserve.inputs.limits import MAX_BRACKETS, Precheck
from grserve.inputs.refusal import ApiError
from grserve.server.http.routes import RouteTable

T = TypeVar("T")

INLINE_BYTES = 64 << 10
HEAVY_WORKERS = 2
_NOT_PREPARED = object()
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HEAVY_WORKERS, thread_name_prefix="grserve-heavy")
        return _pool


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a heavy-work thread; its exception is raised here."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)


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


def body_route(table: RouteTable) -> type[APIRoute]:
    """The route class of an app's routes: a route with one JSON body model has it parsed, prechecked (its row of
    ``table``) and validated as the module docstring says, at most ``table.max_brackets`` containers."""
    max_brackets = table.max_brackets

    class BodyRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            inner = super().get_route_handler()
            params = self.dependant.body_params
            if len(params) != 1 or self.body_field is None:
                return inner
            field, check = params[0], table.precheck(self.path)

            async def handler(request: Request) -> Response:
                prepared = _Prepared(request.scope, request.receive)
                raw = await prepared.body()
                if raw and _is_json(prepared):
                    prepared.prepared = (prepare(raw, check, field, max_brackets) if len(raw) <= INLINE_BYTES
                                         else await off_loop(prepare, raw, check, field, max_brackets))
                return await inner(prepared)

            return handler

    return BodyRoute
