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
from grserve.catalog.duplicates import expand
from grserve.catalog.sid_text import bind_catalog
from grserve.config import AccelConfig, EdgeConfig, SchedulerConfig, SearchConfig, ServeConfig
from grserve.engine.batching import BatchedEngine, BatchingCore, admission
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.tokenizer import model_tokenizer
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.engine.warmup import WarmupRun, warm_up, warmup_plan
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
        warm: bool = False,
    ):
        self.model = model
        self.catalogs = catalogs
        self.tokenizer = None  # the model directory's own tokenizer (``build``), for SID token text
        self.layout_note: str | None = None  # what ``build`` inferred about the SID layout (printed at start-up)
        self.search = search or SearchConfig()
        self.scheduler = scheduler or SchedulerConfig()
        self.vocab_size = model.spec.vocab_size
        self.runner = make_runner(model, self.search, accel)
        self.warm = warm  # start() warms up first (engine/warmup.py); build() sets it from --warmup
        self.warmup_runs: list[WarmupRun] | None = None  # None until warmed up
        self._reference: RetrievalRunner | None = None  # made on the first batch with exclude_items (fast path)
        self._core = BatchingCore(self._execute, self.scheduler, "grserve-retrieval", on_batch,
                                  **admission(edge))

    @classmethod
    def build(cls, cfg: ServeConfig, on_batch: Callable[[int, int], None] | None = None) -> "RetrievalEngine":
        m = cfg.model
        model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed)
        tokenizer = model_tokenizer(m.source)
        catalog, note = bind_catalog(build_catalog(cfg), tokenizer)  # SID token strings → the tokenizer's ids
        order = group_order(cfg.catalog)
        store = CatalogStore(catalog, vocab_size=model.spec.vocab_size,
                             bind=lambda c: bind_catalog(c.with_group_order(order), tokenizer)[0])
        engine = cls(model, store, cfg.search, cfg.scheduler, on_batch, cfg.edge, cfg.accel, warm=cfg.search.warmup)
        engine.tokenizer, engine.layout_note = tokenizer, note
        return engine

    # ---- the mode's part of the Engine contract ------------------------------------------------------------
    def start(self) -> "RetrievalEngine":
        """Warm up first when ``warm`` (and not yet done), then open the queue: ``health()`` is ``ok`` only after."""
        if self.warm and self.warmup_runs is None:
            self.warm_up()
        return super().start()

    def warm_up(self, log: Callable[[str], None] | None = None) -> list[WarmupRun]:
        """One untimed batch per warm-up beam width and batch bucket through the runner, against the current
        catalog (``engine/warmup.py``); ``log`` gets a line per batch."""
        catalog = self.catalogs.current()
        plan = warmup_plan(self.runner, self.search, self.scheduler, catalog)
        self.warmup_runs = warm_up(self.runner, catalog, plan, log)
        return self.warmup_runs

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
        exclude, include = [r.exclude_items for r in requests], [r.include for r in requests]
        think = [r.think for r in requests]
        prompts, top_n = [r.prompt_tokens for r in requests], [r.top_n for r in requests]
        if any(e is not None and len(e) for e in exclude) or any(a is not None for a in include) \
                or any(t is not None for t in think) or any(r.logprobs for r in requests):
            out = self._reference_runner().run(prompts, requests[0].beam_width, top_n, catalog, exclude=exclude,
                                               include=include, think=think)
        else:
            out = self.runner.run(prompts, requests[0].beam_width, top_n, catalog)
        done = time.perf_counter()
        thoughts = out.thoughts or [None] * len(requests)
        return [RetrievalResult(request_id=r.request_id, items=_items(catalog, r, hits),
                                queue_ms=(start - r.arrival) * 1e3, compute_ms=(done - start) * 1e3,
                                batch_size=len(requests), candidates_visited=out.candidates_visited,
                                catalog_version=catalog.version, kv_bytes=kv_bytes,
                                thought=t.tokens if t is not None else None,
                                thought_forced=bool(t is not None and t.forced))
                for r, hits, kv_bytes, t in zip(requests, out.hits, out.kv_bytes_per_request, thoughts)]


    def _reference_runner(self) -> RetrievalRunner:
        """The runner for batches with ``exclude_items``, an allowlist or a thinking request: the host-driven
        reference path masks exclusions and allowlists and runs thoughts; the device fast path has none of them yet,
        so such batches take the reference path (never silently unmasked)."""
        if isinstance(self.runner, RetrievalRunner):
            return self.runner
        if self._reference is None:
            self._reference = RetrievalRunner(self.model, self.search)
        return self._reference


def _items(catalog: Catalog, req: RetrievalRequest, hits) -> list[RetrievedItem]:
    """A request's answer from its SID hits: each SID's items where several share it (``catalog/duplicates.py``)."""
    ranked = [(h.item_id, h) for h in hits]
    if catalog.groups is not None:
        include = req.include.items if req.include is not None else None
        ranked = expand(catalog, ranked, req.top_n, req.exclude_items, include)
    return [RetrievedItem(i, h.sid, h.score, h.token_logprobs) for i, h in ranked]


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
        catalog = load_catalog(c.path, token_offset=c.token_offset, duplicate_sids=c.duplicate_sids)
        return catalog.with_group_order(group_order(c))
    return generate_catalog(c.num_items, c.depth, c.codebook_size, c.seed, c.token_offset)


def group_order(c) -> Callable:
    """``counts_of(item ids)``: the order of the items of one SID (``--popularity``; without it, all count 0: by
    item id)."""
    from grserve.catalog.popularity import Popularity

    return (Popularity.load(c.popularity) if c.popularity else Popularity()).counts_of
