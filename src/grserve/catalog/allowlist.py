"""Per-request allowlists inside the SID beam search (``include_items``, ``include_sid_prefix``): only the allowed
items can be returned.

A trie node is *alive* for a request when some allowed item lies below it. The beam step masks a beam's next code
when the child it leads to is not alive, on top of the catalog's item mask — the same contract as
``ItemExclusion.kills`` (``catalog/exclusion.py``), so ``BeamSearch`` applies either. The valid-token mask of every
step is then exactly the mask of the catalog restricted to the allowed items: nothing else is returned, no beam is
spent outside them, and the results equal a search over that smaller catalog (``tests/grserve/catalog/test_allowlist.py``).

The allowed set is ``include_items`` (ids the catalog does not know allow nothing) ∩ the items whose SID starts with
``include_sid_prefix`` (a semantic category: RQ-KMeans codes are coarse to fine; the items of a prefix are one
contiguous run of the SID-sorted rows) minus ``exclude_items``. Built per request against the batch's catalog
snapshot: O(A · depth) for A allowed items; a step costs O(children of the beams' nodes), like the mask itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .catalog import Catalog
from .duplicates import rows_fully_excluded
from .exclusion import ItemExclusion


@dataclass(frozen=True)
class Allow:
    """What one request allows: item ids and/or a SID prefix (None: no restriction of that kind)."""

    items: np.ndarray | None = None  # int64 item ids
    sid_prefix: tuple[int, ...] | None = None  # codes of the first levels, each inside its codebook


def prefix_rows(catalog: Catalog, prefix: tuple[int, ...]) -> tuple[int, int]:
    """[lo, hi): the SID-sorted rows of the items whose SID starts with ``prefix`` (empty when none does)."""
    trie = catalog.trie
    node = trie.lookup(prefix)
    if node < 0:
        return 0, 0
    lo, hi = node, node + 1
    for level in range(len(prefix), trie.depth):  # down the CSR: the first and past-the-last leaf below the node
        lo, hi = int(trie.indptr[level][lo]), int(trie.indptr[level][hi])
    return lo, hi


def allowed_rows(catalog: Catalog, allow: Allow, exclude: np.ndarray | None = None) -> np.ndarray:
    """The sorted rows (= leaf nodes) of the allowed items."""
    if allow.items is not None:
        rows, found = catalog._rows_of_items(np.asarray(allow.items, dtype=np.int64).reshape(-1))
        rows = np.unique(rows[found])
    else:
        rows = np.arange(len(catalog), dtype=np.int64)
    if allow.sid_prefix is not None:
        lo, hi = prefix_rows(catalog, allow.sid_prefix)
        rows = rows[(rows >= lo) & (rows < hi)]
    if exclude is not None and len(exclude):
        rows = rows[~np.isin(rows, rows_fully_excluded(catalog, exclude))]
    return rows


class ItemAllowlist:
    """The alive trie nodes of one request, per level, as sorted child keys ``parent * C_l + code``."""

    def __init__(self, catalog: Catalog, rows: np.ndarray) -> None:
        trie = catalog.trie
        self.codebook_sizes = trie.codebook_sizes
        self.children = catalog.mask._positions  # (rows, codes) of every catalog child of some nodes
        self.num_allowed = int(rows.size)
        self.alive_keys: list[np.ndarray] = []  # level l: keys of the alive level-(l+1) nodes (sorted)
        nodes = np.zeros(rows.size, dtype=np.int64)
        for level in range(trie.depth):
            nodes = trie.step(level, nodes, catalog.sids[rows, level].astype(np.int64))
            self.alive_keys.append(np.unique(trie.keys[level][nodes]))

    def kills(self, level: int, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, codes) to mask for beams sitting at level-``level`` trie ``nodes`` (−1: a dead beam): every
        catalog child that leads to no allowed item."""
        nodes = np.asarray(nodes, dtype=np.int64).reshape(-1)
        rows, codes = self.children(level, nodes)
        keys = nodes[rows] * self.codebook_sizes[level] + codes
        alive = self.alive_keys[level]
        pos = np.minimum(np.searchsorted(alive, keys), max(alive.size - 1, 0))
        dead = ~(alive[pos] == keys) if alive.size else np.ones(keys.size, dtype=bool)
        return rows[dead], codes[dead]


def item_filter(catalog: Catalog, exclude: np.ndarray | None, allow: Allow | None
                ) -> ItemExclusion | ItemAllowlist | None:
    """The one per-request filter of the beam search: an allowlist (exclusions folded in), else an exclusion,
    else None."""
    if allow is not None and (allow.items is not None or allow.sid_prefix is not None):
        return ItemAllowlist(catalog, allowed_rows(catalog, allow, exclude))
    if exclude is not None and len(exclude):
        return ItemExclusion(catalog, exclude)
    return None
