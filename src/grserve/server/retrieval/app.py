"""The GR retrieval app: ``POST /v1/recommend`` (a history in, the top items by SID beam search out), the OpenAI
routes ``POST /v1/chat/completions`` / ``POST /v1/completions`` (a chat or text prompt in, the ranked beams out as
``choices[]``: ``beams.py``) and the admin route ``POST /v1/catalog`` (hot catalog reload: ``catalog_reload.py``);
``/health`` and ``/metrics`` come from the shared app (``server/http/app.py``); each route's policy is its row of
``routes()``.

What a request means is below HTTP (``inputs/``): the history laid out as prompt tokens against one catalog snapshot
(``inputs/history.py``), the search knobs and item filters (``inputs/retrieval.py``), so the engine receives valid
``RetrievalRequest``\\ s only. Errors: the house convention (``server/http/errors.py``), and OpenAI's shape on the
OpenAI routes.

Every route that queues work is hardened alike (issue 25, docs/security.md): admission counts it from the edge on;
its body's cheap length checks come first (``recommend_precheck``, ``beam_completion_precheck``,
``beam_chat_precheck``: histories, ``exclude_items``, ``include_items``, a text prompt's characters and a chat's
messages against ``--max-prompt-tokens``), then it is parsed and validated off the event loop (``bodies.py``); a text
history is rendered and tokenized on a heavy-work thread; the engine's key is the server's own (a client's
``request_id`` is only echoed).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request

from grserve.catalog.popularity import Popularity
from grserve.config import BeamApiConfig, CatalogReloadConfig, EdgeConfig, ServerConfig
from grserve.engine.protocol import RetrievalService
from grserve.engine.types import RetrievalRequest, RetrievalResult, json_score
from grserve.inputs.history import cold_start
from grserve.inputs.house_schemas import (
    CatalogInfo,
    CatalogReloadRequest,
    CatalogReloadResponse,
    ItemOut,
    PromptUsage,
    RecommendRequest,
    RecommendResponse,
    Timing,
)
from grserve.inputs.limits import MAX_BRACKETS, PromptLimits
from grserve.inputs.retrieval import beam_chat_precheck, beam_completion_precheck, recommend_precheck, \
    retrieval_request, search_knobs, text_limits
from grserve.inputs.sid_prompts import BeamContext
from grserve.server.http.app import new_app
from grserve.server.http.bodies import off_loop
from grserve.server.http.lifecycle import check_catalog_version, finish, submit
from grserve.server.http.metrics import Metrics
from grserve.server.http.routes import Route, RouteTable, documented
from grserve.server.retrieval.beams import create_beam_router, thought_text
from grserve.server.retrieval.catalog_reload import CatalogReloader
from grserve.state.store import StateStore

log = logging.getLogger("grserve.server")
TEXT_HISTORIES = frozenset({"prompt", "messages"})  # rendered and tokenized: on a heavy-work thread
TEMPLATED_HISTORIES = frozenset({"history_items", "history_sids"})  # so too with --prompt-template


def routes(engine: RetrievalService, server_cfg: ServerConfig, limits: PromptLimits) -> RouteTable:
    """The retrieval app's route table: the house routes, and the OpenAI beam routes in OpenAI's error shape."""
    return RouteTable([
        Route("POST", "/v1/recommend", queued=True, precheck=recommend_precheck(engine, server_cfg, limits)),
        Route("POST", "/v1/catalog", admin=True),
        Route("POST", "/v1/chat/completions", queued=True, precheck=beam_chat_precheck(limits, server_cfg),
              openai=True),
        Route("POST", "/v1/completions", queued=True, precheck=beam_completion_precheck(limits, server_cfg),
              openai=True),
        Route("GET", "/v1/models", openai=True),
    ], groups=("history",), max_brackets=max_brackets(server_cfg, limits))


def items_out(result: RetrievalResult) -> list[ItemOut]:
    """The answer's items (a non-finite score, which JSON cannot carry, as -1e30)."""
    return [ItemOut(item_id=int(it.item_id), sid=[int(c) for c in it.sid],
                    score=json_score(it.score)) for it in result.items]


def catalog_info(catalog: Any) -> CatalogInfo:
    return CatalogInfo(num_items=catalog.num_items, version=int(catalog.version), depth=int(catalog.depth),
                       codebook_sizes=[int(c) for c in catalog.codebook_sizes])


def max_brackets(server_cfg: ServerConfig, limits: PromptLimits) -> int:
    """The app's bound on a body's ``[`` + ``{`` bytes (``bodies.py``): a SID is a list, so more than
    ``--max-prompt-tokens`` of them is too long anyway; with a tokenizer, text may quote brackets too — as many as
    the prompt's characters and a chat's containers (at most the LLM server's ``MAX_BRACKETS``)."""
    bound = max(int(server_cfg.max_prompt_tokens), int(server_cfg.max_history_entries)) + 64
    if limits.max_chars is None:
        return bound
    return max(bound, min(MAX_BRACKETS, limits.max_chars + 3 * limits.message_limit + 64))


async def recommend_request(body: RecommendRequest, catalog: Any, engine: RetrievalService, server_cfg: ServerConfig,
                            beam_ctx: Any, beam_width: int) -> tuple[RetrievalRequest, int]:
    """``retrieval_request`` for the server: a text history's chat template and tokenizer, and a history written into
    ``--prompt-template`` (rendered, chat-templated and tokenized, several times while truncating), run on a
    heavy-work thread, never on the event loop."""
    templated = getattr(beam_ctx, "prompt_template", None) is not None and body.history_kind in TEMPLATED_HISTORIES
    if body.history_kind in TEXT_HISTORIES or templated:
        return await off_loop(retrieval_request, body, catalog, engine, server_cfg, beam_ctx, beam_width)
    return retrieval_request(body, catalog, engine, server_cfg, beam_ctx, beam_width)


def create_app(engine: RetrievalService, server_cfg: ServerConfig, metrics: Metrics | None = None,
               edge: EdgeConfig | None = None, reload: CatalogReloadConfig | None = None,
               beams: BeamApiConfig | None = None, model_name: str = "grserve",
               store: StateStore | None = None, popularity: Popularity | None = None) -> FastAPI:
    """The retrieval app around a started (or to-be-started) retrieval engine or cluster front end (the
    ``RetrievalService`` protocol); the caller owns start/stop. ``model_name``: the id the OpenAI routes serve;
    ``store``: where reloads are kept (memory only without one); ``popularity``: the cold-start order (default:
    every item counts 0)."""
    popular = popularity if popularity is not None else Popularity()
    beams = beams or BeamApiConfig()
    limits = text_limits(engine, server_cfg, beams)
    app = new_app(engine, metrics, routes(engine, server_cfg, limits), title="grserve",
                  description="Generative-recommender retrieval: history in, top items by SID beam search out.",
                  detail=lambda: {"catalog": catalog_info(engine.catalogs.current()).model_dump(),
                                  "vocab_size": int(engine.vocab_size)}, edge=edge)
    metrics = app.state.metrics
    metrics.bind_gr_stats(lambda: engine.stats())  # read at scrape time
    app.state.server_cfg = server_cfg
    reloader = CatalogReloader(reload or CatalogReloadConfig(), engine.catalogs, int(engine.vocab_size), store)
    app.state.reloader = reloader
    beam_ctx = BeamContext(engine, server_cfg, beams, model_name, metrics)
    app.include_router(create_beam_router(beam_ctx, app.router.route_class))  # the app's body route class

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=documented(400, 401, 404, 413, 415, 422, 429, 500, 503))
    async def recommend(body: RecommendRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        catalog = engine.catalogs.current()  # one snapshot for the whole conversion
        beam_width = search_knobs(body, engine.search, server_cfg)
        req, dropped = await recommend_request(body, catalog, engine, server_cfg, beam_ctx, beam_width)
        if req.prompt_tokens.size == 0:  # a new user: nothing for the model to answer from (catalog/popularity.py)
            result, source = cold_start(req, catalog, popular), "popularity"
        else:
            result = check_catalog_version(await finish(request, engine, submit(engine, req)), catalog)
            source = "model"
        items = items_out(result)
        metrics.observe_items(len(items))
        return RecommendResponse(
            request_id=body.request_id or req.request_id, items=items, source=source, history_dropped=dropped,
            beam_width=beam_width, thinking=await thought_text(beam_ctx, result),
            catalog_version=int(result.catalog_version),
            timing=Timing(queue_ms=float(result.queue_ms), compute_ms=float(result.compute_ms),
                          total_ms=(time.perf_counter() - t0) * 1000.0),
            batch_size=int(result.batch_size),
            usage=PromptUsage(prompt_tokens=int(req.prompt_tokens.size), cached_tokens=int(result.cached_tokens)))

    @app.post("/v1/catalog", response_model=CatalogReloadResponse, responses=documented(400, 401, 403, 404, 413, 422, 429, 500, 504))
    async def reload_catalog(body: CatalogReloadRequest) -> Any:
        """Admin (``--admin-api-key``): load the catalog file ``name`` from ``--catalog-dir`` and swap it in while
        serving (``catalog_reload.py``: by name, regular files, size limit, deadline, one at a time).
        Requests already converted keep their snapshot; a file that fails to load or does not fit leaves the
        old catalog serving."""
        previous = int(engine.catalogs.current().version)
        catalog = await reloader.reload(body.name)
        log.info("catalog reloaded from %s: version %s -> %s", body.name, previous, catalog.version)
        return CatalogReloadResponse(catalog=catalog_info(catalog), previous_version=previous)

    return app
