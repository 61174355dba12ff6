"""The Engine contract: what every mode (retrieval, ranking, LLM) offers the layer above.

The servers (``server/``) and the cluster router talk to engines through this contract only:

- ``submit(request) -> RequestHandle``: queue one request; the handle carries the request id, a
  ``concurrent.futures.Future`` of the final result, and an async stream of events (an LLM streams one event per
  token; retrieval and ranking stream a single final event). Raises ``EngineOverloaded`` when the bounded queue
  is full and ``EngineStopped`` after ``drain()``/``stop()``. A request still queued past the engine's request
  timeout is dropped, never computed: its future fails with ``RequestTimedOut``.
- ``cancel(request_id) -> bool``: stop working on a request and free what it holds; its future fails with
  ``RequestCancelled``. False when it is unknown or already done.
- ``stats() -> dict``: counters for ``/metrics`` and benchmarks (flat ``name -> number``).
- ``health() -> EngineHealth``: ``ok`` / ``draining`` / ``stopped``, queue depth, running requests.
- ``drain(timeout_s) -> bool``: take no new work, finish what is queued and running; True when all finished.
- ``start()`` / ``stop()``: threads up / down; ``stop()`` fails whatever is still queued with ``EngineStopped``.

Every engine is also a context manager (start on enter, stop on exit). ``RetrievalService`` and ``RankingService``
add what the retrieval and ranking apps read of their engine beyond the contract (a single engine or a cluster
front end offers both the same way).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Literal, Protocol, TypeVar, runtime_checkable

from grserve.engine.types import RankingRequest, RankingResult, RetrievalRequest, RetrievalResult

if TYPE_CHECKING:
    from grserve.catalog import CatalogStore
    from grserve.config import SearchConfig
    from grserve.ranking.registry import RankingRegistry

Req = TypeVar("Req")
Res = TypeVar("Res")


class EngineError(RuntimeError):
    """Base of the engine's own refusals (not a failure of the request's computation)."""


class EngineOverloaded(EngineError):
    """The bounded waiting queue is full; retry later (HTTP 429 with Retry-After)."""


class EngineStopped(EngineError):
    """The engine is draining or stopped and takes no new requests (HTTP 503)."""


class RequestCancelled(EngineError):
    """The request was cancelled (its client went away, or ``cancel()`` was called)."""


class RequestTimedOut(EngineError):
    """The request waited in the queue past its deadline and was dropped without being computed (HTTP 503)."""


class EngineStepFailed(EngineError):
    """An engine iteration raised; the requests it held are failed (the engine keeps serving). An error, never a
    normal finish (HTTP 500)."""


@dataclass(frozen=True)
class EngineHealth:
    status: Literal["ok", "draining", "stopped"]
    queue_depth: int  # requests waiting
    running: int  # requests being computed
    detail: dict[str, Any] = field(default_factory=dict)  # mode-specific facts (policy, catalog version, ...)


class RequestHandle(Generic[Res]):
    """One submitted request: ``future`` (final result or exception) and ``events()`` (async stream).

    The engine thread calls ``push(event)`` for intermediate events and completes ``future`` at the end;
    completing the future also ends the event stream. One consumer reads ``events()``; it may start reading
    before or after events arrive (nothing is lost), from any asyncio loop.
    """

    def __init__(self, request_id: str, on_cancel: Callable[[str], bool] | None = None):
        self.request_id = request_id
        self.future: Future[Res] = Future()
        self._events: deque[Any] = deque()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wakeup: asyncio.Event | None = None
        self._on_cancel = on_cancel
        self._forward: Callable[[Any], None] | None = None
        self.future.add_done_callback(lambda _f: self._wake())

    # ---- engine side ---------------------------------------------------------------------------------------
    def push(self, event: Any, wake: bool = True) -> None:
        """Hand the consumer an event; ``wake=False``: the caller wakes it later (``wake_all``: one wake-up of
        the consumer's loop for many handles)."""
        with self._lock:
            if self._forward is not None:  # an engine-core process relays it (engine_core/core_process.py)
                self._forward(event)
                return
            self._events.append(event)
        if wake:
            self._wake()

    @staticmethod
    def wake_all(handles: "list[RequestHandle]") -> None:
        """Wake the consumers of ``handles`` with one call into each of their loops."""
        by_loop: dict[Any, list[asyncio.Event]] = {}
        for h in handles:
            with h._lock:
                loop, wakeup = h._loop, h._wakeup
            if loop is not None and wakeup is not None and not loop.is_closed():
                by_loop.setdefault(loop, []).append(wakeup)
        for loop, wakeups in by_loop.items():
            loop.call_soon_threadsafe(_set_all, wakeups)

    def forward(self, fn: Callable[[Any], None]) -> None:
        """Hand every event to ``fn`` (in order: those pushed before this call first) instead of ``events()``:
        how an engine-core process relays a request's events to its front end. ``fn`` runs under the handle's
        lock, in the pushing thread: it must only queue."""
        with self._lock:
            while self._events:
                fn(self._events.popleft())
            self._forward = fn

    def _wake(self) -> None:
        with self._lock:
            loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None and not loop.is_closed():
            loop.call_soon_threadsafe(wakeup.set)

    # ---- consumer side -------------------------------------------------------------------------------------
    def cancel(self) -> bool:
        """Ask the engine to cancel this request (frees its resources)."""
        return self._on_cancel(self.request_id) if self._on_cancel is not None else False

    async def result(self) -> Res:
        """Await the final result (the future's exception is raised here)."""
        return await asyncio.wrap_future(self.future)

    async def events(self) -> AsyncIterator[Any]:
        """Intermediate events in order; ends when the future completes (read ``result()`` after for the end)."""
        while True:
            with self._lock:
                if self._events:
                    event = self._events.popleft()
                elif self.future.done():
                    return
                else:
                    if self._wakeup is None:
                        self._loop, self._wakeup = asyncio.get_running_loop(), asyncio.Event()
                    self._wakeup.clear()
                    event = _NOTHING
            if event is _NOTHING:
                await self._wakeup.wait()  # type: ignore[union-attr]
                continue
            yield event


_NOTHING = object()


def _set_all(events: list[asyncio.Event]) -> None:
    for e in events:
        e.set()


@runtime_checkable
class Engine(Protocol[Req, Res]):
    """The contract every engine implements (see the module docstring)."""

    def start(self) -> "Engine[Req, Res]": ...

    def submit(self, request: Req) -> RequestHandle[Res]: ...

    def cancel(self, request_id: str) -> bool: ...

    def stats(self) -> dict[str, float]: ...

    def health(self) -> EngineHealth: ...

    def drain(self, timeout_s: float | None = None) -> bool: ...

    def stop(self) -> None: ...

    @property
    def queue_depth(self) -> int: ...


class RetrievalService(Engine[RetrievalRequest, RetrievalResult], Protocol):
    """A retrieval engine as its app sees it: the contract, the hot-swappable catalog store, the model's
    vocabulary size and the search defaults (beam width and its bound)."""

    catalogs: "CatalogStore"
    vocab_size: int
    search: "SearchConfig"
    tokenizer: Any  # the model directory's own tokenizer (chat and text prompts), None without one


class PolicyName(Protocol):
    name: str


class RankingStatsView(Protocol):
    def summary(self) -> dict: ...


class RankingRunnerView(Protocol):
    """What the ranking app reads of the runner: the prefix policy's name, the cache statistics, and the KV
    precomputation of newly registered items."""

    policy: PolicyName

    @property
    def stats(self) -> RankingStatsView: ...

    def add_items(self, item_ids: list[int]) -> Any: ...


class RankingService(Engine[RankingRequest, RankingResult], Protocol):
    """A ranking engine as its app sees it: the contract, the user/item registry, and the runner's view."""

    @property
    def registry(self) -> "RankingRegistry": ...

    @property
    def runner(self) -> RankingRunnerView: ...

    on_batch: Callable[[int, int], None] | None  # called once per executed batch (the batch histograms)
