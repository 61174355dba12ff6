"""Synthetic GR retrieval workloads: user histories drawn from the catalog, laid out as SID tokens."""

from __future__ import annotations

import numpy as np

from grserve.catalog import Catalog


def history_prompts(catalog: Catalog, num: int, prompt_len: int, seed: int = 0) -> list[np.ndarray]:
    """``num`` prompts of exactly ``prompt_len`` tokens: the last tokens of a random item history (Zipf-popular
    items, as real interaction logs are skewed), each item as a prompt writes it (wrapped in ``sid_begin`` /
    ``sid_end`` where the layout has them; the prompt then ends with ``sid_begin``, where the beams start)."""
    rng = np.random.default_rng(seed)
    begin = catalog.layout.sid_begin
    body_len = prompt_len - (begin is not None)
    n_items = -(-max(body_len, 1) // catalog.depth)
    ranks = np.arange(1, len(catalog) + 1, dtype=np.float64)
    popularity = ranks**-0.8
    popularity /= popularity.sum()
    out = []
    for _ in range(num):
        rows = rng.choice(len(catalog), size=n_items, p=popularity)
        tokens = catalog.layout.items_to_tokens(catalog.sids[rows])[-body_len:] if body_len else np.zeros(0)
        out.append(np.append(tokens, [begin] if begin is not None else []).astype(np.int64))
    return out


def bench_layout(catalog: Catalog, kind: str, vocab_size: int, seed: int = 0) -> Catalog:
    """The catalog under a bench SID layout on a model of ``vocab_size``: ``arithmetic`` (as generated); ``onerec``:
    tokenizer-native like OneRec's added tokens, each level's codes a contiguous id range at the top of the vocabulary
    with ``sid_begin`` / ``sid_end`` after them (the LM head's slice path); ``gathered``: the same ids shuffled
    (MiniOneRec-like added tokens, the gather path)."""
    if kind == "arithmetic":
        return catalog
    from grserve.catalog import SidLayout

    sizes = catalog.codebook_sizes
    base = vocab_size - sum(sizes) - 2
    if base < 0:
        raise ValueError(f"{sum(sizes) + 2} SID tokens do not fit a vocabulary of {vocab_size}")
    ids = base + np.arange(sum(sizes), dtype=np.int64)
    if kind == "gathered":
        ids = np.random.default_rng(seed).permutation(ids)
    cuts = np.cumsum((0,) + sizes)
    tables = tuple(ids[cuts[level]:cuts[level + 1]] for level in range(len(sizes)))
    layout = SidLayout(len(sizes), sizes, level_tokens=tables, sid_begin=vocab_size - 2, sid_end=vocab_size - 1)
    return catalog.with_layout(layout)


def powerlaw_lengths(num: int, lo: int, hi: int, alpha: float = 1.5, seed: int = 0) -> list[int]:
    """Prompt lengths from a truncated power law over [lo, hi] ("tens to thousands of tokens", xGR §1)."""
    rng = np.random.default_rng(seed)
    u = rng.random(num)
    a = 1.0 - alpha
    x = (lo**a + u * (hi**a - lo**a)) ** (1.0 / a)
    return [int(v) for v in np.clip(np.round(x), lo, hi)]
