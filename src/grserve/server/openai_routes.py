"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming or not), ``/v1/models``.

Typed bodies and responses (``openai_schemas.py``); errors in OpenAI's shape (the LLM app installs that family's
handlers, ``server/core.py``). A request runs on the LLM engine through the Engine protocol: ``submit`` → its
handle's token events (streamed as chunks, or collected) → ``result()``. A client that disconnects has its
request cancelled, which frees its blocks at once: streaming, when the response stream is cancelled;
non-streaming, when the disconnect arrives (``core.finish`` watches for it).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from grserve.engine.protocol import RequestHandle
from grserve.engine.sampling import SamplingParams
from grserve.engine.types import LLMRequest
from grserve.server.core import ApiError, finish, submit, token_ids
from grserve.server.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
)

log = logging.getLogger("grserve.server")
_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 404, 500, 503)}
DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI
DEFAULT_CHAT_MAX_TOKENS = 256  # /v1/chat/completions without max_tokens: at most this, at most what fits


def _finish_reason(reason: str | None) -> str:
    return reason if reason in ("stop", "length") else "stop"  # an aborted request ends as "stop"


class _Shape:
    """How one route words its answer: whole, or as SSE chunks (completions and chat differ only here)."""

    def __init__(self, rid: str, created: int, model: str) -> None:
        self.rid, self.created, self.model = rid, created, model

    def opening(self) -> list[BaseModel]:
        return []

    def delta(self, text: str, reason: str | None) -> BaseModel:
        raise NotImplementedError

    def usage(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def whole(self, text: str, reason: str, usage: Usage) -> BaseModel:
        raise NotImplementedError


class _CompletionShape(_Shape):
    def delta(self, text: str, reason: str | None) -> BaseModel:
        return self.whole(text, reason, None)  # type: ignore[arg-type]

    def usage(self, usage: Usage) -> BaseModel:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=[], usage=usage)

    def whole(self, text: str, reason: str | None, usage: Usage | None) -> BaseModel:  # type: ignore[override]
        return CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                  choices=[CompletionChoice(text=text, finish_reason=reason)], usage=usage)


class _ChatShape(_Shape):
    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])]

    def delta(self, text: str, reason: str | None) -> BaseModel:
        return self._chunk([ChatChunkChoice(delta=ChatDelta(content=text or None), finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def whole(self, text: str, reason: str, usage: Usage) -> BaseModel:
        return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model, usage=usage,
                                      choices=[ChatChoice(message=AssistantMessage(content=text),
                                                          finish_reason=reason)])  # type: ignore[arg-type]


def _sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def _usage(n_prompt: int, n_out: int, cached: int = 0) -> Usage:
    return Usage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


async def _collect(handle: RequestHandle) -> tuple[str, int, str, int]:
    """(text, completion tokens, finish reason, cached prompt tokens) of a request, from its token events."""
    text: list[str] = []
    n_out, reason = 0, None
    async for ev in handle.events():
        text.append(ev.text)
        n_out += len(ev.token_ids)
        if ev.finished:
            reason = ev.finish_reason
    res = await handle.result()  # raises if the request failed
    return "".join(text), n_out, _finish_reason(reason), getattr(res, "cached_tokens", 0)


async def _stream(engine: Any, handle: RequestHandle, shape: _Shape, n_prompt: int,
                  include_usage: bool) -> AsyncIterator[str]:
    """SSE chunks of one request. If the stream is closed early (the client went away) the request is cancelled."""
    done, n_out, cached = False, 0, 0
    try:
        for chunk in shape.opening():
            yield _sse(chunk)
        async for ev in handle.events():
            n_out += len(ev.token_ids)
            if ev.text or ev.finished:
                yield _sse(shape.delta(ev.text, _finish_reason(ev.finish_reason) if ev.finished else None))
        done = True
        try:
            cached = getattr(await handle.result(), "cached_tokens", 0)
        except Exception:  # noqa: BLE001 - the status line is sent: end the stream as it is
            log.exception("engine failed on streamed request %s", handle.request_id)
        if include_usage:
            yield _sse(shape.usage(_usage(n_prompt, n_out, cached)))
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            engine.cancel(handle.request_id)


def create_openai_router(engine: Any, tokenizer: Any, model_name: str, max_model_len: int,
                         vocab_size: int) -> APIRouter:
    """The OpenAI routes around an LLM engine (the Engine protocol; events are ``TokenEvent``\\ s)."""
    router = APIRouter()
    created = int(time.time())

    def check_model(body: SamplingRequest) -> None:
        if body.model != model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist (served: '{model_name}')", "model",
                           "model_not_found")

    async def generate(request: Request, body: SamplingRequest, prompt_ids: list[int], max_tokens: int,
                       shape: _Shape) -> Any:
        if len(prompt_ids) + max_tokens > max_model_len:
            raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                f"{len(prompt_ids)} and max_tokens is {max_tokens}", "max_tokens",
                           "context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stops())
        handle = submit(engine, LLMRequest(prompt_ids, params, request_id=shape.rid), "max_tokens")
        if body.stream:
            return StreamingResponse(_stream(engine, handle, shape, len(prompt_ids), body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        text, n_out, reason, cached = await finish(request, engine, handle, _collect(handle))
        return shape.whole(text, reason, _usage(len(prompt_ids), n_out, cached))

    @router.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body)
        p = body.prompt
        if isinstance(p, list) and isinstance(p[0], int):
            ids = token_ids(p, vocab_size, "prompt").tolist()  # type: ignore[arg-type]
        else:
            ids = tokenizer.encode(p[0] if isinstance(p, list) else p)
        max_tokens = body.requested_max_tokens() or DEFAULT_MAX_TOKENS
        return await generate(request, body, ids, max_tokens, _CompletionShape(f"cmpl-{uuid.uuid4().hex[:24]}",
                                                                              created, model_name))

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body)
        prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        ids = tokenizer.encode(prompt)
        max_tokens = body.requested_max_tokens() or max(1, min(DEFAULT_CHAT_MAX_TOKENS, max_model_len - len(ids)))
        return await generate(request, body, ids, max_tokens, _ChatShape(f"chatcmpl-{uuid.uuid4().hex[:24]}",
                                                                        created, model_name))

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, created=created)])

    return router
