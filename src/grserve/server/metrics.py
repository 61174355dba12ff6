"""Prometheus metrics of every grserve server. Each ``Metrics`` owns its own registry, so many apps can live in
one process (tests).

All modes: ``grserve_requests_total{route,status}`` and ``grserve_request_latency_seconds{route}`` (route
templates only; "unmatched" for unknown paths), ``grserve_queue_depth``. Retrieval/ranking: the batch
histograms (``on_batch``) and ``grserve_items_returned``. LLM (``bind_llm_stats``): ``grserve_llm_running``,
``_waiting``, ``_free_blocks``, ``_preemptions``, ``_prefix_hit_tokens``, ``_prefill_tokens``, and co-location's
``_offline_preemptions``, ``_offline_deferred``, ``_running_online``, ``_running_offline``, ``_waiting_online``,
``_waiting_offline``, read from the engine's ``stats()`` at scrape time.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
ITEMS_BUCKETS = (0, 1, 5, 10, 20, 50, 100, 200, 500, 1000)
LLM_GAUGES = (  # engine.stats() key → help; exported as grserve_llm_<key>
    ("running", "Requests holding cache blocks."),
    ("waiting", "Requests waiting (new or preempted)."),
    ("free_blocks", "Free blocks in the unified pool."),
    ("preemptions", "Preemptions so far (recompute)."),
    ("prefix_hit_tokens", "Prompt tokens copied from the prefix cache instead of computed."),
    ("prefill_tokens", "Prompt tokens computed."),
    ("offline_preemptions", "Preemptions of offline requests so far (co-location)."),
    ("offline_deferred", "Offline rows the latency model kept out of a step with online work (per step)."),
    ("running_online", "Online requests holding cache blocks."),
    ("running_offline", "Offline requests holding cache blocks."),
    ("waiting_online", "Online requests waiting."),
    ("waiting_offline", "Offline requests waiting."),
)


def _read(fn: Callable[[], float]) -> float:
    """A scrape must never fail because the engine is shutting down: NaN instead."""
    try:
        return float(fn())
    except Exception:  # noqa: BLE001
        return float("nan")


class Metrics:
    def __init__(self, queue_depth: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests_total = Counter(
            "grserve_requests_total", "HTTP requests by route template and status code.",
            ["route", "status"], registry=self.registry)
        self.request_latency = Histogram(
            "grserve_request_latency_seconds", "HTTP request latency (received → response sent), by route.",
            ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram(
            "grserve_batch_size", "Requests per executed engine batch.",
            buckets=BATCH_SIZE_BUCKETS, registry=self.registry)
        self.batch_tokens = Histogram(
            "grserve_batch_tokens", "Prompt tokens per executed engine batch.",
            buckets=BATCH_TOKEN_BUCKETS, registry=self.registry)
        self.queue_depth = Gauge(
            "grserve_queue_depth", "Requests waiting in the engine queue (read at scrape time).",
            registry=self.registry)
        self.items_returned = Histogram(
            "grserve_items_returned", "Items returned per successful recommendation.",
            buckets=ITEMS_BUCKETS, registry=self.registry)
        self._queue_depth_fn: Callable[[], int] = lambda: 0
        self.queue_depth.set_function(lambda: _read(self._queue_depth_fn))
        self._llm_stats: Callable[[], dict] | None = None
        if queue_depth is not None:
            self.bind_queue_depth(queue_depth)

    # --- sources -----------------------------------------------------------------------------------------
    def bind_queue_depth(self, fn: Callable[[], int]) -> None:
        """Read the queue depth from ``fn`` at every scrape (the engine is usually built after the metrics)."""
        self._queue_depth_fn = fn

    def bind_llm_stats(self, stats: Callable[[], dict]) -> None:
        """Export the LLM engine's gauges (``LLM_GAUGES``), read from ``stats()`` at every scrape."""
        first = self._llm_stats is None
        self._llm_stats = stats
        if first:
            for key, help_text in LLM_GAUGES:
                Gauge(f"grserve_llm_{key}", help_text, registry=self.registry).set_function(
                    lambda k=key: _read(lambda: self._llm_stats()[k]))  # type: ignore[misc]

    def on_batch(self, num_requests: int, num_tokens: int) -> None:
        """Engine callback, once per executed batch (called from the engine's threads; prometheus is thread-safe)."""
        self.batch_size.observe(num_requests)
        self.batch_tokens.observe(num_tokens)

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        self.requests_total.labels(route=route, status=str(status)).inc()
        self.request_latency.labels(route=route).observe(seconds)

    def observe_items(self, n: int) -> None:
        self.items_returned.observe(n)

    # --- exposition --------------------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class MetricsMiddleware:
    """Pure-ASGI request counter and latency histogram, labelled by route *template* ("/v1/rank"); a path no
    route matches is labelled "unmatched", never verbatim (a bounded label set whatever clients send)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.observe_request(name, status[0], time.perf_counter() - start)
