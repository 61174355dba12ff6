"""Deterministic batching for offline runs: the server's ``GRBatcher``, driven by the inputs instead of the clock.

The server's batching core dispatches a batch when it is full, when its oldest request has waited its quota, or
when an execution slot is idle — so which requests share a batch depends on timing. Offline, nothing waits for a
client: ``OfflineBatches`` adds requests in input order and dispatches a queue's batch only when the token capacity
or the request cap fills it (``GRBatcher.pop_ready`` with idle dispatch off and a clock that never advances), or
when it must: the read-ahead ``window`` is full (counted to the oldest request not yet dispatched: the queue holding
it is dispatched, full or not) or the inputs ended (``flush``). The batches are therefore a function of the inputs
and their order alone. As on the server, up to ``inflight`` batches run at once (``--max-inflight-batches``), each
on an executor thread while the caller converts the next inputs: when and in which thread a batch runs changes
nothing in it. Results come back in input order, each as ``(request, result)``; at most ``window`` requests wait
undispatched, plus the ``inflight`` batches running. A request answered without the engine (a cold start) takes its
place in that order with ``add_result``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from grserve.config import SchedulerConfig
from grserve.scheduler.gr_batching import GRBatcher


class OfflineBatches:
    def __init__(self, cfg: SchedulerConfig, run_batch: Callable[[list[Any]], list[Any]], window: int,
                 inflight: int = 1):
        if window < 1 or inflight < 1:
            raise ValueError(f"window and inflight must be >= 1, got {window} and {inflight}")
        self._batcher: GRBatcher[Any] = GRBatcher(cfg, dispatch_when_idle=False)
        self._run = run_batch
        self.window, self.inflight = window, inflight
        self._pool = ThreadPoolExecutor(inflight, thread_name_prefix="grserve-offline") if inflight > 1 else None
        self._running: deque[tuple[list[Any], Future]] = deque()  # dispatched batches, oldest first
        self._order: dict[int, int] = {}  # id(request) -> input position
        self._waiting: list[int] = []  # heap: input positions of the requests not yet dispatched (lazy deletion)
        self._dispatched: set[int] = set()
        self._done: dict[int, tuple[Any, Any]] = {}  # input position -> (request, result)
        self._added = 0
        self._next = 0  # the next position to hand out
        self.batches = 0

    def add(self, req: Any) -> list[Any]:
        """Queue one request; the results that are now ready, in input order."""
        self._order[id(req)] = self._added
        heapq.heappush(self._waiting, self._added)
        self._added += 1
        self._batcher.add(req)
        self._dispatch(-math.inf)  # full batches only
        return self._settle()

    def add_result(self, req: Any, result: Any) -> list[Any]:
        """A request already answered: its result takes the next input position; the results now ready."""
        self._done[self._added] = (req, result)
        self._added += 1
        return self._settle()

    def _oldest_waiting(self) -> int:
        while self._waiting and self._waiting[0] in self._dispatched:
            self._dispatched.discard(heapq.heappop(self._waiting))
        return self._waiting[0] if self._waiting else self._added

    def _settle(self) -> list[Any]:
        """The ready results; while the window is full, the queue holding the oldest request not yet dispatched is
        dispatched, full or not (a rule of the inputs alone)."""
        while self._added - self._oldest_waiting() >= self.window:
            self._dispatch(math.inf, once=True)
        self._collect(block=False)
        return self._ready()

    def flush(self) -> list[Any]:
        """Run everything still queued; the remaining results in input order."""
        self._dispatch(math.inf)
        self._collect(block=True)
        return self._ready()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _dispatch(self, now: float, once: bool = False) -> None:
        while (batch := self._batcher.pop_ready(now, idle_slots=1)) is not None:
            for req in batch.requests:
                self._dispatched.add(self._order[id(req)])
            self.batches += 1
            if self._pool is None:
                self._record(batch.requests, self._run(batch.requests))
            else:
                while len(self._running) >= self.inflight:  # a slot frees when the oldest batch is done
                    self._record(*self._pop_running())
                self._running.append((batch.requests, self._pool.submit(self._run, batch.requests)))
            if once:
                return

    def _pop_running(self) -> tuple[list[Any], list[Any]]:
        requests, fut = self._running.popleft()
        return requests, fut.result()

    def _collect(self, block: bool) -> None:
        while self._running and (block or self._running[0][1].done()):
            self._record(*self._pop_running())

    def _record(self, requests: list[Any], results: list[Any]) -> None:
        for req, res in zip(requests, results, strict=True):
            self._done[self._order.pop(id(req))] = (req, res)

    def _ready(self) -> list[Any]:
        out = []
        while self._next in self._done:
            out.append(self._done.pop(self._next))
            self._next += 1
        return out
