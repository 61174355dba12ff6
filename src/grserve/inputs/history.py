"""A recommendation request's history → prompt tokens, against one catalog snapshot, so the engine receives valid
``RetrievalRequest``\\ s only.

A history comes in one of five forms (``history_items``, ``history_sids``, ``history_tokens``, a text ``prompt``,
chat ``messages``). A ``history_*`` longer than ``--max-prompt-tokens`` keeps its newest entries that fit
(``truncate`` "left", the default; at most ``--max-history-entries`` entries are read: ``history_precheck``) or is a
413 (``"none"``; a ``prompt`` / ``messages`` is never cut); ``--prompt-template`` writes ``history_items`` /
``history_sids`` into a text prompt (``templated_tokens``). A history that lays out to no token (a new user, where
the layout has no ``sid_begin`` to start from) is answered from the popularity order (``cold_start``), not by the
engine. Used alike by the retrieval server and the offline ``Recommender``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from grserve.catalog.allowlist import allowed_rows
from grserve.catalog.duplicates import expand
from grserve.catalog.popularity import Popularity
from grserve.config import ServerConfig
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.inputs.house_schemas import RecommendRequest
from grserve.inputs.refusal import INT64_MAX, INT64_MIN, ApiError, check_length, int64_in_range, token_ids, \
    unknown_ids
from grserve.inputs.sid_prompts import beam_start, item_text, prompt_tokens


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


def _item_tokens(catalog: Any) -> int:
    """Prompt tokens of one history item: its SID, wrapped where the layout wraps items."""
    layout = catalog.layout
    return int(catalog.depth) + (layout.sid_begin is not None) + (layout.sid_end is not None)


def history_precheck(raw: dict, name: str, tokens_each: int, server_cfg: ServerConfig) -> None:
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
