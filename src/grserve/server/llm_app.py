"""The LLM HTTP app: the OpenAI-compatible routes plus /health and /metrics around an engine loop."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from grserve.engine.llm import EngineLoop, LLMEngine
from grserve.server.openai_routes import create_openai_router, openai_error


def build_app(loop: EngineLoop, tokenizer, model_name: str, max_model_len: int, vocab_size: int) -> FastAPI:
    engine: LLMEngine = loop.engine
    app = FastAPI(title="grserve LLM", docs_url=None, redoc_url=None)
    app.include_router(create_openai_router(loop, tokenizer, model_name, max_model_len, vocab_size))
    reg = CollectorRegistry(auto_describe=True)
    Gauge("grserve_llm_running", "Requests holding cache blocks.", registry=reg).set_function(
        lambda: len(engine.running))
    Gauge("grserve_llm_waiting", "Requests waiting (new or preempted).", registry=reg).set_function(
        lambda: len(engine.waiting))
    Gauge("grserve_llm_free_blocks", "Free blocks in the unified pool.", registry=reg).set_function(
        lambda: engine.pool.num_free)
    Gauge("grserve_llm_preemptions", "Preemptions so far (recompute).", registry=reg).set_function(
        lambda: engine.stats["preemptions"])
    Gauge("grserve_llm_prefix_hit_tokens", "Prompt tokens copied from the prefix cache instead of computed.",
          registry=reg).set_function(lambda: engine.stats["prefix_hit_tokens"])
    Gauge("grserve_llm_prefill_tokens", "Prompt tokens computed.", registry=reg).set_function(
        lambda: engine.stats["prefill_tokens"])
    requests = Counter("grserve_llm_http_requests_total", "HTTP requests by path and status.",
                       ["path", "status"], registry=reg)

    @app.middleware("http")
    async def count(request: Request, call_next):
        resp = await call_next(request)
        requests.labels(request.url.path, str(resp.status_code)).inc()
        return resp

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return openai_error(404, f"no route {request.url.path}", None, "not_found")

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return openai_error(500, "internal error", None, "internal_error")

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "model": model_name, "running": len(engine.running),
                             "waiting": len(engine.waiting), "free_blocks": engine.pool.num_free,
                             "total_blocks": engine.pool.num_blocks})

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
