"""The online model of the ``duel`` policy: per-class reuse-gap histograms → P(reused soon | class, age).

A block's *class* is a few prefix-tree and frequency features known at its last access (``features``):

* accesses within the owner's LFU window (counted for uncached keys too): 1, 2, 3, 4, 5–7, 8–15, 16+ for a root
  block (depth 0: every key of a one-key-per-request trace), 1, 2, 3+ for a deeper prefix block (its count is in
  practice its conversation's turns since it was written, and its reuse odds stop changing after 3; finer bins
  only split the histograms — docs/results/eviction.md, "Conversation signals"),
* cached-tree shape: a leaf (no child seen yet), one child, or a branch point (2+ children),
* the root block (depth 0) or not.

Every access of a key closes the previous access's *event*: its gap (now − last) goes to the histogram of the
class the key had then. Histograms use half-octave buckets of the gap and are halved every ``decay_every``
events, so the model follows a drifting workload; every event counts in its class's total at once, so events
still open (the key not re-requested yet) count as "not reused so far" (censoring, biased toward caution).

The score of a cached key of class c and idle age a is the conditional probability of a reuse within the next
``horizon`` ticks, P(a < G ≤ a + H | G > a, c), from the histograms; H is the cache's eviction age (an EMA of the
age of evicted keys), so "soon" means "before this key would be pushed out anyway". The table of scores per
(class, age bucket) is rebuilt every ``refresh_every`` events (O(classes × buckets)); a score is then two dict
lookups. No gradient training: the "learning" is counting, which keeps the cost within a few µs per access.
"""

from __future__ import annotations

N_COUNT, N_SHAPE, N_DEPTH = 7, 3, 2
_COUNT_BIN = (0, 0, 1, 2, 3, 4, 4, 4) + (5,) * 8  # 1, 2, 3, 4, 5-7, 8-15, 16+ accesses (root blocks)
_DEEP_COUNT_BIN = (0, 0, 1, 2)  # 1, 2, 3+ accesses (blocks below the root)
N_CLASSES = N_COUNT * N_SHAPE * N_DEPTH
N_BUCKETS = 2 * 40 + 2


def bucket(age: int) -> int:
    """Half-octave bucket of a non-negative integer (0, 1, 2, 3, 4-5, 6-7, 8-11, 12-15, …)."""
    if age < 2:
        return age
    b = age.bit_length()
    return min(2 * b - 2 + ((age >> (b - 2)) & 1), N_BUCKETS - 1)


def bucket_low(i: int) -> int:
    """The smallest age in bucket i (inverse of ``bucket`` on bucket starts)."""
    if i < 2:
        return i
    b, half = (i + 2) // 2, (i + 2) % 2
    return (1 << (b - 1)) + half * (1 << (b - 2))


def klass(count: int, children: int, depth: int) -> int:
    if depth:
        cb = _DEEP_COUNT_BIN[min(count, 3)]
    else:
        cb = _COUNT_BIN[count] if count < 16 else N_COUNT - 1
    return (cb * N_SHAPE + min(children, N_SHAPE - 1)) * N_DEPTH + (depth == 0)


class HitModel:
    def __init__(self, horizon: float = 1024.0, decay_every: int = 65_536, refresh_every: int = 4096,
                 rule: str = "density", mult: float = 4.0):
        self.rule, self.mult = rule, mult
        self.hist = [[0.0] * N_BUCKETS for _ in range(N_CLASSES)]
        self.total = [0.0] * N_CLASSES
        self.horizon = float(horizon)
        self.decay_every = decay_every
        self.refresh_every = refresh_every
        self.events = 0
        self.table = [[0.5] * N_BUCKETS for _ in range(N_CLASSES)]

    def open_event(self, c: int) -> None:
        """A key of class c was accessed (its next gap is now pending)."""
        self.total[c] += 1.0
        self.events += 1
        if self.events % self.refresh_every == 0:
            self.refresh()
        if self.events % self.decay_every == 0:
            self.decay()

    def close_event(self, c: int, gap: int) -> None:
        """A key whose previous access was of class c came back after ``gap`` ticks."""
        self.hist[c][bucket(gap)] += 1.0

    def decay(self) -> None:
        for c in range(N_CLASSES):
            self.total[c] *= 0.5
            h = self.hist[c]
            for i in range(N_BUCKETS):
                h[i] *= 0.5

    def refresh(self) -> None:
        """Rebuild score[c][age bucket] with the current horizon H (see ``rule``)."""
        H = max(1, int(self.horizon))
        for c in range(N_CLASSES):
            h, tot = self.hist[c], self.total[c]
            cum = [0.0] * (N_BUCKETS + 1)
            wsum = [0.0] * (N_BUCKETS + 1)  # Σ gaps (bucket midpoints) of the reuses in buckets < i
            for i in range(N_BUCKETS):
                cum[i + 1] = cum[i] + h[i]
                wsum[i + 1] = wsum[i] + h[i] * 0.5 * (bucket_low(i) + bucket_low(i + 1))
            row = self.table[c]
            for i in range(N_BUCKETS):
                a = bucket_low(i)
                alive = tot - cum[i]  # events with a gap ≥ a (or still open)
                if alive <= 0:
                    row[i] = 0.0
                    continue
                if self.rule == "lhd":  # reuses within L = mult·H are hits; the others occupy L
                    j = bucket(a + int(self.mult * H))
                    hit = cum[j + 1] - cum[i]
                    occ = (wsum[j + 1] - wsum[i]) - a * hit + (alive - hit) * self.mult * H
                    row[i] = (hit + 0.5) / max(occ, 1.0)
                elif self.rule == "density":  # P(reused | age a) / E[time until that reuse]
                    later = cum[N_BUCKETS] - cum[i]
                    wait = (wsum[N_BUCKETS] - wsum[i]) / later - a if later > 0 else float(H)
                    row[i] = (later + 0.5) / (alive + 1.0) / max(wait, 1.0)
                else:
                    j = bucket(a + H)
                    row[i] = (cum[j + 1] - cum[i] + 0.5) / (alive + 1.0)

    def score(self, c: int, age: int) -> float:
        return self.table[c][bucket(age)]
