"""The GR retrieval app: ``POST /v1/recommend`` (a history in, the top items by SID beam search out) and the
admin route ``POST /v1/catalog`` (hot catalog reload); ``/health`` and ``/metrics`` come from the server core.

A history is given in one of three forms and laid out as prompt tokens here, against one catalog snapshot, so
the engine receives valid ``RetrievalRequest``\\ s only. Errors: the house convention (``server/core.py``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from grserve.config import CatalogReloadConfig, EdgeConfig, ServerConfig
from grserve.engine.types import RetrievalRequest, RetrievalResult
from grserve.server.core import (
    INT64_MAX,
    INT64_MIN,
    ApiError,
    check_length,
    finish,
    int64_in_range,
    new_app,
    submit,
    token_ids,
    unknown_ids,
)
from grserve.server.catalog_reload import CatalogReloader
from grserve.server.metrics import Metrics
from grserve.server.schemas import (
    CatalogInfo,
    CatalogReloadRequest,
    CatalogReloadResponse,
    ItemOut,
    RecommendRequest,
    RecommendResponse,
    Timing,
)

log = logging.getLogger("grserve.server")
_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 404, 413, 415, 422, 429, 500, 503)}
_RELOAD_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 403, 404, 413, 422, 429, 500, 504)}
ADMIN_ROUTES = frozenset({("POST", "/v1/catalog")})


# ----------------------------------------------------------------------------------------------------------
# history -> prompt tokens
# ----------------------------------------------------------------------------------------------------------
def _too_long(n_tokens: int, max_tokens: int, field: str) -> None:
    check_length(n_tokens, max_tokens, field, "the history (laid out as prompt tokens)", "prompt_too_long")


def items_to_tokens(catalog: Any, items: list[int], max_tokens: int) -> np.ndarray:
    """Catalog item ids → their SIDs' tokens; 404 listing the ids the catalog does not know."""
    _too_long(len(items) * catalog.depth, max_tokens, "history_items")
    beyond = [k for k, v in enumerate(items) if not INT64_MIN <= v <= INT64_MAX]
    if beyond:  # ids beyond int64 cannot be in the catalog
        raise unknown_ids("history_items", items, beyond, "item id", "unknown_items")
    ids = np.asarray(items, dtype=np.int64)
    try:
        sids = catalog.sids_of_items(ids)
    except KeyError:
        raise unknown_ids("history_items", items, _unknown_positions(catalog, ids), "item id",
                          "unknown_items") from None
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


def sids_to_tokens(catalog: Any, sids: list[list[int]], max_tokens: int) -> np.ndarray:
    """SIDs → tokens; 400 for a SID of the wrong depth or a code outside its level's codebook."""
    depth = int(catalog.depth)
    sizes = tuple(int(c) for c in catalog.codebook_sizes)
    for i, sid in enumerate(sids):
        if len(sid) != depth:
            raise ApiError(400, f"history_sids[{i}]: a SID has {depth} codes (catalog depth), got {len(sid)}",
                           f"history_sids[{i}]", "wrong_depth")
    _too_long(len(sids) * depth, max_tokens, "history_sids")
    arr, bad = int64_in_range(sids, 0, np.asarray(sizes, dtype=np.int64))
    if bad is not None:
        i, j = bad
        raise ApiError(400, f"history_sids[{i}][{j}]: code {sids[i][j]} is out of range for level {j} "
                            f"[0, {sizes[j]})", f"history_sids[{i}][{j}]", "out_of_range")
    return catalog.layout.sids_to_tokens(arr)


def history_tokens(body: RecommendRequest, catalog: Any, vocab_size: int, max_tokens: int) -> np.ndarray:
    """The request's history, whichever form it takes, as int64 prompt tokens inside the model vocabulary."""
    kind = body.history_kind
    if kind == "history_items":
        prompt = items_to_tokens(catalog, body.history_items, max_tokens)  # type: ignore[arg-type]
    elif kind == "history_sids":
        prompt = sids_to_tokens(catalog, body.history_sids, max_tokens)  # type: ignore[arg-type]
    else:
        _too_long(len(body.history_tokens), max_tokens, "history_tokens")  # type: ignore[arg-type]
        prompt = token_ids(body.history_tokens, vocab_size, "history_tokens")  # type: ignore[arg-type]
    prompt = np.ascontiguousarray(prompt, dtype=np.int64).reshape(-1)
    if prompt.size > 0 and int(prompt.max()) >= vocab_size:  # catalog layout vs model vocab
        raise ApiError(400, f"{kind}: the history maps to token {int(prompt.max())}, outside the model "
                            f"vocabulary of {vocab_size}", kind, "out_of_range")
    return prompt


def _search_knobs(body: RecommendRequest, search: Any, server_cfg: ServerConfig) -> int:
    """The request's beam width (its own or the server default), range-checked with its top_n."""
    beam_width = body.beam_width if body.beam_width is not None else int(search.beam_width)
    if not 1 <= beam_width <= int(search.max_beam_width):
        raise ApiError(400, f"beam_width: {beam_width} is out of range [1, {search.max_beam_width}]",
                       "beam_width", "out_of_range")
    max_top_n = min(beam_width, int(server_cfg.max_top_n))
    if not 1 <= body.top_n <= max_top_n:
        raise ApiError(400, f"top_n: {body.top_n} is out of range [1, {max_top_n}] (at most beam_width "
                            f"{beam_width} and the server limit {server_cfg.max_top_n})", "top_n", "out_of_range")
    return beam_width


def retrieval_request(body: RecommendRequest, catalog: Any, engine: Any, server_cfg: ServerConfig) -> RetrievalRequest:
    """A validated body → the engine's request (``ApiError`` naming the field otherwise); also the offline API's
    conversion (``grserve.recommender``), so both take exactly the same inputs."""
    beam_width = _search_knobs(body, engine.search, server_cfg)
    prompt = history_tokens(body, catalog, int(engine.vocab_size), int(server_cfg.max_prompt_tokens))
    kwargs = {"request_id": body.request_id} if body.request_id is not None else {}
    return RetrievalRequest(prompt_tokens=prompt, beam_width=beam_width, top_n=body.top_n,
                            exclude_items=excluded_items(body, server_cfg), **kwargs)


def items_out(result: RetrievalResult) -> list[ItemOut]:
    """The answer's items (a non-finite score, which JSON cannot carry, as -1e30)."""
    return [ItemOut(item_id=int(it.item_id), sid=[int(c) for c in it.sid],
                    score=float(it.score) if math.isfinite(float(it.score)) else -1e30) for it in result.items]


def catalog_info(catalog: Any) -> CatalogInfo:
    return CatalogInfo(num_items=len(catalog), version=int(catalog.version), depth=int(catalog.depth),
                       codebook_sizes=[int(c) for c in catalog.codebook_sizes])


def excluded_items(body: RecommendRequest, server_cfg: ServerConfig) -> np.ndarray | None:
    """``exclude_items`` as int64 ids (413 over ``--max-exclude-items``). Ids the catalog does not know — and ids
    beyond int64, which no catalog can hold — exclude nothing and are dropped (decided: docs/security.md)."""
    if not body.exclude_items:
        return None
    limit = int(server_cfg.max_exclude_items)
    if len(body.exclude_items) > limit:
        raise ApiError(413, f"exclude_items: {len(body.exclude_items)} items, more than the limit of {limit}",
                       "exclude_items", "too_many_excluded")
    return np.asarray([v for v in body.exclude_items if INT64_MIN <= v <= INT64_MAX], dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------------
def create_app(engine: Any, server_cfg: ServerConfig, metrics: Metrics | None = None, edge: EdgeConfig | None = None,
               reload: CatalogReloadConfig | None = None) -> FastAPI:
    """The retrieval app around a started (or to-be-started) ``RetrievalEngine``; the caller owns start/stop."""
    app = new_app(engine, metrics, title="grserve",
                  description="Generative-recommender retrieval: history in, top items by SID beam search out.",
                  groups=("history",), detail=lambda: {"catalog": catalog_info(engine.catalogs.current()).model_dump(),
                                                       "vocab_size": int(engine.vocab_size)},
                  edge=edge, admin_routes=ADMIN_ROUTES, queued_routes=frozenset({("POST", "/v1/recommend")}))
    metrics = app.state.metrics
    app.state.server_cfg = server_cfg
    reloader = CatalogReloader(reload or CatalogReloadConfig(), engine.catalogs, int(engine.vocab_size))
    app.state.reloader = reloader

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=_ERRORS)
    async def recommend(body: RecommendRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        catalog = engine.catalogs.current()  # one snapshot for the whole conversion
        req = retrieval_request(body, catalog, engine, server_cfg)
        result: RetrievalResult = await finish(request, engine, submit(engine, req))
        items = items_out(result)
        metrics.observe_items(len(items))
        return RecommendResponse(
            request_id=result.request_id or req.request_id, items=items, beam_width=req.beam_width,
            catalog_version=int(result.catalog_version),
            timing=Timing(queue_ms=float(result.queue_ms), compute_ms=float(result.compute_ms),
                          total_ms=(time.perf_counter() - t0) * 1000.0),
            batch_size=int(result.batch_size))

    @app.post("/v1/catalog", response_model=CatalogReloadResponse, responses=_RELOAD_ERRORS)
    async def reload_catalog(body: CatalogReloadRequest) -> Any:
        """Admin (``--admin-api-key``): load the catalog file ``name`` from ``--catalog-dir`` and swap it in while
        serving (``server/catalog_reload.py``: by name, regular files, size limit, deadline, one at a time).
        Requests already converted keep their snapshot; a file that fails to load or does not fit leaves the
        old catalog serving."""
        previous = int(engine.catalogs.current().version)
        catalog = await reloader.reload(body.name)
        log.info("catalog reloaded from %s: version %s -> %s", body.name, previous, catalog.version)
        return CatalogReloadResponse(catalog=catalog_info(catalog), previous_version=previous)

    return app
