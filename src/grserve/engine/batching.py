"""The batching core shared by the retrieval and ranking engines (the Engine contract of ``engine/protocol.py``).

One thread forms batches with a batch-formation policy (``scheduler.gr_batching.GRBatcher``: token capacity,
request cap, SLO waiting quota, dispatch when a slot is idle) and hands each batch to one of
``max_inflight_batches`` executor threads. The core owns what both engines need and nothing mode-specific:
the bounded queue (``max_waiting``: ``EngineOverloaded``), the queue deadline (a request still queued
``request_timeout_s`` after its arrival is dropped, never computed: ``RequestTimedOut``), one ``RequestHandle`` per request, per-batch failure isolation (a
failing batch fails only its own requests), cancel (a queued request leaves the queue; a running one has its
result dropped), drain, start/stop, queue depth, health. The engine gives ``execute(batch) -> results`` (one
result per request of the batch, in order) and the request type's ``request_id``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from grserve.config import EdgeConfig, SchedulerConfig
from grserve.engine.protocol import (
    EngineHealth,
    EngineOverloaded,
    EngineStopped,
    RequestCancelled,
    RequestHandle,
    RequestTimedOut,
)
from grserve.model.thread_choice import release_openmp_pool
from grserve.scheduler.gr_batching import Batch, GRBatcher


class _Pending:
    """A queued request and its handle, with what the batch-formation policy reads."""

    __slots__ = ("req", "handle")

    def __init__(self, req: Any, handle: RequestHandle):
        self.req, self.handle = req, handle

    @property
    def beam_width(self) -> int:
        return int(getattr(self.req, "beam_width", 0))  # ranking requests share one queue (key 0)

    @property
    def arrival(self) -> float:
        return self.req.arrival

    @property
    def num_tokens(self) -> int:
        return self.req.num_tokens


class BatchingCore:
    """Queue → batches → executor threads → handles. ``execute`` runs one batch of requests."""

    def __init__(self, execute: Callable[[list[Any]], Sequence[Any]], cfg: SchedulerConfig,
                 name: str = "grserve", on_batch: Callable[[int, int], None] | None = None, *,
                 max_waiting: int | None = None, request_timeout_s: float | None = None):
        self._execute = execute
        self.cfg = cfg
        self.max_waiting = max_waiting  # None: unbounded (an engine driven in code, e.g. a benchmark)
        self.request_timeout_s = request_timeout_s
        self.requests_expired = 0
        self.name = name
        self.on_batch = on_batch
        self._batcher: GRBatcher[_Pending] = GRBatcher(cfg)
        self._cond = threading.Condition()
        self._inflight = 0
        self._running_ids: set[str] = set()
        self._cancelled: set[str] = set()
        self._status = "stopped"
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.batches_run = 0
        self.requests_done = 0
        self.batches_failed = 0
        self.peak_inflight = 0

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._status == "ok":
                return
            self._status = "ok"
        release_openmp_pool()  # the batch threads' OpenMP pools, not also this one (model/thread_choice.py)
        self._pool = ThreadPoolExecutor(self.cfg.max_inflight_batches, thread_name_prefix=f"{self.name}-batch")
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-batcher", daemon=True)
        self._thread.start()

    def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, finish the queued and running ones; True when all finished in time."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        with self._cond:
            if self._status == "ok":
                self._status = "draining"
            while len(self._batcher) or self._inflight:
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self) -> None:
        with self._cond:
            self._status = "stopped"
            pending = self._batcher.pop_all()
            self._cond.notify_all()
        for p in pending:
            _fail(p.handle, EngineStopped("engine stopped"))
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # ---- requests -----------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._batcher)

    def submit(self, req: Any, cancel: Callable[[str], bool]) -> RequestHandle:
        handle: RequestHandle = RequestHandle(req.request_id, cancel)
        with self._cond:
            if self._status != "ok":
                raise EngineStopped(f"engine is {self._status}")
            if self.max_waiting is not None and len(self._batcher) >= self.max_waiting:
                raise EngineOverloaded(f"{len(self._batcher)} requests waiting (max_waiting={self.max_waiting})")
            self._batcher.add(_Pending(req, handle))
            self._cond.notify_all()
        return handle

    def cancel(self, request_id: str) -> bool:
        with self._cond:
            p = self._batcher.remove(lambda x: x.req.request_id == request_id)
            if p is None:
                if request_id not in self._running_ids:
                    return False
                self._cancelled.add(request_id)  # running: its result is dropped when the batch ends
                return True
            self._cond.notify_all()
        _fail(p.handle, RequestCancelled(f"request {request_id} cancelled"))
        return True

    def health(self, detail: dict | None = None) -> EngineHealth:
        return EngineHealth(self._status, len(self._batcher), len(self._running_ids), detail or {})  # type: ignore

    def stats(self) -> dict[str, float]:
        return {"batches_run": self.batches_run, "batches_failed": self.batches_failed,
                "requests_done": self.requests_done, "peak_inflight": self.peak_inflight,
                "requests_expired": self.requests_expired,
                "queue_depth": len(self._batcher), "running": len(self._running_ids)}

    # ---- internals ----------------------------------------------------------------------------------------
    def _next_batch(self) -> Batch[_Pending] | None:
        """Wait (under the lock) until a batch may run; None when the engine stops."""
        while self._status != "stopped":
            self._expire(time.perf_counter())
            idle = self.cfg.max_inflight_batches - self._inflight
            batch = self._batcher.pop_ready(time.perf_counter(), idle)
            if batch is not None:
                return batch
            deadlines = [self._batcher.next_deadline() if idle > 0 else None, self._next_expiry()]
            deadline = min((d for d in deadlines if d is not None), default=None)
            timeout = None if deadline is None else max(deadline - time.perf_counter(), 0.0005)
            self._cond.wait(timeout)
        return None

    def _next_expiry(self) -> float | None:
        oldest = self._batcher.oldest_arrival() if self.request_timeout_s is not None else None
        return None if oldest is None else oldest + self.request_timeout_s  # type: ignore[operator]

    def _expire(self, now: float) -> None:
        """Fail (under the lock) every queued request past its deadline: it is never computed."""
        if self.request_timeout_s is None:
            return
        late = self._batcher.expire(now - self.request_timeout_s)
        self.requests_expired += len(late)
        for p in late:
            _fail(p.handle, RequestTimedOut(f"request {p.req.request_id} waited more than {self.request_timeout_s:g}"
                                            f" s in the queue"))

    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = self._next_batch()
                if batch is None:
                    return
                self._inflight += 1
                self.peak_inflight = max(self.peak_inflight, self._inflight)
                self._running_ids.update(p.req.request_id for p in batch.requests)
            assert self._pool is not None
            self._pool.submit(self._run, batch)

    def _run(self, batch: Batch[_Pending]) -> None:
        try:
            results = self._execute([p.req for p in batch.requests])
            for p, res in zip(batch.requests, results):
                if p.req.request_id in self._cancelled:
                    _fail(p.handle, RequestCancelled(f"request {p.req.request_id} cancelled"))
                elif not p.handle.future.done():
                    p.handle.future.set_result(res)
            self.batches_run += 1
            self.requests_done += len(batch.requests)
            if self.on_batch is not None:
                self.on_batch(len(batch.requests), batch.num_tokens)
        except BaseException as exc:  # a failing batch fails its own requests only
            self.batches_failed += 1
            for p in batch.requests:
                _fail(p.handle, exc)
        finally:
            with self._cond:
                self._inflight -= 1
                for p in batch.requests:
                    self._running_ids.discard(p.req.request_id)
                    self._cancelled.discard(p.req.request_id)
                self._cond.notify_all()


def admission(edge: EdgeConfig | None) -> dict[str, Any]:
    """The queue bound and deadline of a server's edge; an engine built in code without one (a benchmark driving
    it directly) has neither."""
    if edge is None:
        return {"max_waiting": None, "request_timeout_s": None}
    return {"max_waiting": edge.max_waiting, "request_timeout_s": edge.request_timeout}


def _fail(handle: RequestHandle, exc: BaseException) -> None:
    if not handle.future.done():
        handle.future.set_exception(exc)


class BatchedEngine:
    """The Engine contract for an engine built on a ``BatchingCore`` (``self._core``): retrieval and ranking
    subclass it and add only their mode: the batch execution, the health detail, extra stats."""

    _core: BatchingCore

    def start(self):
        self._core.start()
        return self

    def stop(self) -> None:
        self._core.stop()

    def drain(self, timeout_s: float | None = None) -> bool:
        return self._core.drain(timeout_s)

    def submit(self, req: Any) -> RequestHandle:
        return self._core.submit(req, self.cancel)

    def cancel(self, request_id: str) -> bool:
        return self._core.cancel(request_id)

    def health(self) -> EngineHealth:
        return self._core.health(self.health_detail())

    def health_detail(self) -> dict:
        return {}

    def stats(self) -> dict[str, float]:
        return self._core.stats()

    @property
    def queue_depth(self) -> int:
        return self._core.queue_depth

    @property
    def max_waiting(self) -> int | None:
        return self._core.max_waiting

    @property
    def on_batch(self) -> Callable[[int, int], None] | None:
        return self._core.on_batch

    @on_batch.setter
    def on_batch(self, fn: Callable[[int, int], None] | None) -> None:
        self._core.on_batch = fn

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
