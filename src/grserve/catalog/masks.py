"""Additive token masks (0 = valid, -inf = invalid) over one level's codebook, from a PrefixTrie."""

from __future__ import annotations

import numpy as np
import torch

from .trie import PrefixTrie


class ItemMask:
    """Builds valid-next-code masks for beams sitting at trie nodes.

    ``fill``/``undo`` do sparse writes into a reused all -inf buffer; ``dense`` builds a fresh mask.
    """

    def __init__(self, trie: PrefixTrie, dtype: torch.dtype = torch.float32):
        self.trie = trie
        self.dtype = dtype
        self.first_level = self.dense(0, np.zeros(1, dtype=np.int64))[0]

    def _positions(self, level: int, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, codes) of every valid (beam, child code) pair, without a loop over rows."""
        nodes = np.asarray(nodes, dtype=np.int64).reshape(-1)
        ptr = self.trie.indptr[level]
        safe = np.where(nodes >= 0, nodes, 0)
        starts = ptr[safe]
        counts = np.where(nodes >= 0, ptr[safe + 1] - starts, 0)
        total = int(counts.sum())
        rows = np.repeat(np.arange(nodes.size, dtype=np.int64), counts)
        # index into codes[level]: start of the row's range + position within the range
        idx = np.arange(total, dtype=np.int64) + np.repeat(starts - (np.cumsum(counts) - counts), counts)
        return rows, self.trie.codes[level][idx]

    def fill(self, level: int, nodes: np.ndarray, out: torch.Tensor):
        """Write 0 at valid (row, code) of ``out`` [B, C_level] (all -inf on entry); return an undo handle."""
        c = self.trie.codebook_sizes[level]
        if out.dim() != 2 or out.shape[1] != c or out.shape[0] != len(nodes):
            raise ValueError(f"out must be [{len(nodes)}, {c}], got {tuple(out.shape)}")
        rows, cols = self._positions(level, nodes)
        if out.is_contiguous() and out.device.type == "cpu":
            # plain numpy writes through a shared view: no torch op (and no OpenMP team) on the host thread
            flat_np = rows * c + cols
            out.numpy().reshape(-1)[flat_np] = 0.0
            return flat_np
        if out.is_contiguous():
            flat = torch.from_numpy(rows * c + cols).to(out.device, non_blocking=True)
            out.view(-1).index_fill_(0, flat, 0.0)
            return flat
        r = torch.from_numpy(rows).to(out.device, non_blocking=True)
        k = torch.from_numpy(cols).to(out.device, non_blocking=True)
        out[r, k] = 0.0
        return (r, k)

    def undo(self, handle, out: torch.Tensor) -> None:
        """Write -inf back at exactly the positions a ``fill`` wrote."""
        if isinstance(handle, np.ndarray):
            out.numpy().reshape(-1)[handle] = -np.inf
        elif isinstance(handle, tuple):
            out[handle] = float("-inf")
        else:
            out.view(-1).index_fill_(0, handle, float("-inf"))

    def dense(self, level: int, nodes: np.ndarray) -> torch.Tensor:
        """A freshly built [B, C_level] mask (built per distinct node; the reference for ``fill``)."""
        nodes = np.asarray(nodes, dtype=np.int64).reshape(-1)
        valid = np.zeros((nodes.size, self.trie.codebook_sizes[level]), dtype=bool)
        for node in np.unique(nodes[nodes >= 0]):
            valid[np.ix_(nodes == node, self.trie.children(level, int(node)))] = True
        out = torch.full(valid.shape, float("-inf"), dtype=self.dtype)
        out[torch.from_numpy(valid)] = 0.0
        return out
