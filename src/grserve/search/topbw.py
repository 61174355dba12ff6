"""Global top-BW over the BW×K candidate pool (xGR §6.2), equal to a full sort.

Candidates ``cand[b, j]`` = cumulative score of beam b extended by its j-th best token; every row is
non-increasing in j (per-beam top-K is sorted and adding the beam score is a monotone shift).

**Tie rule** (both implementations, and the full-sort oracle of tests/grserve/search/test_topbw.py): order by score
descending, then by flat index ``b·K + j`` ascending, i.e. a lower beam index wins, then a better per-beam rank.
−inf candidates (invalid tokens) sort last by the same rule; they only get selected when fewer than BW valid
candidates exist, and callers drop them.

* ``top_bw_heap``: the paper's early-terminated scan: a global min-heap of size BW; beams are visited in index
  order, a beam stops at its first candidate that does not beat the heap minimum (strict ``>``: earlier-visited
  ties win, which is the tie rule above). Reports the exact number of candidates it visited.
* ``TopBW`` (vectorised, fixed shapes, preallocated outputs): finds the BW-th largest value τ with one
  ``topk``, keeps every candidate > τ plus the first ``BW − #(> τ)`` candidates equal to τ in flat order, and
  orders them by (score desc, flat asc) with stable sorts. Its visited count is what an early-terminated scan
  that knows τ touches: per beam, the candidates > τ plus the first one that is not (capped at K). That is a
  lower bound of the heap scan's count, which also pays for the heap minimum rising to τ.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch


def top_bw_heap(cand: np.ndarray, bw: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The early-terminated min-heap scan. Returns (scores, beams, ranks, visited)."""
    b, k = cand.shape
    heap: list[tuple[float, int, int]] = []  # (score, -beam, -rank): the min is the worst under the tie rule
    visited = 0
    for i in range(b):
        row = cand[i]
        for j in range(k):
            s = float(row[j])
            visited += 1
            if len(heap) < bw:
                heapq.heappush(heap, (s, -i, -j))
            elif s > heap[0][0]:
                heapq.heapreplace(heap, (s, -i, -j))
            else:
                break  # every later candidate of beam i is <= s: terminate this beam
    best = sorted(heap, key=lambda e: (-e[0], -e[1], -e[2]))
    scores = np.array([e[0] for e in best], dtype=cand.dtype)
    beams = np.array([-e[1] for e in best], dtype=np.int64)
    ranks = np.array([-e[2] for e in best], dtype=np.int64)
    return scores, beams, ranks, visited


class TopBW:
    """Vectorised exact top-BW for R independent requests, with every buffer preallocated (no per-step allocation).

    ``select(cand)`` with cand [R, B, K] fills ``scores`` [R, BW], ``beams`` [R, BW], ``ranks`` [R, BW] (best first)
    and returns nothing; ``visited`` [1] holds the visit count of the last call.
    """

    def __init__(self, num_requests: int, beams: int, k: int, bw: int, device: torch.device | str = "cpu"):
        if bw > beams * k:
            raise ValueError(f"top-BW needs BW ≤ B·K, got BW={bw}, B={beams}, K={k}")
        r, n = num_requests, beams * k
        self.k, self.bw = k, bw
        f32, i64, b8 = torch.float32, torch.int64, torch.bool
        self._tv = torch.empty(r, bw, device=device)
        self._ti = torch.empty(r, bw, dtype=i64, device=device)
        self._gt = torch.empty(r, n, dtype=b8, device=device)
        self._eq = torch.empty(r, n, dtype=b8, device=device)
        self._cum = torch.empty(r, n, dtype=i64, device=device)
        self._need = torch.empty(r, 1, dtype=i64, device=device)
        self._keep = torch.empty(r, n, dtype=b8, device=device)
        self._key = torch.empty(r, n, dtype=torch.uint8, device=device)
        self._sv = torch.empty(r, n, dtype=torch.uint8, device=device)
        self._si = torch.empty(r, n, dtype=i64, device=device)
        self._per_beam = torch.empty(r, beams, dtype=i64, device=device)
        self.flat = torch.empty(r, bw, dtype=i64, device=device)
        self.scores = torch.empty(r, bw, dtype=f32, device=device)
        self._order = torch.empty(r, bw, dtype=i64, device=device)
        self._tmp_i = torch.empty(r, bw, dtype=i64, device=device)
        self._tmp_f = torch.empty(r, bw, dtype=f32, device=device)
        self.beams = torch.empty(r, bw, dtype=i64, device=device)
        self.ranks = torch.empty(r, bw, dtype=i64, device=device)
        self.visited = torch.empty((), dtype=i64, device=device)
        # constants as 0-dim tensors: a Python scalar operand would be wrapped in a fresh tensor on every call
        self._bw_t = torch.tensor(bw, dtype=i64, device=device)
        self._k_t = torch.tensor(k, dtype=i64, device=device)
        self._one = torch.tensor(1, dtype=i64, device=device)

    def select(self, cand: torch.Tensor) -> None:
        r, b, k = cand.shape
        bw = self.bw
        flat = cand.view(r, b * k)
        torch.topk(flat, bw, dim=1, out=(self._tv, self._ti))
        tau = self._tv[:, bw - 1 : bw]
        torch.gt(flat, tau, out=self._gt)
        torch.eq(flat, tau, out=self._eq)
        torch.sum(self._gt, dim=1, keepdim=True, out=self._need)
        self._need.neg_().add_(self._bw_t)  # how many ties at τ to take
        torch.cumsum(self._eq, dim=1, out=self._cum)
        torch.le(self._cum, self._need, out=self._keep)
        self._keep.logical_and_(self._eq).logical_or_(self._gt)  # exactly BW per row
        self._key.copy_(self._keep)
        torch.sort(self._key, dim=1, descending=True, stable=True, out=(self._sv, self._si))
        self.flat.copy_(self._si[:, :bw])  # kept candidates in flat order
        torch.gather(flat, 1, self.flat, out=self._tmp_f)
        torch.sort(self._tmp_f, dim=1, descending=True, stable=True, out=(self.scores, self._order))
        torch.gather(self.flat, 1, self._order, out=self._tmp_i)
        self.flat.copy_(self._tmp_i)
        torch.div(self.flat, self._k_t, rounding_mode="floor", out=self.beams)
        torch.remainder(self.flat, self._k_t, out=self.ranks)
        torch.sum(self._gt.view(r, b, k), dim=2, out=self._per_beam)
        self._per_beam.add_(self._one).clamp_(max=k)
        torch.sum(self._per_beam, dim=(0, 1), out=self.visited)
