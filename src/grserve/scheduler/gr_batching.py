"""GR batching by token capacity and an SLO-derived waiting quota (xGR §7).

Requests wait in FIFO queues keyed by beam width (a batch shares one beam width, so its beam buffers are one
fixed shape). A batch leaves a queue when

1. its prompt tokens reach ``token_capacity`` or it has ``max_batch_requests`` requests (capacity), or
2. its oldest request has waited ``wait_quota_ms`` (= fraction × SLO) — the paper's "allocated quota", or
3. an execution slot is idle (``dispatch_when_idle``; decided, see docs/decisions.md): waiting only pays
   when every slot is busy, so under light load a request starts at once and batches form under load.

A batch never exceeds the token capacity, except a single request larger than it, which runs alone.
The class is a pure policy: time is passed in, it owns no threads and touches no tensors.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from grserve.config import SchedulerConfig


class Batchable(Protocol):
    beam_width: int
    arrival: float

    @property
    def num_tokens(self) -> int: ...


R = TypeVar("R", bound=Batchable)


@dataclass
class Batch(Generic[R]):
    requests: list[R]
    beam_width: int
    num_tokens: int
    reason: str  # "capacity" | "quota" | "idle"


class GRBatcher(Generic[R]):
    def __init__(self, cfg: SchedulerConfig, dispatch_when_idle: bool = True):
        self.cfg = cfg
        self.dispatch_when_idle = dispatch_when_idle
        self._queues: OrderedDict[int, deque[R]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, req: R) -> None:
        self._queues.setdefault(req.beam_width, deque()).append(req)
        self._size += 1

    def next_deadline(self) -> float | None:
        """perf_counter time at which some queue's head exhausts its waiting quota."""
        heads = [q[0].arrival for q in self._queues.values() if q]
        return min(heads) + self.cfg.wait_quota_ms / 1e3 if heads else None

    def pop_ready(self, now: float, idle_slots: int) -> Batch[R] | None:
        """The next batch to run, or None. Call only when a slot can take it (idle_slots ≥ 1)."""
        if idle_slots <= 0:
            return None
        best: tuple[float, int, str, int] | None = None  # (head arrival, beam width, reason, count)
        for bw, q in self._queues.items():
            if not q:
                continue
            count, tokens = self._fit(q)
            if count < len(q) or count >= self.cfg.max_batch_requests or tokens >= self.cfg.token_capacity:
                reason = "capacity"
            elif (now - q[0].arrival) * 1e3 >= self.cfg.wait_quota_ms:
                reason = "quota"
            elif self.dispatch_when_idle:
                reason = "idle"
            else:
                continue
            if best is None or q[0].arrival < best[0]:
                best = (q[0].arrival, bw, reason, count)
        if best is None:
            return None
        _, bw, reason, count = best
        q = self._queues[bw]
        reqs = [q.popleft() for _ in range(count)]
        self._size -= count
        return Batch(reqs, bw, sum(r.num_tokens for r in reqs), reason)

    def _fit(self, q: deque[R]) -> tuple[int, int]:
        """How many head requests fit the token capacity and request cap (at least one)."""
        count, tokens = 0, 0
        for req in q:
            if count >= self.cfg.max_batch_requests:
                break
            if count and tokens + req.num_tokens > self.cfg.token_capacity:
                break
            count += 1
            tokens += req.num_tokens
        return count, tokens

    def remove(self, match) -> R | None:
        """Take the first queued request for which ``match(req)`` is true out of its queue (a cancel)."""
        for q in self._queues.values():
            for i, req in enumerate(q):
                if match(req):
                    del q[i]
                    self._size -= 1
                    return req
        return None

    def expire(self, arrived_before: float) -> list[R]:
        """Take out every queued request that arrived before ``arrived_before`` (past its deadline). Each queue
        is FIFO by arrival, so only heads are looked at."""
        out: list[R] = []
        for q in self._queues.values():
            while q and q[0].arrival < arrived_before:
                out.append(q.popleft())
        self._size -= len(out)
        return out

    def oldest_arrival(self) -> float | None:
        heads = [q[0].arrival for q in self._queues.values() if q]
        return min(heads) if heads else None

    def pop_all(self) -> list[R]:
        """Every queued request, oldest queue first; the batcher is empty after."""
        out = [r for q in self._queues.values() for r in q]
        self._queues.clear()
        self._size = 0
        return out
