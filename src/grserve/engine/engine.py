"""The GR retrieval engine: a batching thread, a pool of batch executors, futures back to the caller.

scheduler (``GRBatcher``: which requests form the next batch) → engine (this loop) → runner (``RetrievalRunner``:
prefill + decode steps). Up to ``max_inflight_batches`` batches execute at once, each on its own thread (torch
ops release the GIL; on a GPU each executor would own a stream). Every batch takes the catalog snapshot current
at its start, so replacing the catalog never disturbs requests already running. A failing batch fails only its
own requests; the engine keeps serving.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


from grserve.catalog import Catalog, CatalogStore, generate_catalog, load_catalog
from grserve.config import SchedulerConfig, SearchConfig, ServeConfig
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.model import Decoder, load_model
from grserve.scheduler.gr_batching import Batch, GRBatcher

class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class RetrievalEngine:
    def __init__(
        self,
        model: Decoder,
        catalogs: CatalogStore,
        search: SearchConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        on_batch: Callable[[int, int], None] | None = None,
    ):
        self.model = model
        self.catalogs = catalogs
        self.search = search or SearchConfig()
        self.scheduler = scheduler or SchedulerConfig()
        self.vocab_size = model.spec.vocab_size
        self.on_batch = on_batch
        self.runner = RetrievalRunner(model, self.search)
        self._batcher: GRBatcher[_Pending] = GRBatcher(self.scheduler)
        self._cond = threading.Condition()
        self._inflight = 0
        self._running = False
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(self.scheduler.max_inflight_batches, thread_name_prefix="grserve-batch")
        self.batches_run = 0
        self.peak_inflight = 0  # most batches executing at once so far

    @classmethod
    def build(cls, cfg: ServeConfig, on_batch: Callable[[int, int], None] | None = None) -> "RetrievalEngine":
        m = cfg.model
        model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed)
        store = CatalogStore(build_catalog(cfg), vocab_size=model.spec.vocab_size)
        return cls(model, store, cfg.search, cfg.scheduler, on_batch)

    # ---- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> "RetrievalEngine":
        if not self._running:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="grserve-batcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=True)
        self.runner.close()

    def __enter__(self) -> "RetrievalEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests -----------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._batcher)

    def submit(self, req: RetrievalRequest) -> Future[RetrievalResult]:
        fut: Future[RetrievalResult] = Future()
        with self._cond:
            if len(self._batcher) >= self.scheduler.max_queue:
                raise EngineOverloaded(f"{len(self._batcher)} requests waiting (max_queue={self.scheduler.max_queue})")
            self._batcher.add(_Pending(req, fut))
            self._cond.notify_all()
        return fut

    async def recommend(self, req: RetrievalRequest) -> RetrievalResult:
        return await asyncio.wrap_future(self.submit(req))

    # ---- internals ----------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                batch = None
                while self._running:
                    idle = self.scheduler.max_inflight_batches - self._inflight
                    batch = self._batcher.pop_ready(time.perf_counter(), idle)
                    if batch is not None:
                        break
                    deadline = self._batcher.next_deadline() if idle > 0 else None
                    timeout = None if deadline is None else max(deadline - time.perf_counter(), 0.0005)
                    self._cond.wait(timeout)
                if not self._running:
                    return
                self._inflight += 1
                self.peak_inflight = max(self.peak_inflight, self._inflight)
            self._pool.submit(self._execute, batch)

    def _execute(self, batch: Batch["_Pending"]) -> None:
        try:
            catalog = self.catalogs.current()
            start = time.perf_counter()
            out = self.runner.run(
                [p.req.prompt_tokens for p in batch.requests],
                batch.beam_width,
                [p.req.top_n for p in batch.requests],
                catalog,
            )
            done = time.perf_counter()
            for p, hits, kv_bytes in zip(batch.requests, out.hits, out.kv_bytes_per_request):
                p.future.set_result(
                    RetrievalResult(
                        request_id=p.req.request_id,
                        items=[RetrievedItem(h.item_id, h.sid, h.score) for h in hits],
                        queue_ms=(start - p.req.arrival) * 1e3,
                        compute_ms=(done - start) * 1e3,
                        batch_size=len(batch.requests),
                        candidates_visited=out.candidates_visited,
                        catalog_version=catalog.version,
                        kv_bytes=kv_bytes,
                    )
                )
            self.batches_run += 1
            if self.on_batch is not None:
                self.on_batch(len(batch.requests), batch.num_tokens)
        except BaseException as exc:  # a failing batch fails its own requests only
            for p in batch.requests:
                if not p.future.done():
                    p.future.set_exception(exc)
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()


class _Pending:
    __slots__ = ("req", "future")

    def __init__(self, req: RetrievalRequest, future: Future):
        self.req, self.future = req, future

    @property
    def beam_width(self) -> int:
        return self.req.beam_width

    @property
    def arrival(self) -> float:
        return self.req.arrival

    @property
    def num_tokens(self) -> int:
        return self.req.num_tokens


def build_catalog(cfg: ServeConfig) -> Catalog:
    c = cfg.catalog
    if c.path:
        return load_catalog(c.path, token_offset=c.token_offset)
    return generate_catalog(c.num_items, c.depth, c.codebook_size, c.seed, c.token_offset)
