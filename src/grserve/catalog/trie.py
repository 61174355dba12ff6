"""Prefix trie over sorted SIDs, stored as per-level sorted key arrays (CSR)."""

from __future__ import annotations

import numpy as np


def lex_increasing(sids: np.ndarray) -> bool:
    """Rows strictly increasing in lexicographic order (sorted and unique), in one pass."""
    if sids.shape[0] < 2:
        return True
    ne = sids[1:] != sids[:-1]
    col = np.argmax(ne, axis=1)
    r = np.arange(sids.shape[0] - 1)
    return bool(ne[r, col].all() and (sids[1:][r, col] > sids[:-1][r, col]).all())


class PrefixTrie:
    """Trie of SID prefixes.

    Nodes of level l are the distinct prefixes of length l (level 0: only the root, node 0), numbered in
    sorted order; leaf nodes (level depth) equal row indices of the sorted ``sids``. Per level l:
    ``keys[l]`` = sorted parent * C_l + code of every child (index = child node id),
    ``codes[l]`` = keys[l] % C_l, ``indptr[l]`` = CSR offsets of each level-l node's children.
    """

    def __init__(self, sids: np.ndarray, codebook_sizes: tuple[int, ...]):
        sids = np.asarray(sids)
        if sids.dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
            sids = sids.astype(np.int64)
        if sids.ndim != 2 or sids.shape[1] != len(codebook_sizes):
            raise ValueError(f"sids must be [N, {len(codebook_sizes)}], got shape {sids.shape}")
        n, depth = sids.shape
        self.depth = depth
        self.codebook_sizes = tuple(int(c) for c in codebook_sizes)
        if n > 1:
            ne = sids[1:] != sids[:-1]
            diff = np.logical_or.accumulate(ne, axis=1)  # prefix of length l+1 changed
            col = np.argmax(ne, axis=1)
            r = np.arange(n - 1)
            if not (diff[:, -1].all() and (sids[1:][r, col] > sids[:-1][r, col]).all()):
                raise ValueError("sids must be sorted lexicographically and unique")
        else:
            diff = np.zeros((0, depth), dtype=bool)
        self.keys: list[np.ndarray] = []
        self.codes: list[np.ndarray] = []
        self.indptr: list[np.ndarray] = []
        parent = np.zeros(n, dtype=np.int64)  # node id of each row's level-l prefix
        num_parents = 1 if n else 0
        for level in range(depth):
            c = self.codebook_sizes[level]
            new = np.ones(n, dtype=bool)
            new[1:] = diff[:, level]
            first = np.flatnonzero(new)
            keys = parent[first] * c + sids[first, level]
            self.keys.append(keys)
            self.codes.append(keys % c)
            self.indptr.append(np.searchsorted(parent[first], np.arange(num_parents + 1)).astype(np.int64))
            parent = np.cumsum(new) - 1
            num_parents = first.size

    def num_nodes(self, level: int) -> int:
        """Number of nodes at a level (0..depth)."""
        return 1 if level == 0 else int(self.keys[level - 1].size)

    def step(self, level: int, nodes: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """Child node id (level+1) of each (node, code), or -1 if absent; -1 nodes stay -1."""
        nodes = np.asarray(nodes, dtype=np.int64)
        codes = np.asarray(codes, dtype=np.int64)
        c = self.codebook_sizes[level]
        keys = self.keys[level]
        key = nodes * c + codes
        idx = np.searchsorted(keys, key)
        ok = (nodes >= 0) & (codes >= 0) & (codes < c) & (idx < keys.size)
        ok[ok] = keys[idx[ok]] == key[ok]
        return np.where(ok, idx, -1)

    def children(self, level: int, node: int) -> np.ndarray:
        """Sorted codes of a node's children."""
        ptr = self.indptr[level]
        return self.codes[level][ptr[node]:ptr[node + 1]]

    def num_children(self, level: int, nodes: np.ndarray) -> np.ndarray:
        """Child counts per node (0 for -1)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        ptr = self.indptr[level]
        safe = np.where(nodes >= 0, nodes, 0)
        return np.where(nodes >= 0, ptr[safe + 1] - ptr[safe], 0)

    def lookup(self, prefix) -> int:
        """Node id of a prefix (at level len(prefix)), or -1."""
        node = np.zeros(1, dtype=np.int64)
        if len(prefix) > self.depth:
            return -1
        for level, code in enumerate(prefix):
            node = self.step(level, node, np.array([code], dtype=np.int64))
        return int(node[0])
