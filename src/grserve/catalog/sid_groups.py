"""The items of each SID when several items share one (``--duplicate-sids popularity``, ``duplicates.py``): the
policy names and ``SidGroups``, the plain data ``Catalog`` holds (below the catalog; ``duplicates.py`` above it
answers with them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

POLICIES = ("refuse", "popularity")


@dataclass(frozen=True)
class SidGroups:
    """The items of each SID row: ``items[ptr[r]:ptr[r + 1]]`` (best first); ``row_of[k]`` is the row of ``items[k]``."""

    ptr: np.ndarray  # int64 [rows + 1]
    items: np.ndarray  # int64 [items]
    row_of: np.ndarray  # int64 [items]

    @classmethod
    def of_sorted(cls, sorted_sids: np.ndarray, sorted_ids: np.ndarray) -> tuple[np.ndarray, "SidGroups"]:
        """(the unique SIDs, the groups) of SID-sorted rows; a group keeps the rows' order."""
        n = sorted_sids.shape[0]
        starts = np.flatnonzero(np.concatenate([[True], (sorted_sids[1:] != sorted_sids[:-1]).any(axis=1)]))
        ptr = np.append(starts, n).astype(np.int64)
        row_of = np.repeat(np.arange(starts.size, dtype=np.int64), np.diff(ptr))
        return sorted_sids[starts], cls(ptr, sorted_ids.astype(np.int64, copy=False), row_of)

    def sizes(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        return self.ptr[rows + 1] - self.ptr[rows]

    def of(self, row: int) -> np.ndarray:
        return self.items[self.ptr[row]:self.ptr[row + 1]]

    def ordered(self, counts_of: Any) -> "SidGroups":
        """The groups with each one's items by ``counts_of(item ids)`` descending, then item id."""
        counts = np.asarray(counts_of(self.items), dtype=np.int64)
        order = np.lexsort((self.items, -counts, self.row_of))  # by row, then count desc, then id
        return SidGroups(self.ptr, self.items[order], self.row_of)
