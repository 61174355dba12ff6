"""The catalog's prefix trie as device tensors, so a beam step masks and advances beams with no host round trip.

xGR §6.1 keeps the first-level mask dense and the deeper ones sparse. Here:

* level 0 (**dense**): ``first_mask`` [C_0] (0 valid / −inf) and ``first_child`` [C_0] (the level-1 node id of
  each first code, −1 when no item starts with it);
* level l ≥ 1 (**sparse**, the trie's own CSR): ``indptr[l]`` [nodes_l + 1] and ``codes[l]`` [children]; a node's
  children are the contiguous range ``indptr[n] .. indptr[n+1]`` of sorted codes, and the child node id of the
  j-th child is ``indptr[n] + j`` (``PrefixTrie`` numbers nodes in sorted order). ``max_children[l]`` is the
  widest fan-out of the level: the fixed width of every gathered child row.

``children(level, nodes)`` returns, for a beam sitting at trie node ``nodes[i]`` (−1: dead), the padded row of its
child codes, their node ids and a validity mask, all of fixed shape [B, max_children[level]].
"""

from __future__ import annotations

import numpy as np
import torch

from grserve.catalog import Catalog


class DeviceTrie:
    def __init__(self, catalog: Catalog, device: torch.device | str = "cpu"):
        trie = catalog.trie
        self.depth = trie.depth
        self.sizes = tuple(trie.codebook_sizes)
        i64 = torch.int64
        c0 = self.sizes[0]
        first_child = np.full(c0, -1, dtype=np.int64)
        first_child[trie.codes[0]] = np.arange(trie.codes[0].size)
        self.first_child = torch.from_numpy(first_child).to(device)
        mask = np.where(first_child >= 0, 0.0, -np.inf).astype(np.float32)
        self.first_mask = torch.from_numpy(mask).to(device)
        self.indptr: list[torch.Tensor | None] = [None]
        self.codes: list[torch.Tensor | None] = [None]
        self.max_children: list[int] = [c0]
        for level in range(1, self.depth):
            ptr = trie.indptr[level]
            self.indptr.append(torch.from_numpy(ptr.astype(np.int64)).to(device))
            codes = trie.codes[level]
            # one padding entry so a clamped gather index is always in range (an empty level cannot occur)
            self.codes.append(torch.from_numpy(np.append(codes, 0).astype(np.int64)).to(device))
            self.max_children.append(max(1, int(np.diff(ptr).max(initial=1))))
        self._steps = [torch.arange(w, dtype=i64, device=device) for w in self.max_children]

    def children(self, level: int, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """nodes int64 [B] (level-``level`` node ids, −1 dead) → (codes, child nodes, valid), each [B, W_level].

        Invalid slots hold code 0 and node −1. Fixed shapes, no host synchronisation (graph-capturable)."""
        ptr, codes = self.indptr[level], self.codes[level]
        alive = nodes >= 0
        safe = torch.where(alive, nodes, torch.zeros_like(nodes))
        start = ptr[safe]
        count = torch.where(alive, ptr[safe + 1] - start, torch.zeros_like(start))
        j = self._steps[level]
        valid = j[None, :] < count[:, None]
        idx = start[:, None] + j[None, :]
        idx = torch.where(valid, idx, torch.full_like(idx, codes.shape[0] - 1))
        child_codes = torch.where(valid, codes[idx], torch.zeros_like(idx))
        child_nodes = torch.where(valid, idx, torch.full_like(idx, -1))
        return child_codes, child_nodes, valid
