"""HF — heuristic filtering (HALP, MAT): LRU pre-selects its ``candidates`` oldest keys, the predictor picks one.

The candidate set is fixed (HALP: 4; the LCR experiments do not state theirs, digest §11.17 — we use 4).
"""

from __future__ import annotations

from typing import Any, Hashable

from grserve.eviction.policy import EVICTION_POLICIES
from grserve.eviction.predictive import PredictivePolicy


@EVICTION_POLICIES.register("hf")
class HFPolicy(PredictivePolicy):
    name = "hf"

    def __init__(self, capacity: int, predictor: Any = None, candidates: int = 4, **kw: Any):
        super().__init__(capacity, predictor, **kw)
        if candidates < 1:
            raise ValueError("candidates must be ≥ 1")
        self.candidates = candidates

    def victim(self, now: int) -> Hashable:
        self._check_evictable()
        l = min(self.candidates, self.index.n_evictable)
        z = self.index.oldest(1) if l == 1 else self._predicted_victim(l, now)
        return self._evict(z)
