"""The catalog items a request's history names: what ``exclude_history`` excludes.

A history given as item ids names those items; one given as SIDs names every item of each SID; one given as prompt
tokens (``history_tokens``, or a text or chat prompt once encoded) names the items whose whole SID is written in it,
``depth`` consecutive tokens, one of each level in order (a level's tokens are its own, so runs never overlap;
``sid_begin`` / ``sid_end`` and any other token between items are skipped). SIDs no catalog item has name nothing.
"""

from __future__ import annotations

import numpy as np

from .catalog import Catalog


def items_of_sids(catalog: Catalog, sids: np.ndarray) -> np.ndarray:
    """int64 ids of the catalog items with these SIDs ([n, depth] codes; unknown SIDs name nothing)."""
    sids = np.asarray(sids, dtype=np.int64).reshape(-1, catalog.depth)
    if sids.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    rows = catalog.leaves_of_sids(sids)
    return catalog.items_of_rows(rows[rows >= 0])


def items_in_tokens(catalog: Catalog, tokens: np.ndarray) -> np.ndarray:
    """int64 ids of the catalog items whose SIDs are written in ``tokens`` (flat prompt token ids)."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    depth, layout = catalog.depth, catalog.layout
    n = tokens.size - depth + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    codes = np.stack([layout.codes_of(level, tokens[level:level + n]) for level in range(depth)], axis=1)
    whole = (codes >= 0).all(axis=1)
    return items_of_sids(catalog, codes[whole])
