"""The GR retrieval engine: the batching core (``engine/batching.py``) around a ``RetrievalRunner``.

scheduler (``GRBatcher``: which requests form the next batch) → batching core (queue, executor threads, handles)
→ runner (``RetrievalRunner``: prefill + decode steps). Up to ``max_inflight_batches`` batches execute at once,
each on its own thread (torch ops release the GIL; on a GPU each executor would own a stream). Every batch takes
the catalog snapshot current at its start, so replacing the catalog never disturbs requests already running. A
failing batch fails only its own requests; the engine keeps serving. Implements ``engine.protocol.Engine``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from grserve.catalog import Catalog, CatalogStore, generate_catalog, load_catalog
from grserve.config import AccelConfig, EdgeConfig, SchedulerConfig, SearchConfig, ServeConfig
from grserve.engine.batching import BatchedEngine, BatchingCore, admission
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.model import Decoder, load_model


class RetrievalEngine(BatchedEngine):
    def __init__(
        self,
        model: Decoder,
        catalogs: CatalogStore,
        search: SearchConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        on_batch: Callable[[int, int], None] | None = None,
        edge: EdgeConfig | None = None,
        accel: AccelConfig | None = None,
    ):
        self.model = model
        self.catalogs = catalogs
        self.search = search or SearchConfig()
        self.scheduler = scheduler or SchedulerConfig()
        self.vocab_size = model.spec.vocab_size
        self.runner = make_runner(model, self.search, accel)
        self._reference: RetrievalRunner | None = None  # made on the first batch with exclude_items (fast path)
        self._core = BatchingCore(self._execute, self.scheduler, "grserve-retrieval", on_batch,
                                  **admission(edge))

    @classmethod
    def build(cls, cfg: ServeConfig, on_batch: Callable[[int, int], None] | None = None) -> "RetrievalEngine":
        m = cfg.model
        model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed)
        store = CatalogStore(build_catalog(cfg), vocab_size=model.spec.vocab_size)
        return cls(model, store, cfg.search, cfg.scheduler, on_batch, cfg.edge, cfg.accel)

    # ---- the mode's part of the Engine contract ------------------------------------------------------------
    def stop(self) -> None:
        super().stop()
        self.runner.close()

    def health_detail(self) -> dict:
        return {"catalog_version": self.catalogs.current().version}

    @property
    def batches_run(self) -> int:
        return self._core.batches_run

    @property
    def peak_inflight(self) -> int:
        return self._core.peak_inflight

    # ---- one batch ---------------------------------------------------------------------------------------
    def run_batch(self, requests: list[RetrievalRequest]) -> list[RetrievalResult]:
        """Run one batch now, in the caller's thread (the offline API, ``grserve.recommender``); requests of one
        beam width."""
        return self._execute(requests)

    def _execute(self, requests: list[RetrievalRequest]) -> list[RetrievalResult]:
        catalog = self.catalogs.current()
        start = time.perf_counter()
        exclude = [r.exclude_items for r in requests]
        prompts, top_n = [r.prompt_tokens for r in requests], [r.top_n for r in requests]
        if any(e is not None and len(e) for e in exclude):
            out = self._exclusion_runner().run(prompts, requests[0].beam_width, top_n, catalog, exclude=exclude)
        else:
            out = self.runner.run(prompts, requests[0].beam_width, top_n, catalog)
        done = time.perf_counter()
        return [RetrievalResult(request_id=r.request_id, items=[RetrievedItem(h.item_id, h.sid, h.score) for h in hits],
                                queue_ms=(start - r.arrival) * 1e3, compute_ms=(done - start) * 1e3,
                                batch_size=len(requests), candidates_visited=out.candidates_visited,
                                catalog_version=catalog.version, kv_bytes=kv_bytes)
                for r, hits, kv_bytes in zip(requests, out.hits, out.kv_bytes_per_request)]


    def _exclusion_runner(self) -> RetrievalRunner:
        """The runner for batches with ``exclude_items``: the host-driven reference path masks them; the device fast
        path has no exclusion mask yet, so such batches take the reference path (never silently unmasked)."""
        if isinstance(self.runner, RetrievalRunner):
            return self.runner
        if self._reference is None:
            self._reference = RetrievalRunner(self.model, self.search)
        return self._reference


def make_runner(model: Decoder, search: SearchConfig, accel: AccelConfig | None = None):
    """The backend switch: the device fast path (``engine/device_runner.py``) when ``accel`` asks for it on this
    device, else the host-driven ``RetrievalRunner`` (the reference; the CPU default)."""
    if accel is not None and accel.use_fast_path(str(model.device)):
        from grserve.engine.device_runner import DeviceRetrievalRunner

        return DeviceRetrievalRunner(model, search, accel)
    return RetrievalRunner(model, search)


def build_catalog(cfg: ServeConfig) -> Catalog:
    c = cfg.catalog
    if c.path:
        return load_catalog(c.path, token_offset=c.token_offset)
    return generate_catalog(c.num_items, c.depth, c.codebook_size, c.seed, c.token_offset)
