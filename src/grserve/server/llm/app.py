"""The LLM app: the OpenAI-compatible routes (``openai_routes.py``) on the shared app (``app.py``) (OpenAI-shaped
errors, the shared metrics with the LLM engine's gauges, ``/health`` with the pool state, ``/metrics`` with the
request metrics of ``llm_metrics.py`` labelled by ``model_name``)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from grserve.config import EdgeConfig
from grserve.engine.protocol import Engine
from grserve.server.http.app import new_app
from grserve.server.llm.metrics import LLMMetrics, StatusCounter
from grserve.server.http.metrics import Metrics
from grserve.server.llm.routes import create_openai_router

HEALTH_STATS = ("waiting", "free_blocks", "total_blocks")  # engine.stats() keys /health shows
# the routes counted by admission (``admission.py``): they queue work in the engine, /tokenize in the heavy pool
QUEUED_ROUTES = frozenset({("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")})


def create_llm_app(engine: Engine, tokenizer: Any, model_name: str, max_model_len: int, vocab_size: int,
                   metrics: Metrics | None = None, edge: EdgeConfig | None = None, *, max_n: int = 16,
                   max_logprobs: int = 20, max_messages: int = 2048, tool_call_parser: str = "hermes") -> FastAPI:
    """The LLM app around a started (or to-be-started) LLM engine; the caller owns start/stop."""

    def detail() -> dict:
        stats = engine.stats()
        return {"model": model_name, **{k: stats[k] for k in HEALTH_STATS if k in stats}}

    app = new_app(engine, metrics, title="grserve LLM", openai=True, detail=detail, edge=edge,
                  queued_routes=QUEUED_ROUTES,
                  description="An LLM behind an OpenAI-compatible API, on the hybrid-cache continuous-batching engine.")
    app.state.metrics.bind_llm_stats(engine.stats, model_name)
    llm_metrics = LLMMetrics(app.state.metrics.registry, model_name, max_model_len)
    app.state.llm_metrics = llm_metrics
    app.add_middleware(StatusCounter, metrics=llm_metrics)
    app.include_router(create_openai_router(engine, tokenizer, model_name, max_model_len, vocab_size, llm_metrics,
                                            max_n=max_n, max_logprobs=max_logprobs, max_messages=max_messages,
                                            tool_call_parser=tool_call_parser))
    return app
