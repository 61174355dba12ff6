"""Synthetic catalogs shaped like real RQ semantic IDs (skewed top levels, tiny last-level fan-out)."""

from __future__ import annotations

import numpy as np

from .catalog import Catalog
from .recif_like import generate_recif_like

MAX_SPLIT_CELLS = 1 << 25  # the largest [prefixes × codes] table of one level split here; beyond: recif_like.py


def _split(rng: np.random.Generator, demand: np.ndarray, c: int, cap: int, s: float) -> np.ndarray:
    """Split each row's demand over c codes with Zipf(s) weights on a random code order; each cell <= cap."""
    m = demand.size
    w = np.empty((m, c))
    np.put_along_axis(w, np.argsort(rng.random((m, c)), axis=1), 1.0 / np.arange(1, c + 1) ** s, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    counts = rng.multinomial(demand, w)
    while True:  # move overflow to codes that still have room
        excess = np.maximum(counts - cap, 0)
        left = excess.sum(axis=1)
        if not left.any():
            return counts
        counts -= excess
        room = w * (counts < cap)
        room /= np.maximum(room.sum(axis=1, keepdims=True), 1e-300)
        rows = np.flatnonzero(left)
        counts[rows] += rng.multinomial(left[rows], room[rows])


def generate_catalog(n_items: int = 20000, depth: int = 3, codebook_size: int = 256, seed: int = 0,
                     token_offset: int = 16) -> Catalog:
    """A deterministic synthetic catalog.

    Prefixes of length depth-1 ("leaf parents") are spread top-down with Zipf-like weights (so level 1
    uses most codes, unevenly); each leaf parent gets 1 + a few last-level codes (geometric, mean ~2.5).
    Item ids are 0..n_items-1 in a random order (a seeded permutation), so ids do not follow SID order.
    A shape whose split tables would pass ``MAX_SPLIT_CELLS`` (RecIF's 1.5 M items × 8,192 codes × depth 4) is
    sampled item by item instead (``recif_like.generate_recif_like``).
    """
    c = int(codebook_size)
    if n_items < 1 or depth < 1 or c < 1 or n_items > c ** depth:
        raise ValueError(f"need 1 <= n_items <= codebook_size**depth, got {n_items}, {c}**{depth}")
    if depth >= 2 and min(c ** (depth - 2), n_items) * c > MAX_SPLIT_CELLS:
        return generate_recif_like(n_items, depth, c, seed, token_offset)
    rng = np.random.default_rng(seed)
    cap_parents = c ** (depth - 1)
    # fan-out of each leaf parent, summing to n_items
    fan = np.minimum(rng.geometric(0.4, size=n_items // 2 + 16), c)
    while fan.sum() < n_items:
        fan = np.concatenate([fan, np.minimum(rng.geometric(0.4, size=n_items // 2 + 16), c)])
    p = int(np.searchsorted(np.cumsum(fan), n_items)) + 1
    fan = fan[:p]
    fan[-1] -= int(fan.sum()) - n_items
    if p > cap_parents:  # too few prefixes for that fan-out: spread evenly instead
        p = cap_parents
        fan = np.full(p, n_items // p, dtype=np.int64)
        fan[: n_items % p] += 1
    # top-down: split leaf-parent counts over the codes of levels 0..depth-2
    prefixes = np.zeros((1, 0), dtype=np.int64)
    demand = np.array([p], dtype=np.int64)
    for level in range(depth - 1):
        counts = _split(rng, demand, c, c ** (depth - 2 - level), 1.0 if level == 0 else 0.8)
        rows, codes = np.nonzero(counts)
        prefixes = np.concatenate([prefixes[rows], codes[:, None]], axis=1)
        demand = counts[rows, codes]
    # last level: distinct codes per leaf parent from a random offset into a shuffled code order
    rng.shuffle(fan)
    perm = rng.permutation(c)
    parent = np.repeat(np.arange(p), fan)
    within = np.arange(n_items) - np.repeat(np.cumsum(fan) - fan, fan)
    offset = rng.integers(0, c, size=p)
    last = perm[(offset[parent] + within) % c]
    sids = np.concatenate([prefixes[parent], last[:, None]], axis=1)
    item_ids = rng.permutation(n_items).astype(np.int64)
    return Catalog.from_arrays(item_ids, sids, (c,) * depth, token_offset, source=f"<synthetic seed={seed}>")
