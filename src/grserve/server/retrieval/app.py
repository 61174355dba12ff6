"""The GR retrieval app: ``POST /v1/recommend`` (a history in, the top items by SID beam search out), the OpenAI
routes ``POST /v1/chat/completions`` / ``POST /v1/completions`` (a chat or text prompt in, the ranked beams out as
``choices[]``: ``openai_beams.py``) and the admin route ``POST /v1/catalog`` (hot catalog reload); ``/health`` and
``/metrics`` come from the shared app (``app.py``).

A history is given in one of five forms and laid out as prompt tokens here, against one catalog snapshot, so
the engine receives valid ``RetrievalRequest``\\ s only. A ``history_*`` longer than ``--max-prompt-tokens`` keeps its
newest entries that fit (``truncate`` "left", the default; at most ``--max-history-entries`` entries are read) or is
a 413 (``"none"``; a ``prompt`` / ``messages`` is never cut); ``exclude_items`` and the allowlist (``include_items``,
``include_sid_prefix``) are masked inside the search; a history that lays out to no token (a new user, where the
layout has no ``sid_begin`` to start from) is answered from the popularity order (``cold_start``), not by the
engine. Errors: the house convention (``server/http/errors.py``), and OpenAI's shape on the OpenAI routes.

Every route that queues work is hardened alike (issue 25, docs/security.md): admission counts it from the edge on;
its body's cheap length checks come first (``recommend_precheck``, ``beam_prechecks``: histories, ``exclude_items``,
``include_items``, a text prompt's characters and a chat's messages against ``--max-prompt-tokens``), then it is
parsed and validated off the event loop (``bodies.py``); a text history is rendered and tokenized on a heavy-work
thread; the engine's key is the server's own (a client's ``request_id`` is only echoed).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request

from grserve.catalog.allowlist import allowed_rows
from grserve.catalog.duplicates import expand
from grserve.catalog.popularity import Popularity
from grserve.config import BeamApiConfig, CatalogReloadConfig, EdgeConfig, ServerConfig
from grserve.engine.protocol import RetrievalService
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem, json_score
from grserve.server.http.app import new_app
from grserve.server.http.bodies import MAX_BRACKETS, Precheck
from grserve.server.retrieval.catalog_reload import CatalogReloader
from grserve.server.http.errors import ApiError
from grserve.inputs.item_filters import allowed, check_excluded, check_included, excluded_items, \
    history_exclusion
from grserve.server.http.lifecycle import check_catalog_version, finish, submit
from grserve.server.http.metrics import Metrics
from grserve.server.http.offload import off_loop
from grserve.inputs.limits import PromptLimits, PromptTokenLimits
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
from grserve.inputs.refusal import INT64_MAX, INT64_MIN, check_length, int64_in_range, token_ids, unknown_ids
from grserve.state.store import StateStore

log = logging.getLogger("grserve.server")
_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 404, 413, 415, 422, 429, 500, 503)}
_RELOAD_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 403, 404, 413, 422, 429, 500, 504)}
ADMIN_ROUTES = frozenset({("POST", "/v1/catalog")})
TEXT_HISTORIES = frozenset({"prompt", "messages"})  # rendered and tokenized: on a heavy-work thread
TEMPLATED_HISTORIES = frozenset({"history_items", "history_sids"})  # so too with --prompt-template


# ----------------------------------------------------------------------------------------------------------
# history -> prompt tokens
# ----------------------------------------------------------------------------------------------------------
def _too_long(n_tokens: int, max_tokens: int, field: str) -> None:
    check_length(n_tokens, max_tokens, field, "the history (laid out as prompt tokens)", "prompt_too_long")


def dropped_entries(n: int, per_entry: int, max_tokens: int, truncate: str, field: str) -> int:
    """How many of the oldest of ``n`` history entries (``per_entry`` prompt tokens each) are cut so the rest fits
    in ``max_tokens``: 0 when all fit; with ``truncate`` "none" a history that does not fit is a 413 instead."""
    if n * per_entry <= max_tokens:
        return 0
    if truncate == "none":
        _too_long(n * per_entry, max_tokens, field)
    return n - max_tokens // per_entry


def items_to_tokens(catalog: Any, items: list[int], max_tokens: int, truncate: str = "none") -> tuple[np.ndarray, int]:
    """Catalog item ids → their SIDs' tokens (wrapped where the layout wraps items) and the number of oldest items
    cut to fit (every id is looked up, the cut ones too); 404 listing the ids the catalog does not know."""
    dropped = dropped_entries(len(items), _item_tokens(catalog), max_tokens, truncate, "history_items")
    beyond = [k for k, v in enumerate(items) if not INT64_MIN <= v <= INT64_MAX]
    if beyond:  # ids beyond int64 cannot be in the catalog
        raise unknown_ids("history_items", items, beyond, "item id", "unknown_items")
    ids = np.asarray(items, dtype=np.int64)
    try:
        sids = catalog.sids_of_items(ids)
    except KeyError:
        raise unknown_ids("history_items", items, _unknown_positions(catalog, ids), "item id",
                          "unknown_items") from None
    return catalog.layout.items_to_tokens(np.asarray(sids[dropped:], dtype=np.int64)), dropped


def _unknown_positions(catalog: Any, ids: np.ndarray) -> list[int]:
    """Positions in ``ids`` of the ids the catalog does not know (error path only: one lookup per distinct id)."""
    unknown: set[int] = set()
    for v in np.unique(ids).tolist():
        try:
            catalog.sids_of_items(np.asarray([v], dtype=np.int64))
        except KeyError:
            unknown.add(int(v))
    return [k for k, v in enumerate(ids.tolist()) if v in unknown]


def sids_to_tokens(catalog: Any, sids: list[list[int]], max_tokens: int, truncate: str = "none") -> tuple[np.ndarray, int]:
    """SIDs → tokens and the number of oldest SIDs cut to fit (every SID is checked, the cut ones too); 400 for a
    SID of the wrong depth or a code outside its level's codebook."""
    depth = int(catalog.depth)
    sizes = tuple(int(c) for c in catalog.codebook_sizes)
    for i, sid in enumerate(sids):
        if len(sid) != depth:
            raise ApiError(400, f"history_sids[{i}]: a SID has {depth} codes (catalog depth), got {len(sid)}",
                           f"history_sids[{i}]", "wrong_depth")
    dropped = dropped_entries(len(sids), _item_tokens(catalog), max_tokens, truncate, "history_sids")
    if not sids:
        return np.zeros(0, dtype=np.int64), 0
    arr, bad = int64_in_range(sids, 0, np.asarray(sizes, dtype=np.int64))
    if bad is not None:
        i, j = bad
        raise ApiError(400, f"history_sids[{i}][{j}]: code {sids[i][j]} is out of range for level {j} "
                            f"[0, {sizes[j]})", f"history_sids[{i}][{j}]", "out_of_range")
    return catalog.layout.items_to_tokens(arr.reshape(len(sids), depth)[dropped:]), dropped


def history_tokens(body: RecommendRequest, catalog: Any, vocab_size: int, max_tokens: int, beams: Any = None,
                   truncate: str = "none") -> tuple[np.ndarray, int]:
    """The request's history, whichever form it takes, as int64 prompt tokens inside the model vocabulary, ending
    where the beams (or the thought) start: after ``sid_begin`` where the layout has one; and the number of its
    oldest entries cut to fit ``max_tokens`` (``history_*`` with ``truncate`` "left"; "none": 413 instead).
    ``beams``: the OpenAI routes' context (the tokenizer) for ``prompt`` / ``messages``."""
    from grserve.server.retrieval.beams import prompt_tokens
    from grserve.inputs.sid_prompts import beam_start

    kind, dropped = body.history_kind, 0
    template = getattr(beams, "prompt_template", None)
    if template is not None and kind in ("history_items", "history_sids") and getattr(body, kind):
        prompt, dropped = templated_tokens(body, catalog, template, beams.tokenizer, max_tokens, truncate)
    elif kind in ("prompt", "messages"):
        prompt = prompt_tokens(beams, catalog, body.prompt, body.messages)
        _too_long(int(prompt.size), max_tokens, kind)
    elif kind == "history_items":
        prompt, dropped = items_to_tokens(catalog, body.history_items, max_tokens, truncate)  # type: ignore[arg-type]
    elif kind == "history_sids":
        prompt, dropped = sids_to_tokens(catalog, body.history_sids, max_tokens, truncate)  # type: ignore[arg-type]
    else:
        raw: list[int] = body.history_tokens  # type: ignore[assignment]
        dropped = dropped_entries(len(raw), 1, max_tokens, truncate, "history_tokens")
        prompt = token_ids(raw, vocab_size, "history_tokens")[dropped:]
    prompt = np.ascontiguousarray(prompt, dtype=np.int64).reshape(-1)
    if kind != "history_tokens":
        prompt = beam_start(prompt.tolist(), catalog.layout, body.max_think_tokens > 0)
    if prompt.size > 0 and int(prompt.max()) >= vocab_size:  # catalog layout vs model vocab
        raise ApiError(400, f"{kind}: the history maps to token {int(prompt.max())}, outside the model "
                            f"vocabulary of {vocab_size}", kind, "out_of_range")
    return prompt, dropped


def templated_tokens(body: RecommendRequest, catalog: Any, template: Any, tokenizer: Any, max_tokens: int,
                     truncate: str) -> tuple[np.ndarray, int]:
    """A ``history_items`` / ``history_sids`` written into ``--prompt-template`` and encoded
    (``inputs/prompt_template.py``), and the number of its oldest entries cut: first as the bare layout would
    cut them (every entry checked as there), then more while the rendered prompt is over ``max_tokens``
    (``truncate`` "none": 413)."""
    from grserve.inputs.sid_prompts import item_text

    kind = body.history_kind
    if kind == "history_items":
        ids: list[int] | None = body.history_items
        _, dropped = items_to_tokens(catalog, ids, max_tokens, truncate)  # type: ignore[arg-type]
        sids = catalog.sids_of_items(np.asarray(ids[dropped:], dtype=np.int64))  # type: ignore[index]
    else:
        ids = None
        _, dropped = sids_to_tokens(catalog, body.history_sids, max_tokens, truncate)  # type: ignore[arg-type]
        sids = np.asarray(body.history_sids, dtype=np.int64).reshape(-1, int(catalog.depth))[dropped:]
    texts = [item_text(catalog, tuple(int(c) for c in s)) for s in sids]
    first = dropped

    def render(k: int) -> list[int]:  # the prompt of the entries from k on
        return template.token_ids(tokenizer, texts[k - first:], None if ids is None else ids[k:])

    prompt = render(dropped)
    if len(prompt) > max_tokens:
        if truncate == "none":
            _too_long(len(prompt), max_tokens, kind)
        base = len(render(first + len(texts)))  # the template without items
        _too_long(base, max_tokens, kind)  # the template alone is longer than the limit
        while len(prompt) > max_tokens:  # cut by the items' measured cost, then take back what still fits
            per_item = max(1.0, (len(prompt) - base) / max(1, first + len(texts) - dropped))
            dropped = min(first + len(texts), dropped + max(1, int(-(-(len(prompt) - max_tokens) // per_item))))
            prompt = render(dropped)
        while dropped > first and len(again := render(dropped - 1)) <= max_tokens:
            dropped, prompt = dropped - 1, again
    return np.asarray(prompt, dtype=np.int64), dropped


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


def recommend_think(body: RecommendRequest, catalog: Any, beams: Any) -> Any:
    """A /v1/recommend request's ``ThinkSpec`` (greedy) when ``max_think_tokens`` > 0, checked like the OpenAI
    routes' (the server limit, a layout with ``sid_begin``)."""
    from grserve.server.retrieval.beams import think_spec

    return think_spec(beams, body.max_think_tokens, catalog.layout)


def _item_tokens(catalog: Any) -> int:
    """Prompt tokens of one history item: its SID, wrapped where the layout wraps items."""
    layout = catalog.layout
    return int(catalog.depth) + (layout.sid_begin is not None) + (layout.sid_end is not None)


def items_out(result: RetrievalResult) -> list[ItemOut]:
    """The answer's items (a non-finite score, which JSON cannot carry, as -1e30)."""
    return [ItemOut(item_id=int(it.item_id), sid=[int(c) for c in it.sid],
                    score=json_score(it.score)) for it in result.items]


def catalog_info(catalog: Any) -> CatalogInfo:
    return CatalogInfo(num_items=catalog.num_items, version=int(catalog.version), depth=int(catalog.depth),
                       codebook_sizes=[int(c) for c in catalog.codebook_sizes])


def _history_precheck(raw: dict, name: str, tokens_each: int, server_cfg: ServerConfig) -> None:
    """A raw ``history_*`` list's cheap bound: with truncation (the request's ``truncate``, else the server's) at
    most ``--max-history-entries`` entries; without, at most ``--max-prompt-tokens`` as prompt tokens (413)."""
    n = len(raw[name])
    truncate = raw.get("truncate") if raw.get("truncate") in ("left", "none") else server_cfg.truncate
    if truncate == "none":
        _too_long(n * tokens_each, int(server_cfg.max_prompt_tokens), name)
    elif n > server_cfg.max_history_entries:
        raise ApiError(413, f"{name}: {n} entries, more than the limit of {server_cfg.max_history_entries} "
                            f"(--max-history-entries; the newest that fit in --max-prompt-tokens are used)", name,
                       "history_too_long")

def text_limits(engine: RetrievalService, server_cfg: ServerConfig, beams: BeamApiConfig) -> PromptTokenLimits:
    """The cheap bounds of a text history and of the OpenAI beam routes' prompts (``openai_limits.py``):
    ``--max-prompt-tokens`` x the model tokenizer's longest token in characters (no character bound without a
    tokenizer: text is refused anyway), messages and content parts at most ``--max-chat-messages``."""
    tok = getattr(engine, "tokenizer", None)
    return PromptTokenLimits(int(server_cfg.max_prompt_tokens), getattr(tok, "max_token_chars", None),
                             int(beams.max_chat_messages))


def max_brackets(server_cfg: ServerConfig, limits: PromptLimits) -> int:
    """The app's bound on a body's ``[`` + ``{`` bytes (``bodies.py``): a SID is a list, so more than
    ``--max-prompt-tokens`` of them is too long anyway; with a tokenizer, text may quote brackets too — as many as
    the prompt's characters and a chat's containers (at most the LLM server's ``MAX_BRACKETS``)."""
    bound = max(int(server_cfg.max_prompt_tokens), int(server_cfg.max_history_entries)) + 64
    if limits.max_chars is None:
        return bound
    return max(bound, min(MAX_BRACKETS, limits.max_chars + 3 * limits.message_limit + 64))


def _excluded_precheck(raw: dict, server_cfg: ServerConfig) -> None:
    if isinstance(raw.get("exclude_items"), list):
        check_excluded(len(raw["exclude_items"]), server_cfg)
    if isinstance(raw.get("include_items"), list):
        check_included(len(raw["include_items"]), server_cfg)


def recommend_precheck(engine: RetrievalService, server_cfg: ServerConfig,
                       limits: PromptLimits | None = None) -> Precheck:
    """The cheap length checks of ``/v1/recommend`` on its raw JSON (``bodies.py``: before it is validated): the
    history as prompt tokens (a SID or an item lays out to ``depth`` tokens), a text history's characters and
    messages (``limits``), and ``exclude_items``."""

    def check(raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        depth = int(engine.catalogs.current().depth)
        for name, tokens_each in (("history_tokens", 1), ("history_items", depth), ("history_sids", depth)):
            if isinstance(raw.get(name), list):
                _history_precheck(raw, name, tokens_each, server_cfg)
        if limits is not None:
            if isinstance(raw.get("prompt"), str):
                limits.check_text("prompt", len(raw["prompt"]))
            limits.check_messages(raw.get("messages"))
        _excluded_precheck(raw, server_cfg)

    return check


def beam_prechecks(limits: PromptLimits, server_cfg: ServerConfig) -> dict[str, Precheck]:
    """The cheap length checks of the OpenAI beam routes, by path: ``/v1/completions``' prompt (its characters, or
    its token ids), ``/v1/chat/completions``' messages, and both routes' ``exclude_items``."""

    def completion(raw: Any) -> None:
        if isinstance(raw, dict):
            limits.check_prompt(raw.get("prompt"))
            _excluded_precheck(raw, server_cfg)

    def chat(raw: Any) -> None:
        if isinstance(raw, dict):
            limits.check_messages(raw.get("messages"))
            _excluded_precheck(raw, server_cfg)

    return {"/v1/completions": completion, "/v1/chat/completions": chat}


# ----------------------------------------------------------------------------------------------------------
# the app
# ----------------------------------------------------------------------------------------------------------
def retrieval_request(body: RecommendRequest, catalog: Any, engine: RetrievalService, server_cfg: ServerConfig,
                      beam_ctx: Any, beam_width: int | None = None) -> tuple[RetrievalRequest, int]:
    """The engine request of a ``/v1/recommend`` body against one catalog snapshot, and the number of history
    entries ``truncate`` cut (``ApiError`` naming the field otherwise). Also the offline API's conversion
    (``grserve.recommender``), so both take exactly the same inputs."""
    if beam_width is None:
        beam_width = _search_knobs(body, engine.search, server_cfg)
    think, excluded = recommend_think(body, catalog, beam_ctx), excluded_items(body, server_cfg)  # cheap first
    include = allowed(body, catalog, server_cfg)
    prompt, dropped = history_tokens(body, catalog, int(engine.vocab_size), int(server_cfg.max_prompt_tokens),
                                     beam_ctx, body.truncate or server_cfg.truncate)
    # the engine's key (its cancel key) is the server's own: a client's request_id is only echoed, so a client
    # that reuses another's id and disconnects cancels nothing but its own request
    excluded = history_exclusion(body, catalog, prompt, excluded)
    req = RetrievalRequest(prompt_tokens=prompt, beam_width=beam_width, top_n=body.top_n, exclude_items=excluded,
                           include=include, think=think)
    return req, dropped


async def recommend_request(body: RecommendRequest, catalog: Any, engine: RetrievalService, server_cfg: ServerConfig,
                            beam_ctx: Any, beam_width: int) -> tuple[RetrievalRequest, int]:
    """``retrieval_request`` for the server: a text history's chat template and tokenizer, and a history written into
    ``--prompt-template`` (rendered, chat-templated and tokenized, several times while truncating), run on a
    heavy-work thread, never on the event loop."""
    templated = getattr(beam_ctx, "prompt_template", None) is not None and body.history_kind in TEMPLATED_HISTORIES
    if body.history_kind in TEXT_HISTORIES or templated:
        return await off_loop(retrieval_request, body, catalog, engine, server_cfg, beam_ctx, beam_width)
    return retrieval_request(body, catalog, engine, server_cfg, beam_ctx, beam_width)


def cold_start(req: RetrievalRequest, catalog: Any, popular: Popularity) -> RetrievalResult:
    """The answer to a history with no prompt token: the ``top_n`` most popular catalog items the request may get
    (``exclude_items`` never, only its allowlist's when it has one; ``catalog/popularity.py``); computed here, the
    engine is not asked."""
    t0 = time.perf_counter()
    if req.include is not None:  # the allowlist, exclusions folded in, as item ids of this snapshot
        top = popular.top(catalog, req.top_n, include=catalog.item_ids[allowed_rows(catalog, req.include,
                                                                                    req.exclude_items)])
    else:
        top = popular.top(catalog, req.top_n, req.exclude_items)
    ranked = [(int(i), (tuple(int(c) for c in sid), float(score))) for i, sid, score in zip(top.item_ids, top.sids,
                                                                                            top.scores)]
    include = req.include.items if req.include is not None else None
    items = [RetrievedItem(i, sid, score)
             for i, (sid, score) in expand(catalog, ranked, req.top_n, req.exclude_items, include)]
    return RetrievalResult(req.request_id, items, compute_ms=(time.perf_counter() - t0) * 1e3, batch_size=0,
                           catalog_version=int(catalog.version))


def create_app(engine: RetrievalService, server_cfg: ServerConfig, metrics: Metrics | None = None,
               edge: EdgeConfig | None = None, reload: CatalogReloadConfig | None = None,
               beams: BeamApiConfig | None = None, model_name: str = "grserve",
               store: StateStore | None = None, popularity: Popularity | None = None) -> FastAPI:
    """The retrieval app around a started (or to-be-started) retrieval engine or cluster front end (the
    ``RetrievalService`` protocol); the caller owns start/stop. ``model_name``: the id the OpenAI routes serve;
    ``store``: where reloads are kept (memory only without one); ``popularity``: the cold-start order (default:
    every item counts 0)."""
    from grserve.server.retrieval.beams import OPENAI_BEAM_PATHS, BeamContext, create_beam_router, thought_text

    popular = popularity if popularity is not None else Popularity()
    queued = frozenset({("POST", "/v1/recommend"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")})
    beams = beams or BeamApiConfig()
    limits = text_limits(engine, server_cfg, beams)
    checks = {"/v1/recommend": recommend_precheck(engine, server_cfg, limits), **beam_prechecks(limits, server_cfg)}
    app = new_app(engine, metrics, title="grserve",
                  description="Generative-recommender retrieval: history in, top items by SID beam search out.",
                  groups=("history",), detail=lambda: {"catalog": catalog_info(engine.catalogs.current()).model_dump(),
                                                       "vocab_size": int(engine.vocab_size)},
                  edge=edge, admin_routes=ADMIN_ROUTES, queued_routes=queued, openai_paths=OPENAI_BEAM_PATHS,
                  prechecks=checks, max_brackets=max_brackets(server_cfg, limits))
    metrics = app.state.metrics
    metrics.bind_gr_stats(lambda: engine.stats())  # read at scrape time
    app.state.server_cfg = server_cfg
    reloader = CatalogReloader(reload or CatalogReloadConfig(), engine.catalogs, int(engine.vocab_size), store)
    app.state.reloader = reloader
    beam_ctx = BeamContext(engine, server_cfg, beams, model_name, metrics)
    app.include_router(create_beam_router(beam_ctx, app.router.route_class))  # the app's body route class

    @app.post("/v1/recommend", response_model=RecommendResponse, responses=_ERRORS)
    async def recommend(body: RecommendRequest, request: Request) -> Any:
        t0 = time.perf_counter()
        catalog = engine.catalogs.current()  # one snapshot for the whole conversion
        beam_width = _search_knobs(body, engine.search, server_cfg)
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

    @app.post("/v1/catalog", response_model=CatalogReloadResponse, responses=_RELOAD_ERRORS)
    async def reload_catalog(body: CatalogReloadRequest) -> Any:
        """Admin (``--admin-api-key``): load the catalog file ``name`` from ``--catalog-dir`` and swap it in while
        serving (``server/retrieval/catalog_reload.py``: by name, regular files, size limit, deadline, one at a time).
        Requests already converted keep their snapshot; a file that fails to load or does not fit leaves the
        old catalog serving."""
        previous = int(engine.catalogs.current().version)
        catalog = await reloader.reload(body.name)
        log.info("catalog reloaded from %s: version %s -> %s", body.name, previous, catalog.version)
        return CatalogReloadResponse(catalog=catalog_info(catalog), previous_version=previous)

    return app
