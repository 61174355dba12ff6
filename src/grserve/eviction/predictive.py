"""What FPB, HF and LARU share: the LRU order, the prediction table 𝒫 and the SYNC/ASYNC prediction modes.

𝒫 lives in the leaves of a ``RecencyIndex``, so "the key with the largest predicted next-request time among the
l LRU-oldest evictable keys" is an O(log k) query (digest §11.8).

Modes (Algorithm 1, Lines 22–23 and 31–32):

* ``sync``: before a prediction-driven eviction the l candidates are re-predicted and 𝒫 updated (Line 23). For a
  ``stable`` predictor (a key's prediction changes only when it is accessed: oracles, noisy oracles) predicting at
  access time yields exactly the values Line 23 would compute, so the policy does that instead of re-predicting
  l keys per eviction (tested equal to the literal path).
* ``async``: each access queues the key for a background prediction job; evictions use whatever 𝒫 holds.

Decision on digest §11.5 (missing predictions): a key never predicted yet gets 𝒫 = now + ``default_gap``
(the predictor's ``default_gap`` when it has one — the mean observed gap —, else the capacity k). A key that is
re-accessed keeps its previous (stale) 𝒫 until a fresh prediction lands (ASYNC) or it is re-predicted (SYNC).
"""

from __future__ import annotations

from typing import Any, Hashable

from grserve.eviction.async_predict import AsyncPredictionJobs
from grserve.eviction.policy import IndexedPolicy, NoEvictableKey


class PredictivePolicy(IndexedPolicy):
    def __init__(self, capacity: int, predictor: Any = None, mode: str = "sync", async_batch: int = 64,
                 async_threaded: bool = False):
        super().__init__(capacity)
        if predictor is None:
            raise ValueError(f"{self.name} needs predictor= (a NextAccessPredictor)")
        if mode not in ("sync", "async"):
            raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
        self.predictor = predictor
        self.mode = mode
        self.stable = bool(getattr(predictor, "stable", False))
        self.jobs = AsyncPredictionJobs(predictor, async_batch, async_threaded) if mode == "async" else None

    # ---- 𝒫 maintenance -------------------------------------------------------------------------------------
    def _default(self, now: int) -> float:
        gap = getattr(self.predictor, "default_gap", None)
        return float(now) + float(gap if gap is not None else self.capacity)

    def _drain(self) -> None:
        if self.jobs is None:
            return
        idx = self.index
        for keys, vals in self.jobs.drain():
            for k, v in zip(keys, vals):
                if k in idx:
                    idx.set_value(k, float(v))

    def _predict(self, keys: list[Hashable], now: int) -> list[float]:
        self.stats["predictor_calls"] += 1
        self.stats["predictions"] += len(keys)
        return [float(v) for v in self.predictor.predict(keys, now)]

    def _access(self, key: Hashable, now: int, inserted: bool) -> None:
        self._drain()
        self.predictor.observe(key, now)
        value: float | None = None
        if self.jobs is not None:
            self.jobs.submit(key, now)
        elif self.stable:
            value = self._predict([key], now)[0]
        if value is None and inserted:
            value = self._default(now)
        self.index.touch(key, value=value)

    def _predicted_victim(self, l: int, now: int) -> Hashable:
        """Line 23 + Line 25: the candidate among the l LRU-oldest with the largest predicted next access."""
        idx = self.index
        pos = idx.oldest_position(l)
        if self.jobs is None and not self.stable:
            keys = idx.oldest_keys(l)
            for k, v in zip(keys, self._predict(keys, now)):
                idx.set_value(k, v)
        return idx.argmax_upto(pos)

    def _check_evictable(self) -> None:
        self._drain()
        if self.index.n_evictable == 0:
            raise NoEvictableKey("no evictable key")

    # ---- events --------------------------------------------------------------------------------------------
    def on_insert(self, key: Hashable, now: int) -> None:
        self._access(key, now, inserted=True)

    def on_hit(self, key: Hashable, now: int) -> None:
        self._access(key, now, inserted=False)

    def on_remove(self, key: Hashable) -> None:
        self.index.remove(key)

    def on_split(self, head: Hashable, tail: Hashable, now: int) -> None:
        """The tail inherits the head's access history (it was requested exactly when the head was) and 𝒫."""
        copy = getattr(self.predictor, "copy_history", None)
        if copy is not None:
            copy(head, tail)
        if self.jobs is None and self.stable and copy is not None:
            value = self._predict([tail], now)[0]  # the tail's own next use (it may differ from the head's)
        else:
            value = self.index.value(head)
        self.index.touch(tail, value=value)

    def close(self) -> None:
        if self.jobs is not None:
            self.jobs.close()
