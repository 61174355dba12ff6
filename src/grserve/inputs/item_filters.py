"""A ``/v1/recommend`` or OpenAI beam request's item filters: ``exclude_items`` and the allowlist
(``include_items``, ``include_sid_prefix``), checked against the server's bounds. Used by the retrieval app and the
OpenAI beam routes alike (``catalog/exclusion.py`` and ``catalog/allowlist.py`` apply them inside the search)."""

from __future__ import annotations

from typing import Any

import numpy as np

from grserve.catalog.allowlist import Allow
from grserve.config import ServerConfig
from grserve.inputs.refusal import ApiError
from grserve.inputs.house_schemas import RecommendRequest
from grserve.inputs.refusal import INT64_MAX, INT64_MIN


def _at_most(n: int, limit: int, field: str, kind: str) -> None:
    if n > limit:
        raise ApiError(413, f"{field}: {n} items, more than the limit of {limit}", field, kind)


def _int64_ids(values: list[int]) -> np.ndarray:
    """Item ids as int64, those beyond int64 (which no catalog can hold) dropped."""
    return np.asarray([v for v in values if INT64_MIN <= v <= INT64_MAX], dtype=np.int64)


def check_excluded(n: int, server_cfg: ServerConfig) -> None:
    _at_most(n, int(server_cfg.max_exclude_items), "exclude_items", "too_many_excluded")


def excluded_items(body: RecommendRequest, server_cfg: ServerConfig) -> np.ndarray | None:
    """``exclude_items`` as int64 ids (413 over ``--max-exclude-items``). Ids the catalog does not know — and ids
    beyond int64, which no catalog can hold — exclude nothing and are dropped (decided: docs/security.md)."""
    if not body.exclude_items:
        return None
    check_excluded(len(body.exclude_items), server_cfg)
    return _int64_ids(body.exclude_items)


def allowed(body: RecommendRequest, catalog: Any, server_cfg: ServerConfig) -> Allow | None:
    """The request's allowlist (``include_items``, ``include_sid_prefix``) or None: 413 over
    ``--max-include-items``; a prefix longer than the catalog depth or a code outside its level's codebook is a 400.
    Unknown ids allow nothing and are dropped, like ``exclude_items``'."""
    items, prefix = body.include_items, body.include_sid_prefix
    if items is None and prefix is None:
        return None
    if items is not None:
        check_included(len(items), server_cfg)
    if prefix is not None:
        depth, sizes = int(catalog.depth), [int(c) for c in catalog.codebook_sizes]
        if len(prefix) > depth:
            raise ApiError(400, f"include_sid_prefix: {len(prefix)} codes, more than the catalog depth {depth}",
                           "include_sid_prefix", "wrong_depth")
        bad = next((j for j, c in enumerate(prefix) if not 0 <= c < sizes[j]), None)
        if bad is not None:
            raise ApiError(400, f"include_sid_prefix[{bad}]: code {prefix[bad]} is out of range for level {bad} "
                                f"[0, {sizes[bad]})", f"include_sid_prefix[{bad}]", "out_of_range")
    ids = None if items is None else _int64_ids(items)
    return Allow(ids, None if prefix is None else tuple(int(c) for c in prefix))


def check_included(n: int, server_cfg: ServerConfig) -> None:
    _at_most(n, int(server_cfg.max_include_items), "include_items", "too_many_included")


def history_exclusion(body: Any, catalog: Any, prompt: np.ndarray, excluded: np.ndarray | None) -> np.ndarray | None:
    """``excluded`` with, when the request sets ``exclude_history``, the items its history names
    (``catalog/history.py``: ``history_items`` as given, the cut ones too; every item of ``history_sids``; the items
    whose SIDs ``prompt`` — the history as prompt tokens — writes). Not counted against ``--max-exclude-items``: a
    history is bounded by ``--max-history-entries`` and ``--max-prompt-tokens``."""
    if not getattr(body, "exclude_history", False):
        return excluded
    from grserve.catalog.history import items_in_tokens, items_of_sids

    kind = getattr(body, "history_kind", None)
    if kind == "history_items":
        named = _int64_ids(body.history_items)
    elif kind == "history_sids":
        named = items_of_sids(catalog, np.asarray(body.history_sids, dtype=np.int64).reshape(-1, catalog.depth))
    else:
        named = items_in_tokens(catalog, prompt)
    if named.size == 0:
        return excluded
    return named if excluded is None else np.concatenate([excluded, named])
