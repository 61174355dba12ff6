"""The GR retrieval engine: the batching core (``engine/batching.py``) around a ``RetrievalRunner``.

scheduler (``GRBatcher``: which requests form the next batch) → batching core (queue, executor threads, handles)
→ runner (``RetrievalRunner``: prefill + decode steps). Up to ``max_inflight_batches`` batches execute at once,
each on its own thread (torch ops release the GIL; on a GPU each executor would own a stream). Every batch takes
the catalog snapshot current at its start, so replacing the catalog never disturbs requests already running. A
failing batch fails only its own requests; the engine keeps serving. Implements ``engine.protocol.Engine``.

With ``--prefix-cache-tokens`` (``PrefixCacheConfig``) both runners share one prompt-prefix cache
(``kvcache/prefix_blocks.py``); each batch reserves its beam KV in the engine's ``KVBudget`` first and the cache
gives way to it. Each result says how many of its prompt tokens were loaded (``cached_tokens``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from grserve.catalog import Catalog, CatalogStore, generate_catalog, load_catalog
from grserve.catalog.duplicates import expand
from grserve.catalog.sid_text import bind_catalog
from grserve.config import (
    AccelConfig,
    ConfigError,
    EdgeConfig,
    PrefixCacheConfig,
    SchedulerConfig,
    SearchConfig,
    ServeConfig,
)
from grserve.engine.batching import BatchedEngine, BatchingCore, admission
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.tokenizer import model_tokenizer
from grserve.engine.types import RetrievalRequest, RetrievalResult, RetrievedItem
from grserve.engine.warmup import WarmupRun, warm_up, warmup_plan
from grserve.kvcache.prefix_blocks import KVBudget, PrefixBlockCache
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
        prefix: PrefixCacheConfig | None = None,
    ):
        self.model = model
        self.catalogs = catalogs
        self.tokenizer = None  # the model directory's own tokenizer (``build``), for SID token text
        self.layout_note: str | None = None  # what ``build`` inferred about the SID layout (printed at start-up)
        self.search = search or SearchConfig()
        self.scheduler = scheduler or SchedulerConfig()
        self.vocab_size = model.spec.vocab_size
        self.accel = accel
        self.runner = make_runner(model, self.search, accel)
        self.prefix_cfg = prefix or PrefixCacheConfig()
        self.kv_budget = KVBudget(self.prefix_cfg.kv_budget_bytes or None)
        self.prefix = make_prefix_cache(model, self.prefix_cfg, self.kv_budget)  # None when off
        self.runner.prefix = self.prefix
        self.runner.prefill_align = self.prefix_cfg.prefix_block_size
        self.warm = warm  # start() warms up first (engine/warmup.py); build() sets it from --warmup
        self.warmup_runs: list[WarmupRun] | None = None  # None until warmed up
        self._reference: RetrievalRunner | None = None  # made on the first batch with exclude_items (fast path)
        self._core = BatchingCore(self._execute, self.scheduler, "grserve-retrieval", on_batch,
                                  **admission(edge))

    @classmethod
    def build(cls, cfg: ServeConfig, on_batch: Callable[[int, int], None] | None = None) -> "RetrievalEngine":
        m = cfg.model
        model = load_model(m.source, dtype=m.dtype, device=m.device, seed=m.seed, quantization=m.quantization)
        tokenizer = model_tokenizer(m.source)
        catalog, note, bind = served_catalog(cfg, tokenizer)
        store = CatalogStore(catalog, vocab_size=model.spec.vocab_size, bind=bind)
        engine = cls(model, store, cfg.search, cfg.scheduler, on_batch, cfg.edge, cfg.accel, warm=cfg.search.warmup,
                     prefix=cfg.prefix)
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
        self.runner.prefix = None  # warm-up prompts are no one's prefix: they neither load nor store
        try:
            self.warmup_runs = warm_up(self.runner, catalog, plan, log)
        finally:
            self.runner.prefix = self.prefix
        return self.warmup_runs

    def stop(self) -> None:
        super().stop()
        self.runner.close()

    def stats(self) -> dict[str, float]:
        """The batching core's totals, and with a prefix cache its counters (``prefix_*``): prompt tokens looked
        up and reused, blocks stored / spilled / evicted / given way, bytes per tier, the hit rate."""
        out = dict(self._core.stats())
        if self.prefix is not None:
            s = self.prefix.stats
            out.update(prefix_prompt_tokens=s["lookup_tokens"], prefix_reused_tokens=s["hit_tokens"],
                       prefix_computed_tokens=s["lookup_tokens"] - s["hit_tokens"],
                       prefix_hit_rate=self.prefix.hit_rate, prefix_stored_blocks=s["stored_blocks"],
                       prefix_evicted_blocks=s["evicted_blocks"], prefix_spilled_blocks=s["spilled_blocks"],
                       prefix_gave_way_blocks=s["gave_way_blocks"])
            for tier, n in self.prefix.tier_bytes().items():
                out[f"prefix_bytes_{tier}"] = n
        return out

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
        beam_width = requests[0].beam_width
        beam_bytes = self._beam_kv_bytes(prompts, beam_width, catalog.depth)
        self.kv_budget.reserve(beam_bytes)  # the prefix cache gives way to the batch's beam KV
        try:
            if self.prefix is not None:
                self.prefix.give_way()
            if any(e is not None and len(e) for e in exclude) or any(a is not None for a in include) \
                    or any(t is not None for t in think) or any(r.logprobs for r in requests):
                out = self._reference_runner().run(prompts, beam_width, top_n, catalog, exclude=exclude,
                                                   include=include, think=think)
            else:
                out = self.runner.run(prompts, beam_width, top_n, catalog)
        finally:
            self.kv_budget.release(beam_bytes)
        done = time.perf_counter()
        thoughts = out.thoughts or [None] * len(requests)
        cached = out.cached_tokens or [0] * len(requests)
        return [RetrievalResult(request_id=r.request_id, items=_items(catalog, r, hits),
                                queue_ms=(start - r.arrival) * 1e3, compute_ms=(done - start) * 1e3,
                                batch_size=len(requests), candidates_visited=out.candidates_visited,
                                catalog_version=catalog.version, kv_bytes=kv_bytes,
                                thought=t.tokens if t is not None else None,
                                thought_forced=bool(t is not None and t.forced), cached_tokens=int(c))
                for r, hits, kv_bytes, t, c in zip(requests, out.hits, out.kv_bytes_per_request, thoughts, cached)]

    def _beam_kv_bytes(self, prompts, beam_width: int, depth: int) -> int:
        """The batch's beam KV, (Σ L_r + R·BW·ND) · bytes per token (``kvcache/beam.py``; thoughts not counted)."""
        per_token = self.model.spec.kv_bytes_per_token(self.model.dtype.itemsize)
        return (sum(int(p.shape[0]) for p in prompts) + len(prompts) * beam_width * depth) * per_token

    def _reference_runner(self) -> RetrievalRunner:
        """The runner for batches with ``exclude_items``, an allowlist or a thinking request: the host-driven
        reference path masks exclusions and allowlists and runs thoughts; the device fast path has none of them yet,
        so such batches take the reference path (never silently unmasked)."""
        if isinstance(self.runner, RetrievalRunner):
            return self.runner
        if self._reference is None:
            self._reference = RetrievalRunner(self.model, self.search, self.accel)
            self._reference.prefix = self.prefix
            self._reference.prefill_align = self.prefix_cfg.prefix_block_size
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
    return RetrievalRunner(model, search, accel)


def make_prefix_cache(model: Decoder, cfg: PrefixCacheConfig, budget: KVBudget) -> PrefixBlockCache | None:
    """The retrieval engine's prompt-prefix cache (``kvcache/prefix_blocks.py``), None when ``cfg`` leaves it off;
    its K/V in the model's dtype on the model's device (a host tier only on CUDA)."""
    if not cfg.enabled:
        return None
    if cfg.prefix_cache_host_tokens and model.device.type != "cuda":
        raise ConfigError("prefix_cache_host_tokens", f"a host tier needs a CUDA device (the model is on "
                                                      f"{model.device}: one tier is all the memory there is)")
    spec = model.spec
    return PrefixBlockCache(cfg.prefix_cache_tokens, block_size=cfg.prefix_block_size,
                            num_layers=spec.num_hidden_layers, num_kv_heads=spec.num_key_value_heads,
                            head_dim=spec.head_dim, dtype=model.dtype, device=model.device,
                            policy=cfg.prefix_cache_policy, host_tokens=cfg.prefix_cache_host_tokens, budget=budget,
                            train_async=True)  # a learned policy's refit never runs inside a batch


def served_catalog(cfg: ServeConfig, tokenizer) -> tuple[Catalog, str | None, Callable[[Catalog], Catalog]]:
    """The catalog of the flags bound to the served model (SID token strings → the tokenizer's ids), what was
    inferred about its layout, and how a reload is bound alike (the popularity order of duplicate SIDs kept): the
    engine's store and an engine process's front-end copy are built from it."""
    catalog, note = bind_catalog(build_catalog(cfg), tokenizer)
    order = group_order(cfg.catalog)
    return catalog, note, lambda c: bind_catalog(c.with_group_order(order), tokenizer)[0]


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
