"""FPB — follow predictions blindly: evict the evictable key with the farthest predicted next request.

The class of LRB, GLIDER, 3L-Cache, Raven... (paper Table 1). 1-consistent, unbounded robustness. In SYNC mode
with a non-stable predictor every evictable key is re-predicted at each eviction (l = all).
"""

from __future__ import annotations

from typing import Hashable

from grserve.eviction.policy import EVICTION_POLICIES
from grserve.eviction.predictive import PredictivePolicy


@EVICTION_POLICIES.register("fpb")
class FPBPolicy(PredictivePolicy):
    name = "fpb"

    def victim(self, now: int) -> Hashable:
        self._check_evictable()
        return self._evict(self._predicted_victim(self.index.n_evictable, now))
