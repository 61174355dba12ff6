"""Deterministic batching for offline runs: the server's ``GRBatcher``, driven by the inputs instead of the clock.

The server's batching core dispatches a batch when it is full, when its oldest request has waited its quota, or
when an execution slot is idle — so which requests share a batch depends on timing. Offline, nothing waits for a
client: ``OfflineBatches`` adds requests in input order and runs a queue's batch only when the token capacity or
the request cap fills it (``GRBatcher.pop_ready`` with idle dispatch off and a clock that never advances), or when
it must: the read-ahead ``window`` is full (the queue holding the oldest unfinished request is run, full or not)
or the inputs ended (``flush``). The batches are therefore a function of the inputs and their order alone.
Results come back in input order, each as ``(request, result)``; at most ``window`` requests are held at any time.
A request answered without the engine (a cold start) takes its place in that order with ``add_result``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from grserve.config import SchedulerConfig
from grserve.scheduler.gr_batching import GRBatcher


class OfflineBatches:
    def __init__(self, cfg: SchedulerConfig, run_batch: Callable[[list[Any]], list[Any]], window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._batcher: GRBatcher[Any] = GRBatcher(cfg, dispatch_when_idle=False)
        self._run = run_batch
        self.window = window
        self._order: dict[int, int] = {}  # id(request) -> input position
        self._done: dict[int, tuple[Any, Any]] = {}  # input position -> (request, result)
        self._added = 0
        self._next = 0  # the next position to hand out
        self.batches = 0

    def add(self, req: Any) -> list[Any]:
        """Queue one request; the results that are now ready, in input order."""
        self._order[id(req)] = self._added
        self._added += 1
        self._batcher.add(req)
        self._drain(-math.inf)  # full batches only
        return self._settle()

    def add_result(self, req: Any, result: Any) -> list[Any]:
        """A request already answered: its result takes the next input position; the results now ready."""
        self._done[self._added] = (req, result)
        self._added += 1
        return self._settle()

    def _settle(self) -> list[Any]:
        """The ready results; while the window is full, the queue holding the oldest unfinished request is run,
        full or not."""
        out = self._ready()
        while self._added - self._next >= self.window:
            self._drain(math.inf, once=True)
            out += self._ready()
        return out

    def flush(self) -> list[Any]:
        """Run everything still queued; the remaining results in input order."""
        self._drain(math.inf)
        return self._ready()

    def _drain(self, now: float, once: bool = False) -> None:
        while (batch := self._batcher.pop_ready(now, idle_slots=1)) is not None:
            results = self._run(batch.requests)
            self.batches += 1
            for req, res in zip(batch.requests, results, strict=True):
                self._done[self._order.pop(id(req))] = (req, res)
            if once:
                return

    def _ready(self) -> list[Any]:
        out = []
        while self._next in self._done:
            out.append(self._done.pop(self._next))
            self._next += 1
        return out
