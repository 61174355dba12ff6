"""The HTTP front end: validates user input, lays it out as prompt tokens, and awaits the engine.

Every error, from FastAPI's own validation to an engine crash, is answered with one JSON shape::

    {"error": {"message": "...", "field": "history_sids[3][1]" | null, "type": "out_of_range"}}

Status codes:

- 400 ``invalid_json``: the body is not valid JSON; ``catalog_load_failed``: POST /v1/catalog could not load the file.
- 404 ``not_found`` / 405 ``method_not_allowed``: unknown route or method.
- 413 ``prompt_too_long``: the history lays out to more than ``ServerConfig.max_prompt_tokens`` prompt tokens.
- 415 ``unsupported_media_type``: a body sent with a non-JSON content type.
- 422 everything else that is wrong with a request: missing / ambiguous / empty history, wrong types, unknown
  fields, ``unknown_items`` (item ids not in the catalog; the message lists them, ``field`` names the first one's
  position), SID of the wrong depth or a code out of range, token out of vocabulary, beam_width or top_n
  out of range.
- 500 ``internal``: an unexpected exception; it is logged and the server keeps serving.
- 503 ``overloaded``: the engine queue is full (with ``Retry-After: 1``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Sequence

import numpy as np
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grserve.config import ServerConfig
from grserve.engine.types import RetrievalRequest, RetrievalResult
from grserve.server.metrics import Metrics
from grserve.server.schemas import (
    HISTORY_FIELDS,
    CatalogInfo,
    CatalogReloadRequest,
    CatalogReloadResponse,
    HealthResponse,
    ItemOut,
    RecommendRequest,
    RecommendResponse,
    Timing,
)

log = logging.getLogger("grserve.server")

INT64_MAX = int(np.iinfo(np.int64).max)
INT64_MIN = int(np.iinfo(np.int64).min)
MAX_LISTED_IDS = 20


class ApiError(Exception):
    """A request error with its HTTP status, the offending field path, and a machine-readable type."""

    def __init__(self, status: int, message: str, field: str | None = None, type: str = "invalid_request",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.type = type
        self.headers = headers


def serve_until_exit(app: FastAPI, host: str, port: int, log_level: str, stop: Callable[[], None]) -> int:
    """Run uvicorn until it exits, then ``stop()`` the engine behind the app (always). Returns the exit code:
    0, or uvicorn's (it exits 1 when it cannot bind)."""
    import uvicorn

    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 1
    finally:
        stop()
    return 0


def error_response(status: int, message: str, field: str | None, type: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "field": field, "type": type}}, status_code=status,
                        headers=headers)


def _is_overload(exc: BaseException) -> bool:
    # Matched by name so this module does not import the engine (and a test double can define its own).
    return any(cls.__name__ == "EngineOverloaded" for cls in type(exc).__mro__)


# ----------------------------------------------------------------------------------------------------------
# validation-error translation
# ----------------------------------------------------------------------------------------------------------
def field_path(loc: Sequence[Any]) -> str | None:
    """("body", "history_sids", 3, 1) -> "history_sids[3][1]"; None for the body itself."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _translate_validation_error(exc: RequestValidationError,
                                groups: Sequence[str] = ("history",)) -> tuple[int, str, str | None, str]:
    """FastAPI/pydantic validation error → (status, message, field, type). ``groups`` name the request's
    one-of field groups: a ``<group>_missing`` / ``<group>_ambiguous`` error names the group as its field."""
    errors = exc.errors()
    if not errors:
        return 422, "invalid request", None, "validation_error"
    err = errors[0]
    etype = str(err.get("type", "validation_error"))
    loc = tuple(err.get("loc", ()))
    if etype == "json_invalid":
        ctx = err.get("ctx") or {}
        pos = loc[1] if len(loc) > 1 else "?"
        return 400, f"request body is not valid JSON: {ctx.get('error', 'decode error')} at position {pos}", None, \
            "invalid_json"
    if loc == ("body",) and isinstance(getattr(exc, "body", None), (bytes, bytearray)):
        return 415, "request body must be JSON (Content-Type: application/json)", None, "unsupported_media_type"
    group, _, kind = etype.rpartition("_")
    if group in groups and kind in ("missing", "ambiguous"):
        return 422, str(err.get("msg")), group, etype
    field = field_path(loc)
    msg = str(err.get("msg", "invalid value"))
    if etype == "missing" and field is None:
        msg = "request body is required"
    elif etype == "model_attributes_type" and field is None:
        msg = "request body must be a JSON object"
    elif etype == "extra_forbidden":
        msg = f"unknown field {field!r}"
    if field is not None and etype != "extra_forbidden":
        msg = f"{field}: {msg}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return 422, msg, field, etype


# ----------------------------------------------------------------------------------------------------------
# history -> prompt tokens
# ----------------------------------------------------------------------------------------------------------
def _to_int64(values: list[int], field: str, lo: int, hi: int, what: str) -> np.ndarray:
    """Python ints -> int64 array, raising ApiError naming ``field[i]`` for the first value outside [lo, hi)."""
    try:
        arr = np.asarray(values, dtype=np.int64)
    except OverflowError:
        arr = None
    if arr is not None:
        bad = (arr < lo) | (arr >= hi)
        if not bad.any():
            return arr
        i = int(np.flatnonzero(bad)[0])
    else:
        i = next(k for k, v in enumerate(values) if not lo <= v < hi)
    raise ApiError(422, f"{field}[{i}]: {what} {values[i]} is out of range [{lo}, {hi})", f"{field}[{i}]",
                   "out_of_range")


def _check_length(n_tokens: int, max_tokens: int, field: str) -> None:
    if n_tokens > max_tokens:
        raise ApiError(413, f"{field}: the history lays out to {n_tokens} prompt tokens, more than the limit of "
                            f"{max_tokens}", field, "prompt_too_long")


def _items_to_tokens(catalog: Any, items: list[int], max_tokens: int) -> np.ndarray:
    _check_length(len(items) * catalog.depth, max_tokens, "history_items")
    try:
        ids = np.asarray(items, dtype=np.int64)
    except OverflowError:  # ids beyond int64 cannot be in the catalog
        _raise_unknown(items, [k for k, v in enumerate(items) if not INT64_MIN <= v <= INT64_MAX])
        raise
    try:
        sids = catalog.sids_of_items(ids)
    except KeyError:
        _raise_unknown(items, _unknown_positions(catalog, ids))
        raise  # _raise_unknown raises; this keeps type checkers quiet
    return catalog.layout.sids_to_tokens(np.asarray(sids, dtype=np.int64))


def _unknown_positions(catalog: Any, ids: np.ndarray) -> list[int]:
    """Positions in ``ids`` of the ids the catalog does not know (error path only: one lookup per distinct id)."""
    unknown: set[int] = set()
    for v in np.unique(ids).tolist():
        try:
            catalog.sids_of_items(np.asarray([v], dtype=np.int64))
        except KeyError:
            unknown.add(int(v))
    return [k for k, v in enumerate(ids.tolist()) if v in unknown]


def _raise_unknown(items: list[int], positions: list[int]) -> None:
    if not positions:  # the catalog raised KeyError for the batch but knows every id on its own: report all
        raise ApiError(422, "history_items: unknown item ids", "history_items", "unknown_items")
    ids: list[int] = []
    for k in positions:
        if items[k] not in ids:
            ids.append(items[k])
    shown = ", ".join(str(v) for v in ids[:MAX_LISTED_IDS]) + (", ..." if len(ids) > MAX_LISTED_IDS else "")
    first = positions[0]
    raise ApiError(422, f"history_items: {len(ids)} unknown item id{'s' if len(ids) != 1 else ''} not in the "
                        f"catalog: [{shown}] (first at history_items[{first}])",
                   f"history_items[{first}]", "unknown_items")


def _sids_to_tokens(catalog: Any, sids: list[list[int]], max_tokens: int) -> np.ndarray:
    depth = int(catalog.depth)
    sizes = tuple(int(c) for c in catalog.codebook_sizes)
    for i, sid in enumerate(sids):
        if len(sid) != depth:
            raise ApiError(422, f"history_sids[{i}]: a SID has {depth} codes (catalog depth), got {len(sid)}",
                           f"history_sids[{i}]", "wrong_depth")
    _check_length(len(sids) * depth, max_tokens, "history_sids")
    try:
        arr = np.asarray(sids, dtype=np.int64)
    except OverflowError:
        arr = None
    if arr is not None:
        bad = (arr < 0) | (arr >= np.asarray(sizes, dtype=np.int64))
        if not bad.any():
            return catalog.layout.sids_to_tokens(arr)
        i, j = (int(x) for x in np.argwhere(bad)[0])
    else:
        i, j = next((i, j) for i, sid in enumerate(sids) for j, c in enumerate(sid) if not 0 <= c < sizes[j])
    raise ApiError(422, f"history_sids[{i}][{j}]: code {sids[i][j]} is out of range for level {j} "
                        f"[0, {sizes[j]})", f"history_sids[{i}][{j}]", "out_of_range")


def _tokens(tokens: list[int], vocab_size: int, max_tokens: int) -> np.ndarray:
    _check_length(len(tokens), max_tokens, "history_tokens")
    return _to_int64(tokens, "history_tokens", 0, vocab_size, "token")


def catalog_info(catalog: Any) -> CatalogInfo:
    return CatalogInfo(num_items=len(catalog), version=int(catalog.version), depth=int(catalog.depth),
                       codebook_sizes=[int(c) for c in catalog.codebook_sizes])


def _load_catalog_file(path: str, codebook_sizes: tuple[int, ...], token_offset: int) -> Any:
    from grserve.catalog import load_catalog  # lazy: the server module imports without the catalog package

    return load_catalog(path, codebook_sizes=codebook_sizes, token_offset=token_offset)


# ----------------------------------------------------------------------------------------------------------
# metrics middleware (pure ASGI: sees the final status of every response, including handled errors)
# ----------------------------------------------------------------------------------------------------------
class _MetricsMiddleware:
    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"  # the template, never the raw path (cardinality)
            self.metrics.observe_request(name, status[0], time.perf_counter() - start)


# ----------------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------------
def install_error_handlers(app: FastAPI, groups: Sequence[str] = ()) -> None:
    """Answer every error of ``app`` in the house format ``{"error": {"message", "field", "type"}}``."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.field, exc.type, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, field, etype = _translate_validation_error(exc, groups)
        return error_response(status, message, field, etype)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kinds = {404: "not_found", 405: "method_not_allowed"}
        return error_response(exc.status_code, str(exc.detail), None, kinds.get(exc.status_code, "http_error"),
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # last resort; routes catch their own
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", None, "internal")


def create_app(engine: Any, server_cfg: ServerConfig, metrics: Metrics | None = None) -> FastAPI:
    """Build the FastAPI app around a started (or to-be-started) engine. The caller owns engine start/stop."""
    metrics = metrics if metrics is not None else Metrics()
    metrics.bind_queue_depth(lambda: engine.queue_depth)
    app = FastAPI(title="grserve", version="0.1.0",
                  description="Generative-recommender retrieval: history in, top items by SID beam search out.")
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.server_cfg = server_cfg
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    install_error_handlers(app, groups=("history",))

    # --- routes ------------------------------------------------------------------------------------------
    @app.post("/v1/recommend", response_model=RecommendResponse,
              responses={400: {}, 413: {}, 415: {}, 422: {}, 500: {}, 503: {}})
    async def recommend(body: RecommendRequest) -> Any:
        t0 = time.perf_counter()
        catalog = engine.catalogs.current()  # one snapshot for the whole conversion
        search = engine.search
        beam_width = body.beam_width if body.beam_width is not None else int(search.beam_width)
        if not 1 <= beam_width <= int(search.max_beam_width):
            raise ApiError(422, f"beam_width: {beam_width} is out of range [1, {search.max_beam_width}]",
                           "beam_width", "out_of_range")
        max_top_n = min(beam_width, int(server_cfg.max_top_n))
        if not 1 <= body.top_n <= max_top_n:
            raise ApiError(422, f"top_n: {body.top_n} is out of range [1, {max_top_n}] (at most beam_width "
                                f"{beam_width} and the server limit {server_cfg.max_top_n})", "top_n",
                           "out_of_range")
        max_tokens = int(server_cfg.max_prompt_tokens)
        kind = body.history_kind
        if kind == "history_items":
            prompt = _items_to_tokens(catalog, body.history_items, max_tokens)  # type: ignore[arg-type]
        elif kind == "history_sids":
            prompt = _sids_to_tokens(catalog, body.history_sids, max_tokens)  # type: ignore[arg-type]
        else:
            prompt = _tokens(body.history_tokens, int(engine.vocab_size), max_tokens)  # type: ignore[arg-type]
        prompt = np.ascontiguousarray(prompt, dtype=np.int64).reshape(-1)
        if prompt.size > 0 and int(prompt.max()) >= int(engine.vocab_size):  # catalog layout vs model vocab
            raise ApiError(422, f"{kind}: the history maps to token {int(prompt.max())}, outside the model "
                                f"vocabulary of {engine.vocab_size}", kind, "out_of_range")

        kwargs: dict[str, Any] = {}
        if body.request_id is not None:
            kwargs["request_id"] = body.request_id
        req = RetrievalRequest(prompt_tokens=prompt, beam_width=beam_width, top_n=body.top_n, **kwargs)
        try:
            result: RetrievalResult = await engine.recommend(req)
        except Exception as exc:  # noqa: BLE001 - every engine failure becomes a JSON answer
            if _is_overload(exc):
                raise ApiError(503, f"server overloaded: {exc}" if str(exc) else "server overloaded, retry later",
                               None, "overloaded", headers={"Retry-After": "1"}) from exc
            log.exception("engine failed on request %s", req.request_id)
            raise ApiError(500, f"internal error while serving the request: {type(exc).__name__}", None,
                           "internal") from exc

        items = [ItemOut(item_id=int(it.item_id), sid=[int(c) for c in it.sid],
                         score=float(it.score) if math.isfinite(float(it.score)) else -1e30)
                 for it in result.items]
        metrics.observe_items(len(items))
        return RecommendResponse(
            request_id=result.request_id or req.request_id,
            items=items,
            beam_width=beam_width,
            catalog_version=int(result.catalog_version),
            timing=Timing(queue_ms=float(result.queue_ms), compute_ms=float(result.compute_ms),
                          total_ms=(time.perf_counter() - t0) * 1000.0),
            batch_size=int(result.batch_size),
        )

    @app.get("/health", response_model=HealthResponse)
    async def health() -> Any:
        return HealthResponse(status="ok", catalog=catalog_info(engine.catalogs.current()),
                              queue_depth=int(engine.queue_depth), vocab_size=int(engine.vocab_size))

    @app.get("/metrics")
    async def metrics_route() -> Response:
        payload, content_type = metrics.render()
        return Response(content=payload, media_type=content_type)

    @app.post("/v1/catalog", response_model=CatalogReloadResponse, responses={400: {}, 422: {}})
    async def reload_catalog(body: CatalogReloadRequest) -> Any:
        """Admin: load a catalog file and swap it in while serving.

        The new catalog must use the serving SID layout (same depth, codebook sizes and token offset: the model's
        vocabulary is laid out that way); .jsonl/.csv files are read with that layout, a .grcat must declare it.
        Requests already converted keep their snapshot; a file that fails to load or does not fit leaves the old
        catalog serving. NOTE: this reads any path the server process can read; expose it only to trusted clients.
        """
        current = engine.catalogs.current()
        previous = int(current.version)
        try:
            catalog = await run_in_threadpool(_load_catalog_file, body.path, tuple(current.codebook_sizes),
                                              int(current.layout.token_offset))
        except (ValueError, KeyError, OSError) as exc:  # CatalogError is a ValueError
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            if isinstance(exc, OSError) and not str(exc):
                message = f"cannot read {body.path}"
            raise ApiError(400, f"cannot load catalog {body.path!r}: {message}", "path", "catalog_load_failed")
        layout = getattr(catalog, "layout", None)
        needed = int(getattr(layout, "num_tokens", 0) or 0)
        if needed > int(engine.vocab_size):
            raise ApiError(400, f"catalog {body.path!r} needs {needed} SID tokens but the model vocabulary has "
                                f"{engine.vocab_size}", "path", "catalog_incompatible")
        try:
            engine.catalogs.replace(catalog)
        except ValueError as exc:
            raise ApiError(400, f"catalog {body.path!r} rejected: {exc}", "path", "catalog_incompatible")
        log.info("catalog reloaded from %s: version %s -> %s", body.path, previous,
                 engine.catalogs.current().version)
        return CatalogReloadResponse(catalog=catalog_info(engine.catalogs.current()), previous_version=previous)

    return app


__all__ = ["ApiError", "HISTORY_FIELDS", "create_app", "field_path"]
