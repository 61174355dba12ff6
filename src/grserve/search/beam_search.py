"""SID beam search state for a batch of R requests × BW beams, with every buffer allocated once.

The engine drives it step by step (one step per SID level):

    level 0:  logits [R, C_0] from each prompt's last position → ``select_first`` (one hypothesis per request,
              so top-BW of a single distribution)
    level l:  forward the BW beams' level-(l−1) tokens → logits [R·BW, C_l] → ``prepare_mask(l)`` (host,
              may overlap the forward) → ``select(l)``: masked log-softmax, per-beam top-K, global top-BW,
              reorder of the beam rows by parent → returns the flat parent index for the KV reorder.

A request may exclude items (``catalog.exclusion.ItemExclusion``) or allow only some (``catalog.allowlist.
ItemAllowlist``): the trie branches that lead to no item it may get are masked in every step on top of the
catalog's item mask, so the others are never returned and take no beam.

Beams whose score is −inf (fewer valid continuations than BW) stay in their rows, are never revived (their mask
rows are all −inf) and are dropped from the results, so a request can get fewer items, never an invalid one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grserve.catalog import Catalog
from grserve.catalog.allowlist import ItemAllowlist
from grserve.catalog.exclusion import ItemExclusion
from grserve.search.level_heads import level_heads
from grserve.search.scoring import masked_log_softmax_
from grserve.search.topbw import TopBW, top_bw_heap


@dataclass(frozen=True)
class Hit:
    item_id: int
    sid: tuple[int, ...]
    score: float
    token_logprobs: tuple[float, ...] = ()  # each SID token's log-probability (they sum to ``score``)


class BeamSearch:
    def __init__(
        self,
        catalog: Catalog,
        num_requests: int,
        beam_width: int,
        top_k: int | None = None,
        topbw: str = "vectorized",
        device: torch.device | str = "cpu",
        exclusions: list[ItemExclusion | ItemAllowlist | None] | None = None,
    ):
        self.catalog = catalog
        self.exclusions = [(i, e) for i, e in enumerate(exclusions or []) if e is not None]
        self.r, self.bw = num_requests, beam_width
        self.depth = catalog.depth
        self.sizes = tuple(catalog.codebook_sizes)
        self.topbw_impl = topbw
        rows = num_requests * beam_width
        f32, i64 = torch.float32, torch.int64
        self.codes = torch.zeros(rows, self.depth, dtype=i64, device=device)  # SID codes chosen so far
        self.scores = torch.full((num_requests, beam_width), float("-inf"), dtype=f32, device=device)
        self.level_scores = torch.zeros(rows, self.depth, dtype=f32, device=device)  # score after each level
        self._level_ws = torch.empty_like(self.level_scores)
        self.parents = torch.zeros(rows, dtype=i64, device=device)  # flat parent row of each new beam
        self.next_tokens = torch.zeros(rows, dtype=i64, device=device)  # model token ids to feed next
        self.nodes = np.zeros(rows, dtype=np.int64)  # trie node of each beam's prefix (−1: dead)
        self._codes_ws = torch.empty_like(self.codes)
        self._flat_rank = torch.empty(rows, dtype=i64, device=device)
        self._new_codes = torch.empty(rows, dtype=i64, device=device)
        self._dead = torch.empty(rows, dtype=torch.bool, device=device)
        self._row_base = (torch.arange(num_requests, device=device) * beam_width)[:, None]
        self.logits: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.topk_v: list[torch.Tensor] = []
        self.topk_i: list[torch.Tensor] = []
        self.selectors: list[TopBW | None] = []
        self.ks: list[int] = []
        for level, c in enumerate(self.sizes):
            n = num_requests if level == 0 else rows
            k = min(top_k or beam_width, c) if level > 0 else min(beam_width, c)
            self.ks.append(k)
            self.logits.append(torch.empty(n, c, dtype=f32, device=device))
            self.masks.append(torch.full((n, c), float("-inf"), dtype=f32, device=device))
            self.topk_v.append(torch.empty(n, k, dtype=f32, device=device))
            self.topk_i.append(torch.empty(n, k, dtype=i64, device=device))
            self.selectors.append(TopBW(num_requests, beam_width, k, beam_width, device) if level > 0 else None)
        self._lse = torch.empty(rows, 1, dtype=f32, device=device)
        # per-level constants as 0-dim tensors (a Python scalar operand allocates a wrapper tensor per call)
        self._k_t = [torch.tensor(k, dtype=i64, device=device) for k in self.ks]
        self.heads = level_heads(catalog.layout, device)  # code → token of each level (a start or a table)
        self._mask_handle = None
        self.candidates_visited = 0

    # ---- level 0 ------------------------------------------------------------------------------------------
    def select_first(self, full_vocab_lse: torch.Tensor | None = None) -> None:
        """Top-BW of each request's single level-0 distribution (``logits[0]`` filled by the engine)."""
        logits = self.logits[0]
        mask = self.catalog.mask.first_level
        if self.exclusions:  # per-request level-0 masks: the catalog's, minus each request's dead branches
            mask = self.masks[0]
            mask.copy_(self.catalog.mask.first_level.expand_as(mask))
            root = np.zeros(1, dtype=np.int64)
            for i, ex in self.exclusions:
                _, codes = ex.kills(0, root)
                mask[i, torch.from_numpy(codes).to(mask.device)] = float("-inf")
        masked_log_softmax_(logits, mask, self._lse[: self.r], full_vocab_lse)
        k = self.ks[0]
        torch.topk(logits, k, dim=1, out=(self.topk_v[0], self.topk_i[0]))
        self.scores[:, :k] = self.topk_v[0]
        self.level_scores[:, 0].copy_(self.scores.view(-1))
        codes0 = self.codes[:, 0].view(self.r, self.bw)
        codes0[:, :k] = self.topk_i[0]
        self.candidates_visited += self.r * k
        self._advance_nodes(0, np.zeros(self.r * self.bw, dtype=np.int64))

    # ---- levels ≥ 1 ---------------------------------------------------------------------------------------
    def prepare_mask(self, level: int) -> None:
        """Sparse in-place write of each beam's valid next codes into the reused mask buffer (host side)."""
        self._mask_handle = self.catalog.mask.fill(level, self.nodes, self.masks[level])
        for i, ex in self.exclusions:  # a subset of what fill wrote, so its undo restores these too
            rows, codes = ex.kills(level, self.nodes[i * self.bw:(i + 1) * self.bw])
            if rows.size:
                r = torch.from_numpy(rows + i * self.bw).to(self.masks[level].device)
                self.masks[level][r, torch.from_numpy(codes).to(r.device)] = float("-inf")

    def select(self, level: int, full_vocab_lse: torch.Tensor | None = None) -> torch.Tensor:
        """One beam step at ``level`` ≥ 1; returns the flat parent rows [R·BW] for reordering the unshared KV."""
        logits, mask = self.logits[level], self.masks[level]
        masked_log_softmax_(logits, mask, self._lse, full_vocab_lse)
        self.catalog.mask.undo(self._mask_handle, mask)
        k = self.ks[level]
        torch.topk(logits, k, dim=1, out=(self.topk_v[level], self.topk_i[level]))
        cand = self.topk_v[level].view(self.r, self.bw, k)
        cand.add_(self.scores[:, :, None])
        if self.topbw_impl == "heap":
            beams, ranks, visited = self._heap_select(cand)
        else:
            sel = self.selectors[level]
            sel.select(cand)
            self.scores.copy_(sel.scores)
            beams, ranks, visited = sel.beams, sel.ranks, int(sel.visited)
        self.candidates_visited += visited
        torch.add(beams, self._row_base, out=self.parents.view(self.r, self.bw))
        # reorder the code history by parent, then append this level's code
        torch.index_select(self.codes, 0, self.parents, out=self._codes_ws)
        self.codes.copy_(self._codes_ws)
        torch.mul(self.parents, self._k_t[level], out=self._flat_rank)
        self._flat_rank.add_(ranks.view(-1))
        torch.take(self.topk_i[level], self._flat_rank, out=self._new_codes)
        self.codes[:, level].copy_(self._new_codes)
        torch.index_select(self.level_scores, 0, self.parents, out=self._level_ws)
        self.level_scores.copy_(self._level_ws)
        self.level_scores[:, level].copy_(self.scores.view(-1))
        parent_nodes = self.nodes[self.parents.cpu().numpy()]
        self._advance_nodes(level, parent_nodes)
        return self.parents

    def _heap_select(self, cand: torch.Tensor):
        """Reference path: the paper's min-heap scan per request (host, Python)."""
        beams = torch.empty(self.r, self.bw, dtype=torch.int64)
        ranks = torch.empty_like(beams)
        visited = 0
        c = cand.detach().cpu().numpy()
        for i in range(self.r):
            s, b, j, v = top_bw_heap(c[i], self.bw)
            self.scores[i] = torch.from_numpy(s)
            beams[i], ranks[i] = torch.from_numpy(b), torch.from_numpy(j)
            visited += v
        dev = self.scores.device
        return beams.to(dev), ranks.to(dev), visited

    def _advance_nodes(self, level: int, parent_nodes: np.ndarray) -> None:
        codes = self.codes[:, level].cpu().numpy()
        self.nodes = self.catalog.trie.step(level, parent_nodes, codes)
        torch.isneginf(self.scores.view(-1), out=self._dead)
        self.nodes[self._dead.cpu().numpy()] = -1
        self.heads.to_tokens(level, self.codes[:, level], self.next_tokens)

    # ---- results ------------------------------------------------------------------------------------------
    def results(self, top_n: list[int]) -> list[list[Hit]]:
        """Per request, its best ``top_n`` valid items (best first). Dead (−inf) beams are dropped."""
        scores = self.scores.cpu().numpy()
        codes = self.codes.cpu().numpy().reshape(self.r, self.bw, self.depth)
        leaves = self.nodes.reshape(self.r, self.bw)
        cum = self.level_scores.cpu().numpy().reshape(self.r, self.bw, self.depth)
        with np.errstate(invalid="ignore"):  # dead beams (-inf - -inf) are dropped below
            per_token = np.diff(cum, axis=2, prepend=0.0)  # score after level l minus after level l-1
        out: list[list[Hit]] = []
        for i in range(self.r):
            alive = np.flatnonzero((leaves[i] >= 0) & np.isfinite(scores[i]))[: top_n[i]]
            items = self.catalog.items_of_leaves(leaves[i, alive])
            out.append(
                [Hit(int(it), tuple(int(c) for c in codes[i, j]), float(scores[i, j]),
                     tuple(float(x) for x in per_token[i, j])) for it, j in zip(items, alive)]
            )
        return out
