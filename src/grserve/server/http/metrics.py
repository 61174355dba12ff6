"""Prometheus metrics of every grserve server. Each ``Metrics`` owns its own registry, so many apps can live in
one process (tests).

All modes: ``grserve_requests_total{route,status}`` and ``grserve_request_latency_seconds{route}`` (route
templates only; "unmatched" for unknown paths; buckets up to 120 s, past the default queue deadline),
``grserve_queue_depth``, ``grserve_requests_pending`` (admitted, not yet queued: ``edge.py``).
Retrieval/ranking: the batch histograms (``on_batch``), ``grserve_items_returned``, and the engine's totals
(``bind_gr_stats``). LLM: the engine's gauges and counters (``bind_llm_stats``). Both read ``stats()`` at scrape
time (``engine_metrics.py``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from grserve.server.http.engine_metrics import GRStatsCollector, LLMStatsCollector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
BATCH_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
ITEMS_BUCKETS = (0, 1, 5, 10, 20, 50, 100, 200, 500, 1000)
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
        self.pending = Gauge(
            "grserve_requests_pending", "Requests admitted at the edge and not yet in the engine queue (body, "
            "parsing, tokenization; counted against --max-waiting with the queue).", registry=self.registry)
        self._queue_depth_fn: Callable[[], int] = lambda: 0
        self._pending_fn: Callable[[], int] = lambda: 0
        self.queue_depth.set_function(lambda: _read(self._queue_depth_fn))
        self.pending.set_function(lambda: _read(self._pending_fn))
        self._collectors: set[str] = set()
        if queue_depth is not None:
            self.bind_queue_depth(queue_depth)

    # --- sources -----------------------------------------------------------------------------------------
    def bind_queue_depth(self, fn: Callable[[], int]) -> None:
        """Read the queue depth from ``fn`` at every scrape (the engine is usually built after the metrics)."""
        self._queue_depth_fn = fn

    def bind_pending(self, fn: Callable[[], int]) -> None:
        """Read the admitted-but-not-queued count (``edge.Admission``) from ``fn`` at every scrape."""
        self._pending_fn = fn

    def bind_llm_stats(self, stats: Callable[[], dict], model_name: str | None = None) -> None:
        """Export the LLM engine's gauges and counters, read from ``stats()`` at every scrape (once per registry),
        labelled with ``model_name`` when given (and then also under vLLM's names)."""
        self._register("llm", LLMStatsCollector(stats, model_name))

    def bind_gr_stats(self, stats: Callable[[], dict], ranking: Callable[[], dict] | None = None) -> None:
        """Export a retrieval or ranking engine's totals (and, with ``ranking``, its caches'), read at every
        scrape (once per registry)."""
        self._register("gr", GRStatsCollector(stats, ranking))

    def _register(self, kind: str, collector: Any) -> None:
        if kind not in self._collectors:
            self._collectors.add(kind)
            self.registry.register(collector)

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
