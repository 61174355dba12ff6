"""Item popularity: the cold-start answer of ``/v1/recommend`` (a request whose history lays out to no prompt token,
e.g. a new user's empty ``history_items``).

A decoder-only GR model reads its first SID token off the last prompt position, so with no prompt token there is
nothing for it to answer from (the models grserve trains have no start token). Such a request is answered from
the popularity order instead, and the response says so (``"source": "popularity"``).

The counts come from a JSON file, ``{"<item id>": count, ...}`` (``--popularity FILE``; the MovieLens recipe writes
the training split's interaction counts, ``grserve.movielens``). Items the file does not list count 0; without a
file every item counts 0. Order: count descending, then item id ascending. Score: the log of the item's add-one
smoothed share among the catalog's items, ``log((c_i + 1) / (Σ c + N))`` (a log-probability, like the model's
scores; ``log(1/N)`` for every item without counts). The order is built once per catalog snapshot; a request
then costs O(top_n + excluded) (O(k log k) with an allowlist of k items).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .catalog import Catalog
from .duplicates import rows_fully_excluded
from .errors import CatalogError


@dataclass(frozen=True)
class PopularItems:
    item_ids: np.ndarray  # int64 [n], best first
    sids: np.ndarray  # [n, depth]
    scores: np.ndarray  # float64 [n], log-share (see the module docstring)


@dataclass(frozen=True)
class _Ranking:
    catalog: Catalog
    order: np.ndarray  # catalog rows, best first
    rank: np.ndarray  # rank[row] = position of that row in ``order``
    scores: np.ndarray  # per catalog row


class Popularity:
    """Interaction counts per item id; ``top(catalog, n, ...)`` is the popularity answer against one snapshot."""

    def __init__(self, counts: dict[int, int] | None = None, source: str = "<none>") -> None:
        counts = counts or {}
        self.source = source
        self.item_ids = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        self.counts = np.fromiter(counts.values(), dtype=np.int64, count=len(counts))
        self._lock = threading.Lock()
        self._ranking: _Ranking | None = None

    @property
    def known(self) -> bool:
        """Some item has a count (a popularity file was given and lists items)."""
        return bool(self.counts.size and self.counts.max() > 0)

    @classmethod
    def load(cls, path: str | Path) -> "Popularity":
        """Read ``{"<item id>": count}``; ``CatalogError`` naming the file and the first bad entry."""
        path = Path(path)
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CatalogError(f"{path}: cannot read a popularity file ({type(e).__name__}: {e})") from None
        if not isinstance(obj, dict):
            raise CatalogError(f"{path}: a popularity file is a JSON object {{\"<item id>\": count, ...}}")
        counts: dict[int, int] = {}
        for key, value in obj.items():
            try:
                item = int(key)
            except ValueError:
                raise CatalogError(f"{path}: key {key[:40]!r} is not an integer item id") from None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2 ** 62:
                raise CatalogError(f"{path}: the count of item {item} must be a non-negative integer")
            if not -2 ** 63 <= item < 2 ** 63:
                raise CatalogError(f"{path}: item id {item} is outside the int64 range")
            counts[item] = value
        return cls(counts, str(path))

    @classmethod
    def from_items(cls, item_ids) -> "Popularity":
        """Counts of the ids in an interaction log (e.g. every training event's item)."""
        ids, counts = np.unique(np.asarray(item_ids, dtype=np.int64), return_counts=True)
        return cls(dict(zip(ids.tolist(), counts.tolist())), "<interactions>")

    def save(self, path: str | Path) -> None:
        order = np.lexsort((self.item_ids, -self.counts))
        body = {str(int(self.item_ids[i])): int(self.counts[i]) for i in order}
        Path(path).write_text(json.dumps(body) + "\n", encoding="utf-8")

    def ranking(self, catalog: Catalog) -> _Ranking:
        """The catalog's rows in popularity order, with their scores (built once per catalog snapshot)."""
        cached = self._ranking
        if cached is not None and cached.catalog is catalog:
            return cached
        with self._lock:
            n = len(catalog)
            per_row = np.zeros(n, dtype=np.int64)
            if self.item_ids.size:
                rows, found = catalog._rows_of_items(self.item_ids)
                per_row[rows[found]] = self.counts[found]
            order = np.lexsort((catalog.item_ids, -per_row))
            rank = np.empty(n, dtype=np.int64)
            rank[order] = np.arange(n)
            total = float(per_row.sum()) + n
            scores = np.log((per_row + 1.0) / total)
            self._ranking = _Ranking(catalog, order, rank, scores)
            return self._ranking

    def top(self, catalog: Catalog, n: int, exclude: np.ndarray | None = None,
            include: np.ndarray | None = None) -> PopularItems:
        """The ``n`` most popular catalog items, never an ``exclude`` id, only ``include`` ids when given (ids the
        catalog does not know are ignored in both)."""
        r = self.ranking(catalog)
        if include is not None:
            rows, found = catalog._rows_of_items(np.asarray(include, dtype=np.int64))
            candidates = np.unique(rows[found])
            candidates = candidates[np.argsort(r.rank[candidates], kind="stable")]
        else:
            extra = 0 if exclude is None else int(np.asarray(exclude).size)
            candidates = r.order[: n + extra]
        if exclude is not None and len(exclude):
            candidates = candidates[~np.isin(candidates, rows_fully_excluded(catalog, exclude))]
        rows = candidates[:n]
        return PopularItems(catalog.item_ids[rows], catalog.sids[rows], r.scores[rows])

    def counts_of(self, item_ids: np.ndarray) -> np.ndarray:
        """The count of each id (0 for ids the file does not list)."""
        q = np.asarray(item_ids, dtype=np.int64)
        if self.item_ids.size == 0:
            return np.zeros(q.shape, dtype=np.int64)
        order = np.argsort(self.item_ids)
        pos = np.minimum(np.searchsorted(self.item_ids[order], q), order.size - 1)
        return np.where(self.item_ids[order][pos] == q, self.counts[order][pos], 0)

