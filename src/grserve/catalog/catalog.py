"""The item catalog: item ids, their SIDs, and the trie/masks built from them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .sid_groups import POLICIES, SidGroups
from .errors import CatalogError
from .layout import SidLayout
from .masks import ItemMask
from .trie import PrefixTrie, lex_increasing

if TYPE_CHECKING:
    from .sid_text import SidText


def _first_dup(keys_sorted_eq: np.ndarray, order: np.ndarray) -> tuple[int, int] | None:
    """(row, earlier row) of the first-occurring duplicate, given adjacent-equal flags after a stable sort."""
    pos = np.flatnonzero(keys_sorted_eq) + 1
    if pos.size == 0:
        return None
    i = pos[np.argmin(order[pos])]
    return int(order[i]), int(order[i - 1])


def _as_arrays(item_ids, sids, source: str, fail) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids [n], integer codes [n, depth]: int32 or int64, never copied when already one of those)."""
    n = len(item_ids)
    if n == 0:
        raise CatalogError(f"{source}: catalog is empty")
    if len(sids) != n:
        raise CatalogError(f"{source}: {n} item ids but {len(sids)} SIDs")
    if isinstance(sids, np.ndarray) and sids.ndim == 2:
        arr = sids
    else:
        sids = list(sids)
        depth = len(sids[0])
        for r, s in enumerate(sids):
            if len(s) != depth:
                fail(r, f"SID {tuple(s)} has depth {len(s)}, expected {depth} (from the first item)")
        arr = np.asarray(sids).reshape(n, depth)
    if arr.shape[1] == 0:
        fail(0, "empty SID")
    ids = np.asarray(item_ids)
    if ids.dtype.kind not in "iu" or arr.dtype.kind not in "iu":
        raise CatalogError(f"{source}: item ids and SID codes must be integers")
    ids = ids.astype(np.int64, copy=False).reshape(-1)
    if arr.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        arr = arr.astype(np.int64)
    return ids, np.ascontiguousarray(arr)


def _checked_sizes(arr: np.ndarray, codebook_sizes, source: str, fail) -> tuple[int, ...]:
    """The codebook sizes (given, else max code + 1 per level); every code inside its level's range."""
    depth = arr.shape[1]
    if codebook_sizes is not None and len(codebook_sizes) != depth:
        raise CatalogError(f"{source}: codebook_sizes {tuple(codebook_sizes)} has {len(codebook_sizes)} "
                           f"levels but SIDs have depth {depth}")
    if codebook_sizes is None:
        codebook_sizes = tuple(int(m) + 1 for m in arr.max(axis=0))
    sizes = np.asarray(codebook_sizes, dtype=np.int64)
    bad = (arr < 0).any(axis=1) | (arr >= sizes).any(axis=1)
    if bad.any():
        r = int(np.argmax(bad))
        lvl = int(np.argmax((arr[r] < 0) | (arr[r] >= sizes)))
        fail(r, f"code {int(arr[r, lvl])} at level {lvl} of SID {tuple(arr[r].tolist())} "
                f"is out of range [0, {int(sizes[lvl])})")
    if (sizes > np.iinfo(np.int32).max).any():
        raise CatalogError(f"{source}: codebook sizes must fit in int32")
    return tuple(int(c) for c in codebook_sizes)


class Catalog:
    """Items sorted by SID, with a prefix trie and mask builder. Build with ``from_arrays`` or ``load_catalog``.

    ``text``: how the SIDs are written as tokenizer tokens, when the file said so (``catalog/sid_text.py``); such a
    catalog serves once ``with_layout`` has bound it to the model's tokenizer. ``declared``: the file declared its
    layout (a token offset or SID text), so none is inferred from the tokenizer."""

    def __init__(self, item_ids: np.ndarray, sids: np.ndarray, layout: SidLayout, source: str = "<arrays>",
                 text: SidText | None = None, declared: bool = False, id_order: np.ndarray | None = None,
                 groups: SidGroups | None = None, duplicate_sids: str = "refuse"):
        self.groups = groups  # several items per SID (``duplicates.py``); None: one item per SID
        self.duplicate_sids = duplicate_sids  # the policy it was loaded with (a reload keeps it)
        if groups is not None:  # every item's id maps to its SID's row; the row's first item is the one reported
            item_ids = groups.items[groups.ptr[:-1]]
        self.item_ids = item_ids
        self.sids = sids
        self.layout = layout
        self.source = source
        self.text = text
        self.declared = declared or text is not None
        self.version = 0
        self.trie = PrefixTrie(sids, layout.codebook_sizes)
        self.mask = ItemMask(self.trie)
        if groups is not None:
            order = np.argsort(groups.items, kind="stable")
            self._id_order, self._ids_sorted = groups.row_of[order], groups.items[order]
        else:
            self._id_order = np.argsort(item_ids, kind="stable") if id_order is None else id_order
            self._ids_sorted = item_ids[self._id_order]

    def with_layout(self, layout: SidLayout, text: SidText | None = None) -> "Catalog":
        """The same items (arrays, trie and masks shared, not copied) under another layout of the same shape."""
        if layout.depth != self.depth or layout.codebook_sizes != self.codebook_sizes:
            raise CatalogError(f"{self.source}: layout of depth {layout.depth} / codebooks {layout.codebook_sizes} "
                               f"does not fit SIDs of depth {self.depth} / codebooks {self.codebook_sizes}")
        new = copy.copy(self)
        new.layout, new.version = layout, 0
        if text is not None:
            new.text = text
        return new

    @property
    def depth(self) -> int:
        return self.layout.depth

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        return self.layout.codebook_sizes

    def __len__(self) -> int:
        """The number of SIDs (trie leaves, rows); ``num_items`` counts the items."""
        return int(self.item_ids.size)

    @property
    def num_items(self) -> int:
        return int(self.groups.items.size) if self.groups is not None else len(self)

    def all_items(self) -> tuple[np.ndarray, np.ndarray]:
        """(every item id, its SID), in SID order (a SID's items in group order)."""
        if self.groups is None:
            return self.item_ids, self.sids
        return self.groups.items, self.sids[self.groups.row_of]

    def items_of_rows(self, rows) -> np.ndarray:
        """Every item id of these rows (each SID's items in group order)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if self.groups is None:
            return self.item_ids[rows]
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self.groups.of(int(r)) for r in rows])

    def with_group_order(self, counts_of) -> "Catalog":
        """The same catalog with each SID's items ordered by ``counts_of(item ids)`` descending, then item id
        (itself when every SID has one item)."""
        if self.groups is None:
            return self
        new = copy.copy(self)
        new.groups = self.groups.ordered(counts_of)
        new.item_ids = new.groups.items[new.groups.ptr[:-1]]
        return new

    def __repr__(self) -> str:
        return (f"Catalog({len(self)} items, depth={self.depth}, codebook_sizes={self.codebook_sizes}, "
                f"version={self.version}, source={self.source!r})")

    @classmethod
    def from_arrays(cls, item_ids, sids, codebook_sizes=None, token_offset: int = 16, source: str = "<arrays>",
                    lines: Sequence[int] | np.ndarray | None = None, text: SidText | None = None,
                    declared: bool = False, presorted: bool = False, duplicate_sids: str = "refuse",
                    unit: str = "line") -> "Catalog":
        """Validate, sort by SID and build. ``lines`` gives each row's line number for messages (default 1..N),
        ``unit`` what messages call it ("entry" for an LC-Rec index, whose entries share one line).
        ``presorted``: the rows claim SID order (a ``.grcat`` written by ``save_catalog``); the claim is checked in
        one pass and the sort skipped when it holds (a million-item catalog loads in a few seconds).
        ``duplicate_sids``: "refuse" several items with one SID, or "popularity": group them (``duplicates.py``)."""
        line_of = (lambda r: int(lines[r])) if lines is not None else (lambda r: r + 1)
        if duplicate_sids not in POLICIES:
            raise CatalogError(f"{source}: duplicate_sids must be one of {', '.join(POLICIES)}")

        def fail(row: int, msg: str):
            raise CatalogError(f"{source}: {unit} {line_of(row)}: {msg}")

        ids, arr = _as_arrays(item_ids, sids, source, fail)
        sizes = _checked_sizes(arr, codebook_sizes, source, fail)
        try:
            layout = SidLayout(arr.shape[1], tuple(int(c) for c in sizes), token_offset)
        except ValueError as e:
            raise CatalogError(f"{source}: {e}") from None
        id_order = np.argsort(ids, kind="stable")
        dup = _first_dup(ids[id_order][1:] == ids[id_order][:-1], id_order)
        if dup:
            fail(dup[0], f"duplicate item_id {int(ids[dup[0]])} (also on line {line_of(dup[1])})")
        if presorted and lex_increasing(arr):
            return cls(ids, arr.astype(np.int32, copy=False), layout, source, text, declared, id_order,
                       duplicate_sids=duplicate_sids)
        order = np.lexsort(arr.T[::-1])  # stable, sorts by SID
        s = arr[order]
        dup = _first_dup((s[1:] == s[:-1]).all(axis=1), order)
        if dup and duplicate_sids == "refuse":
            fail(dup[0], f"duplicate SID {tuple(arr[dup[0]].tolist())} of item {int(ids[dup[0]])} "
                         f"(also item {int(ids[dup[1]])} on {unit} {line_of(dup[1])}; --duplicate-sids popularity "
                         "serves every item of a SID)")
        if dup:
            unique, groups = SidGroups.of_sorted(s, ids[order])
            return cls(groups.items[groups.ptr[:-1]], unique.astype(np.int32, copy=False), layout, source, text,
                       declared, groups=groups, duplicate_sids=duplicate_sids)
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)  # row of each input row in SID order: the id order follows it
        return cls(ids[order], s.astype(np.int32, copy=False), layout, source, text, declared, rank[id_order],
                   duplicate_sids=duplicate_sids)

    # --- lookups -------------------------------------------------------------------------------------------

    def _rows_of_items(self, item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.asarray(item_ids, dtype=np.int64).reshape(-1)
        pos = np.minimum(np.searchsorted(self._ids_sorted, q), self._ids_sorted.size - 1)
        found = self._ids_sorted[pos] == q
        return self._id_order[pos], found

    def sid_of(self, item_id: int) -> tuple[int, ...]:
        """SID of one item; KeyError if unknown."""
        rows, found = self._rows_of_items(np.array([item_id]))
        if not found[0]:
            raise KeyError(f"unknown item_id {item_id}")
        return tuple(int(c) for c in self.sids[rows[0]])

    def sids_of_items(self, item_ids) -> np.ndarray:
        """[n, depth] SIDs of many items; KeyError listing up to 5 unknown ids."""
        q = np.asarray(item_ids, dtype=np.int64).reshape(-1)
        rows, found = self._rows_of_items(q)
        if not found.all():
            missing = q[~found]
            raise KeyError(f"{missing.size} unknown item_id(s), e.g. {missing[:5].tolist()}")
        return self.sids[rows]

    def leaves_of_sids(self, sids) -> np.ndarray:
        """Leaf node (= row) of each SID, or -1 if not in the catalog."""
        q = np.asarray(sids, dtype=np.int64)
        if q.ndim == 0 or q.shape[-1] != self.depth:
            raise ValueError(f"SIDs must have depth {self.depth}, got shape {q.shape}")
        q = q.reshape(-1, self.depth)
        nodes = np.zeros(q.shape[0], dtype=np.int64)
        for level in range(self.depth):
            nodes = self.trie.step(level, nodes, q[:, level])
        return nodes

    def item_of_sid(self, sid) -> int:
        """Item id of one SID; KeyError if unknown."""
        if len(sid) != self.depth:
            raise KeyError(f"SID {tuple(sid)} has depth {len(sid)}, catalog depth is {self.depth}")
        leaf = self.trie.lookup(tuple(sid))
        if leaf < 0:
            raise KeyError(f"unknown SID {tuple(sid)}")
        return int(self.item_ids[leaf])

    def items_of_leaves(self, leaf_nodes) -> np.ndarray:
        """Item ids of leaf nodes (leaf node id == row in sorted order)."""
        leaves = np.asarray(leaf_nodes, dtype=np.int64)
        if leaves.size and (leaves.min() < 0 or leaves.max() >= len(self)):
            raise IndexError(f"leaf node out of range [0, {len(self)})")
        return self.item_ids[leaves]

    def contains_sids(self, sids) -> np.ndarray:
        """Bool per SID row: is it an item of this catalog."""
        return self.leaves_of_sids(sids) >= 0
