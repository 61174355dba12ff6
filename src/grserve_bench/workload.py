"""Synthetic GR retrieval workloads: user histories drawn from the catalog, laid out as SID tokens."""

from __future__ import annotations

import numpy as np

from grserve.catalog import Catalog


def history_prompts(catalog: Catalog, num: int, prompt_len: int, seed: int = 0) -> list[np.ndarray]:
    """``num`` prompts of exactly ``prompt_len`` tokens: the last tokens of a random item history (Zipf-popular
    items, as real interaction logs are skewed)."""
    rng = np.random.default_rng(seed)
    n_items = -(-prompt_len // catalog.depth)
    ranks = np.arange(1, len(catalog) + 1, dtype=np.float64)
    popularity = ranks**-0.8
    popularity /= popularity.sum()
    out = []
    for _ in range(num):
        rows = rng.choice(len(catalog), size=n_items, p=popularity)
        tokens = catalog.layout.sids_to_tokens(catalog.sids[rows])
        out.append(tokens[-prompt_len:].astype(np.int64))
    return out


def powerlaw_lengths(num: int, lo: int, hi: int, alpha: float = 1.5, seed: int = 0) -> list[int]:
    """Prompt lengths from a truncated power law over [lo, hi] ("tens to thousands of tokens", xGR §1)."""
    rng = np.random.default_rng(seed)
    u = rng.random(num)
    a = 1.0 - alpha
    x = (lo**a + u * (hi**a - lo**a)) ** (1.0 / a)
    return [int(v) for v in np.clip(np.round(x), lo, hi)]
