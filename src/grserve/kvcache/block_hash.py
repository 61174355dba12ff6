"""Chained hashes of full token blocks: the key of a cached prefix block, stable across processes and machines.

``chained_block_hashes(tokens, block_size)`` gives one hash per *full* block of ``tokens``: block g's hash is
blake2b-128 over (the hash of block g − 1, or ``parent`` for block 0; the block's token ids as little-endian
int64 bytes). A hash therefore names the block's whole prefix (two equal hashes mean equal token prefixes, up to
a 2^-128 collision), which is what lets a block be shared by every request whose prompt starts with that prefix,
and lets a cluster index route a request to the worker that holds its prefix. Python's ``hash`` is salted per
process, so it is not used. ``parent`` chains a continuation onto an earlier block (e.g. a conversation's next
turn), or namespaces a cache (a model id's hash).

Hashes are Python ints (128-bit) so they serialise to JSON and compare fast; ``ROOT`` (0) is the parent of block 0.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

ROOT = 0
_DIGEST = 16


def block_hash(parent: int, block_tokens: Sequence[int] | np.ndarray) -> int:
    """The hash of one full block given its parent's hash."""
    h = hashlib.blake2b(digest_size=_DIGEST)
    h.update(int(parent).to_bytes(_DIGEST, "little"))
    h.update(np.asarray(block_tokens, dtype="<i8").tobytes())
    return int.from_bytes(h.digest(), "little")


def chained_block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int, parent: int | None = None) -> list[int]:
    """Hashes of the ``len(tokens) // block_size`` full blocks of ``tokens`` (a partial last block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be ≥ 1")
    arr = np.asarray(tokens, dtype="<i8")
    out: list[int] = []
    h = ROOT if parent is None else parent
    for g in range(len(arr) // block_size):
        h = block_hash(h, arr[g * block_size:(g + 1) * block_size])
        out.append(h)
    return out
