"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming or not), /v1/models.

Errors use OpenAI's shape — ``{"error": {"message", "type", "param", "code"}}`` with ``param`` naming the field —
not grserve's (these routes speak to OpenAI clients). Bodies are parsed and validated here, so the app-wide
validation handler never sees them. Unknown extra fields are ignored, as OpenAI clients send optional ones.

A client that disconnects (streaming: the generator is cancelled; non-streaming: polled every 50 ms) has its
request aborted, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from grserve.engine.llm import EngineLoop, TokenEvent
from grserve.engine.sampling import SamplingParams


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code


def openai_error(status: int, message: str, param: str | None, type: str = "invalid_request_error",
                 code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": code}},
                        status_code=status)


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must be non-empty")
        elif v == "":
            raise ValueError("stop sequence must be non-empty")
        return v

    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else ((self.stop,) if isinstance(self.stop, str) else tuple(self.stop))


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif v == "":
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def _param(loc: tuple) -> str | None:
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p not in ("str", "list[str]", "list[int]", "function-after[_stop(), union[str,list[str],none]]"):
            out += ("." if out else "") + str(p)
    return out or None


def _parse(model_cls, raw: Any):
    if not isinstance(raw, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:
        return model_cls.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err.get("loc", ()))
        param = _param(loc[:1] + tuple(x for x in loc[1:] if isinstance(x, int))) if loc else None
        msg = str(err.get("msg", "invalid value"))
        if err.get("type") == "missing":
            msg = f"'{param}' is a required property"
        else:
            msg = f"invalid '{param}': {msg}"
        raise OpenAIError(400, msg, param) from None


def create_openai_router(loop: EngineLoop, tokenizer, model_name: str, max_model_len: int,
                         vocab_size: int) -> APIRouter:
    router = APIRouter()
    engine = loop.engine
    created = int(time.time())

    async def _body(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise OpenAIError(400, f"request body is not valid JSON: {exc}") from None

    def _submit(prompt_ids: list[int], body: _Common, max_tokens: int, q: asyncio.Queue) -> int:
        aloop = asyncio.get_running_loop()
        if len(prompt_ids) + max_tokens > max_model_len:
            raise OpenAIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                                   f"{len(prompt_ids)} and max_tokens is {max_tokens}", "max_tokens",
                              code="context_length_exceeded")
        params = SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stops())
        try:
            sid = engine.add_request(prompt_ids, params, on_event=lambda ev: aloop.call_soon_threadsafe(q.put_nowait,
                                                                                                        ev))
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "max_tokens") from None
        loop.wake()
        return sid

    def _check_model(body: _Common) -> None:
        if body.model != model_name:
            raise OpenAIError(404, f"the model '{body.model}' does not exist (served: '{model_name}')", "model",
                              code="model_not_found")

    async def _run(request: Request, body: _Common, prompt_ids: list[int], max_tokens: int, chat: bool):
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        sid = _submit(prompt_ids, body, max_tokens, q)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))

        def usage(n_out: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n_out,
                    "total_tokens": len(prompt_ids) + n_out}

        if body.stream:
            async def gen():
                finished = False
                n_out = 0
                try:
                    if chat:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                    "model": model_name, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                             "content": ""},
                                                                      "finish_reason": None}]})
                    while True:
                        ev = await q.get()
                        n_out += len(ev.token_ids)
                        if ev.text or ev.finished:
                            reason = ev.finish_reason if ev.finished else None
                            if reason in ("abort", "error"):
                                reason = "stop"
                            if chat:
                                ch = {"index": 0, "delta": {"content": ev.text} if ev.text else {},
                                      "finish_reason": reason}
                                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                            "model": model_name, "choices": [ch]})
                            else:
                                yield _sse({"id": rid, "object": "text_completion", "created": created,
                                            "model": model_name, "choices": [{"index": 0, "text": ev.text,
                                                                              "logprobs": None,
                                                                              "finish_reason": reason}]})
                        if ev.finished:
                            finished = True
                            break
                    if include_usage:
                        yield _sse({"id": rid, "object": obj + (".chunk" if chat else ""), "created": created,
                                    "model": model_name, "choices": [], "usage": usage(n_out)})
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:  # client went away (generator cancelled/closed): free its blocks now
                        engine.abort(sid)

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        text, n_out, reason = [], 0, "stop"
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), timeout=0.05)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.abort(sid)
                    return JSONResponse({}, status_code=499)
                continue
            text.append(ev.text)
            n_out += len(ev.token_ids)
            if ev.finished:
                reason = ev.finish_reason if ev.finish_reason in ("stop", "length") else "stop"
                break
        out = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": reason,
                   "logprobs": None} if chat else
                  {"index": 0, "text": out, "finish_reason": reason, "logprobs": None})
        return {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice],
                "usage": usage(n_out)}

    def _max_tokens(body: _Common, default: int) -> int:
        mt = getattr(body, "max_completion_tokens", None) or body.max_tokens
        return mt if mt is not None else default

    async def _guard(coro):
        try:
            return await coro
        except OpenAIError as e:
            return openai_error(e.status, e.message, e.param, e.type, e.code)

    @router.post("/v1/completions")
    async def completions(request: Request):
        async def go():
            body = _parse(CompletionBody, await _body(request))
            _check_model(body)
            p = body.prompt
            if isinstance(p, list) and isinstance(p[0], int):
                if any(not 0 <= t < vocab_size for t in p):
                    bad = next(i for i, t in enumerate(p) if not 0 <= t < vocab_size)
                    raise OpenAIError(400, f"token id {p[bad]} is out of the vocabulary (0..{vocab_size - 1})",
                                      f"prompt[{bad}]")
                ids = list(p)
            else:
                ids = tokenizer.encode(p[0] if isinstance(p, list) else p)
            return await _run(request, body, ids, _max_tokens(body, 16), chat=False)
        return await _guard(go())

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        async def go():
            body = _parse(ChatBody, await _body(request))
            _check_model(body)
            prompt = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
            ids = tokenizer.encode(prompt)
            return await _run(request, body, ids, _max_tokens(body, min(256, max_model_len - len(ids))), chat=True)
        return await _guard(go())

    @router.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "grserve"}]}

    return router


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
