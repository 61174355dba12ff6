"""LARU — Learning-Augmented LRU (LCR paper, Algorithm 1).

Evict, among the l = max(⌊λk⌋, 1) least-recently-used items, the one with the largest predicted next-request
time. Marking-style phases: a phase starts at an eviction with O (the unrequested *old* items) empty; then
O ← all cached items and λ ← 1. A miss on an item that this phase evicted by prediction (Line 25) is a
*prediction-induced miss* (impossible under perfect predictions, Belady property): LARU then evicts by LRU
(Line 15) and divides λ by b, shrinking the candidate set geometrically toward plain LRU. 1-consistent,
(k + log_b k + 2)-robust, O(log k) per request (``RecencyIndex``).

Decisions on the ambiguities of digest §11 (also in docs/eviction.md):

1. Miss with free space: the key is loaded without eviction; O, λ and the phase are untouched.
2. The prediction-evicted record is cleared at every phase start (needed for Theorem 2); it is an exact set.
3. A reloaded key stays in the record for the rest of the phase (literal reading): being LRU-evicted and
   re-requested again in the same phase fires Line 14 again. A Line-25 eviction counts as prediction-driven even
   when it picks the LRU-oldest; Line-15/Line-20 evictions are never recorded.
4. 𝒫 holds predicted next-request *times* (last access + predicted reuse interval), ranked directly.
5. Missing predictions: now + default_gap (see ``predictive.py``); ASYNC may use stale entries.
6. λ is tracked as an integer exponent j (λ = b^−j); l = k // b^j for integer b (exact), else ⌊k·b^−j⌋.
   Ties in Line 25 go to the least recently used candidate; k is the number of items cached at the eviction.
7. LLM variant: λ is divided by b once every ``decay_every`` prediction-induced misses (Line 14 evaluated true);
   "auto" = 1 for k ≤ 64 else ⌈k/32⌉ (k at the phase start); the counter restarts at each phase. λ has no floor
   (l is clamped at 1), so Line 14 keeps firing after l = 1, as written.
8. Phase start happens inside ``victim`` (Algorithm 1 checks O = ∅ only when the cache is full and must evict);
   several victims for one miss (radix ``evict(n_tokens)``) apply the Line-14 fallback to the first only.
"""

from __future__ import annotations

import math
from typing import Any, Hashable

from grserve.eviction.policy import EVICTION_POLICIES
from grserve.eviction.predictive import PredictivePolicy


@EVICTION_POLICIES.register("laru")
class LARUPolicy(PredictivePolicy):
    name = "laru"

    def __init__(self, capacity: int, predictor: Any = None, b: float = 2.0, decay_every: int | str = 1,
                 lambda_cap: float = 1.0, record: bool = False, **kw: Any):
        super().__init__(capacity, predictor, **kw)
        if not b > 1:
            raise ValueError(f"b must be > 1, got {b}")
        if decay_every != "auto" and (not isinstance(decay_every, int) or decay_every < 1):
            raise ValueError(f"decay_every must be a positive int or 'auto', got {decay_every!r}")
        if not 0 < lambda_cap <= 1:
            raise ValueError("lambda_cap must be in (0, 1]")
        self.b = b
        self.decay_every = decay_every
        self.lambda_cap = lambda_cap  # λ's value at each phase start: 1 in the paper (a test hook pins l = 1)
        self._int_b = int(b) if float(b).is_integer() else None
        self.old: set[Hashable] = set()  # O
        self.pred_evicted: set[Hashable] = set()  # keys evicted at Line 25 in this phase
        self.j = 0  # λ = lambda_cap · b^−j
        self._induced_in_phase = 0
        self._decay_period = 1
        self._pending_miss: Hashable | None = None
        self.phase = 0
        self.stats.update(phases=0, line14=0, line15=0, line20=0, line25=0)
        self.events: list[tuple] | None = [] if record else None

    # ---- λ -------------------------------------------------------------------------------------------------
    @property
    def lam(self) -> float:
        return self.lambda_cap * float(self.b) ** (-self.j)

    def candidate_count(self, k: int) -> int:
        """l = max(⌊λk⌋, 1)."""
        if self.lambda_cap == 1.0 and self._int_b is not None:
            return max(k // (self._int_b ** self.j), 1)
        return max(math.floor(self.lambda_cap * k * float(self.b) ** (-self.j) + 1e-9), 1)

    # ---- events --------------------------------------------------------------------------------------------
    def on_miss(self, key: Hashable, now: int) -> None:
        self._pending_miss = key

    def on_insert(self, key: Hashable, now: int) -> None:
        self._pending_miss = None  # a miss served without eviction (decision 1)
        super().on_insert(key, now)

    def on_hit(self, key: Hashable, now: int) -> None:
        self.old.discard(key)  # Line 7
        super().on_hit(key, now)

    def on_remove(self, key: Hashable) -> None:
        self.old.discard(key)
        super().on_remove(key)

    def _start_phase(self) -> None:  # Lines 10–12
        self.phase += 1
        self.stats["phases"] += 1
        self.old = set(self.index.keys())
        self.j = 0
        self.pred_evicted.clear()
        self._induced_in_phase = 0
        k = len(self.index)
        if self.decay_every == "auto":
            self._decay_period = 1 if k <= 64 else -(-k // 32)
        else:
            self._decay_period = int(self.decay_every)
        if self.events is not None:
            self.events.append(("phase", self.phase, k))

    def victim(self, now: int) -> Hashable:
        self._check_evictable()
        if not self.old:
            self._start_phase()
        x, self._pending_miss = self._pending_miss, None
        idx = self.index
        if x is not None and x in self.pred_evicted:  # Line 14: a prediction-induced miss
            self.stats["line14"] += 1
            self.stats["line15"] += 1
            z = idx.oldest(1)  # Line 15
            self._induced_in_phase += 1
            if self._induced_in_phase % self._decay_period == 0:
                self.j += 1  # Line 16: λ ← λ/b
            line, l = 15, 1
        else:
            l = min(self.candidate_count(len(idx)), idx.n_evictable)  # Line 18
            if l == 1:
                z = idx.oldest(1)  # Line 20
                line = 20
                self.stats["line20"] += 1
            else:
                z = self._predicted_victim(l, now)  # Lines 22–25
                line = 25
                self.stats["line25"] += 1
                self.pred_evicted.add(z)
        if self.events is not None:
            self.events.append(("evict", z, line, l, z in self.old, self.j))
        self.old.discard(z)  # Line 28
        return self._evict(z)
