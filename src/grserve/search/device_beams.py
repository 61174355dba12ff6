"""Beam-search state of one fixed-shape bucket (R_b requests × BW beams), entirely on the device.

The device counterpart of ``BeamSearch``: the beams' trie nodes live in a device tensor, so a step needs no host
round trip (``BeamSearch`` keeps them in numpy and builds the mask on a host thread). Every buffer is allocated once
per bucket and every step has fixed shapes, so ``select`` can be captured in a CUDA graph.

    first(logits0)    level 0: dense first-level mask, log-softmax, top-BW of each request's one distribution
    select(level, …)  level ≥ 1: masked top-k/expand (``search.masked_topk``), exact global top-BW (``TopBW``),
                      code history reordered by parent, new codes / trie nodes / next tokens written in place;
                      returns the flat parent rows for the unshared-KV reorder.

Scores, tie rule and the dead-beam rule are those of ``BeamSearch``; results are equal (tests).
"""

from __future__ import annotations

import numpy as np
import torch

from grserve.catalog import Catalog
from grserve.search.beam_search import Hit
from grserve.search.device_trie import DeviceTrie
from grserve.search.level_heads import LevelHeads
from grserve.search.topbw import TopBW


class DeviceBeamState:
    def __init__(self, trie: DeviceTrie, heads: LevelHeads, num_requests: int, beam_width: int,
                 top_k: int | None, device: torch.device | str):
        self.trie = trie
        self.r, self.bw, self.depth = num_requests, beam_width, trie.depth
        rows = num_requests * beam_width
        i64 = torch.int64
        self.codes = torch.zeros(rows, self.depth, dtype=i64, device=device)
        self.nodes = torch.full((rows,), -1, dtype=i64, device=device)
        self.scores = torch.full((num_requests, beam_width), float("-inf"), device=device)
        self.tokens = torch.zeros(rows, dtype=i64, device=device)
        self.parents = torch.zeros(rows, dtype=i64, device=device)
        self.visited = torch.zeros((), dtype=i64, device=device)
        self._codes_ws = torch.empty_like(self.codes)
        self._flat = torch.empty(rows, dtype=i64, device=device)
        self._row_base = (torch.arange(num_requests, device=device) * beam_width)[:, None]
        self.heads = heads  # code → token of each level
        self.ks = [min(beam_width, trie.sizes[0])]
        self.selectors: list[TopBW | None] = [None]
        for level in range(1, self.depth):
            k = min(top_k or beam_width, trie.sizes[level], trie.max_children[level])
            self.ks.append(k)
            self.selectors.append(TopBW(num_requests, beam_width, k, beam_width, device))
        self._k_t = [torch.tensor(k, dtype=i64, device=device) for k in self.ks]

    # ---- level 0 (eager, after the prefill) -------------------------------------------------------------------
    def first(self, logits: torch.Tensor, live: int, full_lse: torch.Tensor | None = None) -> None:
        """logits fp32 [R_b, C_0] (rows ≥ ``live`` are padding requests); full_lse [R_b] under ``hf`` scoring."""
        z = logits + self.trie.first_mask
        z = z - (torch.logsumexp(z, dim=1, keepdim=True) if full_lse is None else full_lse[:, None])
        z = z.nan_to_num_(nan=float("-inf"), neginf=float("-inf"))
        k = self.ks[0]
        v, i = torch.topk(z, k, dim=1)
        self.scores.fill_(float("-inf"))
        self.scores[:live, :k] = v[:live]
        codes0 = self.codes[:, 0].view(self.r, self.bw)
        codes0.zero_()
        codes0[:, :k] = i
        self.nodes.copy_(self.trie.first_child[self.codes[:, 0]])
        self.nodes.masked_fill_(torch.isneginf(self.scores.view(-1)), -1)
        self.heads.to_tokens(0, self.codes[:, 0], self.tokens)
        self.visited.fill_(live * k)

    # ---- levels ≥ 1 (fixed shapes: capturable) ---------------------------------------------------------------
    def select(self, level: int, logits: torch.Tensor, topk_fn, full_lse: torch.Tensor | None = None
               ) -> torch.Tensor:
        k = self.ks[level]
        cand_v, cand_code, cand_node = topk_fn(logits, self.trie, level, self.nodes, self.scores.view(-1), k,
                                               full_lse)
        sel = self.selectors[level]
        sel.select(cand_v.view(self.r, self.bw, k))
        self.scores.copy_(sel.scores)
        self.visited.add_(sel.visited)
        torch.add(sel.beams, self._row_base, out=self.parents.view(self.r, self.bw))
        torch.index_select(self.codes, 0, self.parents, out=self._codes_ws)
        self.codes.copy_(self._codes_ws)
        torch.mul(self.parents, self._k_t[level], out=self._flat)
        self._flat.add_(sel.ranks.view(-1))
        self.codes[:, level].copy_(cand_code.view(-1)[self._flat])
        self.nodes.copy_(cand_node.view(-1)[self._flat])
        self.nodes.masked_fill_(torch.isneginf(self.scores.view(-1)), -1)
        self.heads.to_tokens(level, self.codes[:, level], self.tokens)
        return self.parents

    # ---- results (one host copy per batch) --------------------------------------------------------------------
    def results(self, catalog: Catalog, top_n: list[int]) -> list[list[Hit]]:
        scores = self.scores.cpu().numpy()
        codes = self.codes.cpu().numpy().reshape(self.r, self.bw, self.depth)
        leaves = self.nodes.cpu().numpy().reshape(self.r, self.bw)
        out: list[list[Hit]] = []
        for i in range(len(top_n)):
            alive = np.flatnonzero((leaves[i] >= 0) & np.isfinite(scores[i]))[: top_n[i]]
            items = catalog.items_of_leaves(leaves[i, alive])
            out.append([Hit(int(it), tuple(int(c) for c in codes[i, j]), float(scores[i, j]))
                        for it, j in zip(items, alive)])
        return out
