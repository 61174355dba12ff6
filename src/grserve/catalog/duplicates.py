"""Several items with one SID (an index with collisions): the ``--duplicate-sids`` policy.

- ``refuse`` (the default): a catalog whose SIDs are not unique does not load; the error names the item and line
  (the entry, for an LC-Rec index ``.json``) of both.
- ``popularity``: the trie holds each SID once; the items of a SID form its *group*, ordered by their
  ``--popularity`` count (descending, then item id). A beam that ends on a SID yields the items of its group in
  that order, each naming its own item with the SID's score, until ``top_n`` items (``expand``). The first item of
  a group is the one the search reports (``Catalog.item_ids``); every item's id maps to its SID (histories,
  ``exclude_items``, ``include_items``). ``exclude_items`` removes an item from its group, and masks the SID in the
  search only when every item of the group is excluded; ``include_items`` keeps a group's allowed items only.

Ranking among a group is popularity because a SID model cannot tell the items of one SID apart: the answer is the
model's order of SIDs, and within a SID the prior. Since the search returns ``top_n`` SIDs and each yields at least
one item, the first ``top_n`` items of the expansion are exactly the ``top_n`` best items under that order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .catalog import Catalog

def rows_fully_excluded(catalog: "Catalog", item_ids: np.ndarray) -> np.ndarray:
    """The sorted rows every item of which is in ``item_ids`` (ids the catalog does not know exclude nothing)."""
    ids = np.unique(np.asarray(item_ids, dtype=np.int64).reshape(-1))
    rows, found = catalog._rows_of_items(ids)
    rows = rows[found]
    if catalog.groups is None:
        return np.unique(rows)
    uniq, hit = np.unique(rows, return_counts=True)
    return uniq[hit == catalog.groups.sizes(uniq)]


def expand(catalog: "Catalog", ranked: list[tuple[int, Any]], top_n: int, exclude: np.ndarray | None = None,
           include: np.ndarray | None = None) -> list[tuple[int, Any]]:
    """``(item_id, answer)`` of ranked SIDs (each named by the item the search reports; ``answer``: its SID, score,
    ...) → ``(item_id, answer)`` for every item of each SID in group order, minus ``exclude``, only ``include`` ids
    when given, at most ``top_n``. A catalog without duplicate SIDs returns ``ranked`` as is."""
    if catalog.groups is None:
        return ranked
    out: list[tuple[int, Any]] = []
    ex = None if exclude is None or not len(exclude) else set(np.asarray(exclude, dtype=np.int64).tolist())
    inc = None if include is None else set(np.asarray(include, dtype=np.int64).tolist())
    for item_id, answer in ranked:
        rows, _ = catalog._rows_of_items(np.asarray([item_id], dtype=np.int64))
        for other in catalog.groups.of(int(rows[0])).tolist():
            if (ex is None or other not in ex) and (inc is None or other in inc):
                out.append((int(other), answer))
                if len(out) == top_n:
                    return out
    return out
