"""Block keys of the global KV index: a chained hash of token blocks, stable across processes.

Block ``i`` of a prompt is tokens ``[i·B, (i+1)·B)``; its key is ``blake2b(parent_key ‖ int64-LE token bytes)``
with ``parent_key`` the key of block ``i − 1`` (empty for block 0), so one key names a whole prefix (vLLM's
parent-hash chain). Python's ``hash()`` is salted per process and cannot be used. Only full blocks get a key: a
partial last block is never shared.

(The prefix-cache branch adds ``kvcache/block_hash.py`` with the same function; the two are to be unified.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


def chained_block_hashes(tokens: Sequence[int] | np.ndarray, block_size: int,
                         parent: bytes | None = None) -> list[bytes]:
    """The key of every full block of ``tokens``, in order; ``parent`` is the key of the block before
    ``tokens[0]`` (None: ``tokens`` start at position 0)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    raw = np.ascontiguousarray(np.asarray(tokens, dtype="<i8")).tobytes()
    width = 8 * block_size
    keys: list[bytes] = []
    prev = parent or b""
    for off in range(0, len(raw) - width + 1, width):
        prev = hashlib.blake2b(prev + raw[off:off + width], digest_size=DIGEST_BYTES).digest()
        keys.append(prev)
    return keys
