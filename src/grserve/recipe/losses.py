"""Next-token losses of GR training, from the widest softmax to the one the served search uses.

Every target of the SID stream is a token of one SID level. Three normalisations of its probability:

- ``full``: softmax over the whole vocabulary (a plain causal LM; what ``hf`` scoring ranks by).
- ``level``: softmax over the target's level only (the codebook the beam search draws that token from).
- ``catalog``: softmax over the codes the catalog allows after the target's SID prefix (its trie node's
  children), i.e. exactly the ``renormalized`` scoring of the served beam search (the item mask is added before
  the softmax). Summed over an item's levels this is the log-probability of the item under a proper distribution
  over catalog items, and it is the quantity the served ranking sorts by.

``SidTargets`` precomputes, per catalog item, the trie node above each of its codes, so a target's node is one
lookup, and the valid-code table of every level. The level of a target token and its code come from the layout's
per-level token ids (``level_token_ids``), so the same code serves the arithmetic layout and any other assignment
of token ids to codes.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from grserve.catalog import Catalog
from grserve.recipe.config import LOSSES

IGNORE = -100


def level_token_ids(catalog: Catalog) -> list[np.ndarray]:
    """Token id of each code, per level (the arithmetic layout: one contiguous range per level)."""
    return [np.arange(*catalog.layout.level_range(level), dtype=np.int64) for level in range(catalog.depth)]


class SidTargets:
    """Per catalog item: the trie node above each level's code; per level: which codes each node allows."""

    def __init__(self, catalog: Catalog):
        self.depth = catalog.depth
        sids = catalog.sids.astype(np.int64)  # rows sorted by SID; row r = leaf r
        nodes = np.zeros((len(catalog), catalog.depth), dtype=np.int64)
        cur = np.zeros(len(catalog), dtype=np.int64)
        for level in range(catalog.depth):
            nodes[:, level] = cur
            cur = catalog.trie.step(level, cur, sids[:, level])
        self._item_nodes = nodes
        self._catalog = catalog
        self.valid: list[torch.Tensor] = []  # per level: bool [nodes at that level, codebook size]
        for level, size in enumerate(catalog.codebook_sizes):
            ptr = catalog.trie.indptr[level]
            table = np.zeros((len(ptr) - 1, size), dtype=bool)
            table[np.repeat(np.arange(len(ptr) - 1), np.diff(ptr)), catalog.trie.codes[level]] = True
            self.valid.append(torch.from_numpy(table))
        token_ids = level_token_ids(catalog)
        self.token_ids = [torch.from_numpy(t) for t in token_ids]
        vocab = int(max(t.max() for t in token_ids)) + 1
        self.level_of = torch.full((vocab,), -1, dtype=torch.int64)  # token id -> level (-1: not a SID token)
        self.code_of = torch.full((vocab,), -1, dtype=torch.int64)  # token id -> code
        for level, t in enumerate(token_ids):
            self.level_of[t] = level
            self.code_of[t] = torch.arange(len(t))

    def token_nodes(self, items: np.ndarray) -> np.ndarray:
        """The trie node above each SID token of ``items`` (flat, item after item, like the tokens)."""
        rows = self._catalog.leaves_of_sids(self._catalog.sids_of_items(items))
        return self._item_nodes[rows].reshape(-1)


def next_token_loss(model, hidden: torch.Tensor, targets: torch.Tensor, nodes: torch.Tensor | None, kind: str,
                    sid: SidTargets | None, label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``targets`` [N] (IGNORE = skip) given ``hidden`` [N, H] under normalisation ``kind``.

    ``nodes`` [N]: the trie node above each target (``catalog`` only). ``reduction``: mean over the kept targets,
    or sum.
    """
    keep = targets != IGNORE
    hidden, targets = hidden[keep], targets[keep]
    if kind == "full":
        return F.cross_entropy(model.logits(hidden), targets, label_smoothing=label_smoothing, reduction=reduction)
    if kind not in LOSSES or sid is None:
        raise ValueError(f"loss {kind!r} needs a SidTargets (losses: {', '.join(LOSSES)})")
    levels, codes = sid.level_of[targets], sid.code_of[targets]
    if bool((levels < 0).any()):
        raise ValueError("a target token is not a SID token; the level and catalog losses take SID streams only")
    nodes = nodes[keep] if nodes is not None else None
    weight = model.lm_head.weight
    total = hidden.new_zeros(())
    for level, ids in enumerate(sid.token_ids):
        sel = levels == level
        if not bool(sel.any()):
            continue
        logits = F.linear(hidden[sel], weight[ids])
        if kind == "catalog":
            logits = logits.masked_fill(~sid.valid[level][nodes[sel]], float("-inf"))
        total = total + _ce_sum(logits, codes[sel], label_smoothing)
    return total / max(int(targets.numel()), 1) if reduction == "mean" else total


def _ce_sum(logits: torch.Tensor, codes: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Summed cross-entropy; label smoothing spreads only over the finite (allowed) logits."""
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(1, codes[:, None])[:, 0]
    if label_smoothing <= 0:
        return nll.sum()
    finite = torch.isfinite(logp)
    uniform = -(logp.masked_fill(~finite, 0.0)).sum(-1) / finite.sum(-1)
    return ((1 - label_smoothing) * nll + label_smoothing * uniform).sum()
