"""The LLM app: the OpenAI-compatible routes ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not),
``/v1/models``, ``/v1/models/{id}``, and vLLM's ``/tokenize``, ``/detokenize``, ``/version`` on the shared app
(``server/http/app.py``: the shared metrics with the LLM engine's gauges, ``/health`` with the pool state,
``/metrics`` with the request metrics of ``metrics.py`` labelled by ``model_name``); each route's policy is its row
of ``routes()``, every error in OpenAI's shape.

Typed bodies and responses (``inputs/openai_schemas.py``, which also rejects every parameter that is not
implemented); a request's sampling parameters and limits are ``inputs/generation.py``'s; it runs on the engine as
``generate.py`` says.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute

from grserve.config import EdgeConfig
from grserve.engine.protocol import Engine
from grserve.engine.structured import GrammarError
from grserve.inputs.generation import DEFAULT_MAX_TOKENS
from grserve.inputs.limits import PromptLimits
from grserve.inputs.openai_schemas import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from grserve.inputs.openai_tools import PARSERS, tool_spec
from grserve.inputs.refusal import ApiError, token_ids
from grserve.server.http.app import new_app
from grserve.server.http.bodies import off_loop
from grserve.server.http.metrics import Metrics
from grserve.server.http.routes import Route, RouteTable, documented
from grserve.server.llm.answers import ChatShape, CompletionShape
from grserve.server.llm.generate import OpenAIContext, generate
from grserve.server.llm.metrics import LLMMetrics, StatusCounter

HEALTH_STATS = ("waiting", "free_blocks", "total_blocks")  # engine.stats() keys /health shows


def routes(limits: PromptLimits) -> RouteTable:
    """The LLM app's route table: every error in OpenAI's shape; the routes that queue work in the engine (or, for
    /tokenize, in the heavy-work pool) counted by admission from the edge on."""
    return RouteTable([
        Route("POST", "/v1/completions", queued=True, precheck=limits.completion_precheck, openai=True),
        Route("POST", "/v1/chat/completions", queued=True, precheck=limits.chat_precheck, openai=True),
        Route("POST", "/tokenize", queued=True, precheck=limits.tokenize_precheck, openai=True),
        Route("POST", "/detokenize", precheck=limits.detokenize_precheck, openai=True),
        Route("GET", "/v1/models", openai=True),
        Route("GET", "/v1/models/{model_id:path}", openai=True),
        Route("GET", "/version", openai=True),
    ], openai=True)


def create_llm_app(engine: Engine, tokenizer: Any, model_name: str, max_model_len: int, vocab_size: int,
                   metrics: Metrics | None = None, edge: EdgeConfig | None = None, *, max_n: int = 16,
                   max_logprobs: int = 20, max_messages: int = 2048, tool_call_parser: str = "hermes") -> FastAPI:
    """The LLM app around a started (or to-be-started) LLM engine; the caller owns start/stop."""
    if tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {tool_call_parser!r}")

    def detail() -> dict:
        stats = engine.stats()
        return {"model": model_name, **{k: stats[k] for k in HEALTH_STATS if k in stats}}

    limits = PromptLimits(max_model_len, getattr(tokenizer, "max_token_chars", None), max_messages)
    app = new_app(engine, metrics, routes(limits), title="grserve LLM", detail=detail, edge=edge,
                  description="An LLM behind an OpenAI-compatible API, on the hybrid-cache continuous-batching engine.")
    app.state.metrics.bind_llm_stats(engine.stats, model_name)
    llm_metrics = LLMMetrics(app.state.metrics.registry, model_name, max_model_len)
    app.state.llm_metrics = llm_metrics
    app.add_middleware(StatusCounter, metrics=llm_metrics)
    ctx = OpenAIContext(engine, tokenizer, model_name, max_model_len, vocab_size, llm_metrics, max_n, max_logprobs)
    app.include_router(create_openai_router(ctx, tool_call_parser, app.router.route_class))
    return app


def create_openai_router(ctx: OpenAIContext, tool_call_parser: str = "hermes",
                         route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The OpenAI routes around an LLM engine (``ctx``: the Engine protocol; events are ``TokenEvent``\\ s). Bodies
    are parsed and validated off the event loop after the cheap length checks of ``inputs/limits.py``
    (``route_class``: the app's, ``bodies.body_route``); templates and the tokenizer run off it too."""
    tokenizer, model_name, vocab_size = ctx.tokenizer, ctx.model_name, ctx.vocab_size
    router = APIRouter(route_class=route_class)

    @router.post("/v1/completions", response_model=CompletionResponse, responses=documented(400, 404, 500, 503))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        ctx.check_limits(body)
        p = body.prompt
        if isinstance(p, list) and isinstance(p[0], int):
            ids = token_ids(p, vocab_size, "prompt").tolist()  # type: ignore[arg-type]
            text = await off_loop(tokenizer.decode, ids) if body.echo else ""
        else:
            text = p[0] if isinstance(p, list) else p
            ids = await ctx.encode(text, "prompt")
        shape = CompletionShape(f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model_name, tokenizer,
                                text if body.echo else "")
        return await generate(ctx, request, body, ids, body.requested_max_tokens() or DEFAULT_MAX_TOKENS, shape)

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=documented(400, 404, 500, 503))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        ctx.check_limits(body)
        plan = body.tool_plan
        try:
            spec = await off_loop(tool_spec, plan, tool_call_parser)  # required / a named function: a grammar
        except GrammarError as exc:
            raise ApiError(400, f"tools: a tool's parameters cannot be compiled: {exc}", "tools",
                           "invalid_value") from None
        if spec is not None and body.structured_spec() is not None:
            raise ApiError(400, "tool_choice 'required' or a named function cannot be combined with a structured "
                                "output field", "tool_choice", "invalid_value")
        ids = await off_loop(ctx.chat_ids, body.messages, body.tools or None)
        shape = ChatShape(f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time()), model_name, tokenizer, plan,
                          tool_call_parser)
        return await generate(ctx, request, body, ids, body.requested_max_tokens(), shape, spec)

    add_utility_routes(router, ctx)
    return router


def add_utility_routes(router: APIRouter, ctx: OpenAIContext) -> None:
    """``/v1/models``, ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/version``."""

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ctx.card()])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=documented(400, 404, 500, 503))
    async def model(model_id: str) -> ModelCard:
        ctx.check_model(model_id)
        return ctx.card()

    @router.post("/tokenize", response_model=TokenizeResponse, responses=documented(400, 404, 500, 503))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        if body.messages is not None:
            ids = await off_loop(ctx.chat_ids, body.messages, None, body.add_generation_prompt,
                                 bool(body.add_special_tokens))
        else:
            ids = await ctx.encode(body.prompt, "prompt", body.add_special_tokens is not False)
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=documented(400, 404, 500, 503))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)
        ids = token_ids(body.tokens, ctx.vocab_size, "tokens").tolist()
        return DetokenizeResponse(prompt=await off_loop(ctx.tokenizer.decode, ids))

    @router.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        from grserve import __version__

        return VersionResponse(version=__version__)
