"""RecIF-like synthetic catalogs: millions of items, depth 4, thousands of codes per level, skewed prefix popularity.

OneRec's RecIF catalog has about 1.5 M items with 4-level SIDs of 8,192 codes per level. ``synthetic.py`` spreads
demand top-down over dense [prefixes × codes] tables, which does not reach that shape (8,192² cells per level), so
this generator samples item by item instead:

* levels 0 … depth−2: each item draws a Zipf(s_l) rank over the level's codes; the rank becomes a code through a
  permutation of the codes that depends on the item's prefix so far (an affine map ``(a·rank + b) mod C`` with
  ``gcd(a, C) = 1``, a and b hashed from the prefix), so every prefix has its own popular children;
* the last level: the items of one leaf parent (same depth−1 prefix) get distinct codes, a run of a seeded
  permutation of the codes from a random offset per leaf parent.

Deterministic for a seed. A leaf parent with more items than codes (a skew too strong for the shape) moves its
surplus items to other prefixes, redrawn, until every SID is unique.
"""

from __future__ import annotations

import numpy as np

from .catalog import Catalog

DEFAULT_SKEW = (1.0, 0.9, 0.8, 0.7)  # Zipf exponent per level (RQ codes: the first level is the most skewed)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _mix(h: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (h, code) per item (splitmix64's finaliser; wrap-around arithmetic)."""
    with np.errstate(over="ignore"):
        x = (h ^ codes.astype(np.uint64)) * _MIX + np.uint64(1)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _zipf_ranks(rng: np.random.Generator, n: int, c: int, s: float) -> np.ndarray:
    cdf = np.cumsum(1.0 / np.arange(1, c + 1, dtype=np.float64) ** s)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(n)), c - 1)


def _prefix_codes(rng: np.random.Generator, n: int, depth: int, c: int, skew: tuple[float, ...]) -> np.ndarray:
    """[n, depth−1] codes of levels 0 … depth−2 (Zipf ranks through per-prefix permutations)."""
    coprime = np.flatnonzero(np.gcd(np.arange(c), c) == 1).astype(np.uint64)
    codes = np.empty((n, depth - 1), dtype=np.int64)
    h = np.full(n, np.uint64(int(rng.integers(1 << 62))), dtype=np.uint64)
    for level in range(depth - 1):
        rank = _zipf_ranks(rng, n, c, skew[min(level, len(skew) - 1)]).astype(np.uint64)
        a = coprime[(h % np.uint64(coprime.size)).astype(np.int64)]
        b = (h >> np.uint64(20)) % np.uint64(c)
        with np.errstate(over="ignore"):
            codes[:, level] = ((a * rank + b) % np.uint64(c)).astype(np.int64)
        h = _mix(h, codes[:, level])
    return codes


def _last_codes(rng: np.random.Generator, prefixes: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, last codes in that order): items sorted by prefix, distinct last codes within each leaf parent
    (a leaf parent with more than c items keeps its first c; the others get last code −1)."""
    order = np.lexsort(prefixes.T[::-1])
    s = prefixes[order]
    new = np.ones(len(s), dtype=bool)
    new[1:] = (s[1:] != s[:-1]).any(axis=1)
    group = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    within = np.arange(len(s)) - starts[group]
    offset = rng.integers(0, c, size=starts.size)
    perm = rng.permutation(c)
    last = perm[(offset[group] + within) % c]
    return order, np.where(within < c, last, -1)


def generate_recif_like(n_items: int = 1_500_000, depth: int = 4, codebook_size: int = 8192, seed: int = 0,
                        token_offset: int = 16, skew: tuple[float, ...] = DEFAULT_SKEW) -> Catalog:
    """A deterministic RecIF-like catalog (the module docstring). Item ids are 0..n_items−1 in a seeded random
    order, so ids do not follow SID order."""
    c = int(codebook_size)
    if depth < 2 or c < 2 or n_items < 1 or n_items > c ** depth // 4:
        raise ValueError(f"need depth >= 2, codebook_size >= 2 and 1 <= n_items <= codebook_size**depth / 4, got "
                         f"{n_items}, {c}**{depth}")
    rng = np.random.default_rng(seed)
    prefixes = _prefix_codes(rng, n_items, depth, c, skew)
    for _ in range(64):
        order, last = _last_codes(rng, prefixes, c)
        full = order[last < 0]
        if not full.size:
            break
        prefixes[full, -1] = rng.integers(0, c, size=full.size)  # over-full leaf parents: move the surplus
    else:
        raise ValueError(f"skew {skew} too strong for {n_items} items over {c} codes per level")
    sids = np.concatenate([prefixes[order], last[:, None]], axis=1)
    item_ids = rng.permutation(n_items).astype(np.int64)
    return Catalog.from_arrays(item_ids, sids, (c,) * depth, token_offset,
                               source=f"<RecIF-like seed={seed}>")
