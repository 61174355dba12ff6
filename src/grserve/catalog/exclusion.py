"""Per-request item exclusion inside the SID beam search (``exclude_items``, e.g. already-seen items).

A trie node is *dead* for a request when every item below it is excluded. The beam step masks a beam's next code
when the child it leads to is dead, on top of the catalog's item mask, so the valid-token mask of every step is
exactly the mask of the catalog without the excluded items: an excluded item is never returned, no beam is spent
on it or on a prefix that leads only to excluded items, and the results equal a search over that smaller catalog
(``tests/grserve/server/test_security_limits.py`` checks it). Built per request against the batch's catalog snapshot:
O(E · depth · log N) for E excluded items; ids the catalog does not know exclude nothing.
"""

from __future__ import annotations

import numpy as np

from .catalog import Catalog
from .duplicates import rows_fully_excluded


class ItemExclusion:
    """The dead trie nodes of one request, per level, as sorted child keys ``parent * C_l + code``."""

    def __init__(self, catalog: Catalog, item_ids: np.ndarray) -> None:
        trie = catalog.trie
        self.codebook_sizes = trie.codebook_sizes
        rows = rows_fully_excluded(catalog, item_ids)  # leaf nodes (= rows in SID order) with no item left
        self.num_excluded = int(rows.size)
        self.dead_keys: list[np.ndarray] = []  # level l: keys of the dead level-(l+1) nodes (sorted)
        nodes = np.zeros(rows.size, dtype=np.int64)
        for level in range(trie.depth):
            nodes = trie.step(level, nodes, catalog.sids[rows, level].astype(np.int64))
            ancestors, excluded = np.unique(nodes, return_counts=True)
            dead = ancestors[excluded == _leaves_below(trie, level + 1, ancestors)]
            self.dead_keys.append(trie.keys[level][dead])

    def kills(self, level: int, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, codes) to mask for beams sitting at level-``level`` trie ``nodes`` (−1: a dead beam)."""
        keys = self.dead_keys[level]
        nodes = np.asarray(nodes, dtype=np.int64).reshape(-1)
        if keys.size == 0 or nodes.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        c = self.codebook_sizes[level]
        lo = np.searchsorted(keys, nodes * c)
        counts = np.where(nodes >= 0, np.searchsorted(keys, nodes * c + c) - lo, 0)
        rows = np.repeat(np.arange(nodes.size, dtype=np.int64), counts)
        idx = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(lo - (np.cumsum(counts) - counts), counts)
        return rows, keys[idx] % c


def _leaves_below(trie, level: int, nodes: np.ndarray) -> np.ndarray:
    """Number of leaves (items) under each level-``level`` node: its children ranges followed down the CSR."""
    lo, hi = nodes.astype(np.int64), nodes.astype(np.int64) + 1
    for k in range(level, trie.depth):
        lo, hi = trie.indptr[k][lo], trie.indptr[k][hi]
    return hi - lo
