"""The item catalog: item ids, their SIDs, and the trie/masks built from them."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

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
                 text: SidText | None = None, declared: bool = False, id_order: np.ndarray | None = None):
        self.item_ids = item_ids
        self.sids = sids
        self.layout = layout
        self.source = source
        self.text = text
        self.declared = declared or text is not None
        self.version = 0
        self.trie = PrefixTrie(sids, layout.codebook_sizes)
        self.mask = ItemMask(self.trie)
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
        return int(self.item_ids.size)

    def __repr__(self) -> str:
        return (f"Catalog({len(self)} items, depth={self.depth}, codebook_sizes={self.codebook_sizes}, "
                f"version={self.version}, source={self.source!r})")

    @classmethod
    def from_arrays(cls, item_ids, sids, codebook_sizes=None, token_offset: int = 16, source: str = "<arrays>",
                    lines: Sequence[int] | np.ndarray | None = None, text: SidText | None = None,
                    declared: bool = False, presorted: bool = False) -> "Catalog":
        """Validate, sort by SID and build. ``lines`` gives each row's line number for messages (default 1..N).
        ``presorted``: the rows claim SID order (a ``.grcat`` written by ``save_catalog``); the claim is checked in
        one pass and the sort skipped when it holds (a million-item catalog loads in a few seconds)."""
        line_of = (lambda r: int(lines[r])) if lines is not None else (lambda r: r + 1)

        def fail(row: int, msg: str):
            raise CatalogError(f"{source}: line {line_of(row)}: {msg}")

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
            return cls(ids, arr.astype(np.int32, copy=False), layout, source, text, declared, id_order)
        order = np.lexsort(arr.T[::-1])  # stable, sorts by SID
        s = arr[order]
        dup = _first_dup((s[1:] == s[:-1]).all(axis=1), order)
        if dup:
            fail(dup[0], f"duplicate SID {tuple(arr[dup[0]].tolist())} "
                         f"(also item {int(ids[dup[1]])} on line {line_of(dup[1])})")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)  # row of each input row in SID order: the id order follows it
        return cls(ids[order], s.astype(np.int32, copy=False), layout, source, text, declared, rank[id_order])

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
