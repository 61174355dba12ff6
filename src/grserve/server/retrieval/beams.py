"""OpenAI beams: the retrieval server's ``POST /v1/chat/completions`` and ``POST /v1/completions`` (and ``GET
/v1/models``) answer a chat or text prompt with a SID beam search over the catalog — the ranked beams as
``choices[]``, one catalog item each.

    body (openai_beam_schemas.py) → prompt rendered with the model's chat template, SID text checked, encoded,
    ending where the beams start (sid_prompts.py) → RetrievalRequest (beam width, n, exclude_items, a ThinkSpec when
    max_think_tokens > 0) → the retrieval engine (submit / finish: auth, limits, queue, cancel-on-disconnect and
    metrics as on /v1/recommend; --instances N alike) → choices: item text, item_id, sid, cumulative_logprob

Errors answer in OpenAI's shape on these paths (``errors.py``). Streaming sends the finished beam set as one chunk
(then usage, then ``[DONE]``): beams finish together, so per-token deltas per beam would carry nothing more.

Hardened as the other routes (issue 25; docs/security.md): bodies are parsed, prechecked and validated by the app's
route class (``bodies.py``: the prompt's characters, token ids, messages and ``exclude_items`` against the limits
first, ``retrieval_app.beam_prechecks``); the SID text check, the chat template and the tokenizer run on a
heavy-work thread (``offload.py``: ``chat_ids`` / ``text_ids``), as does the decoding of a thought; admission counts
a request from the edge on (both paths are queued routes); the engine's key is the server's own (no client id).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from fastapi.routing import APIRoute

from grserve.catalog.allowlist import Allow
from grserve.config import BeamApiConfig, ServerConfig
from grserve.engine.protocol import RetrievalService
from grserve.engine.think import ThinkSpec, text_tokens
from grserve.engine.types import RetrievalRequest, RetrievalResult, json_score
from grserve.server.http.errors import ApiError
from grserve.inputs.item_filters import allowed, excluded_items, history_exclusion
from grserve.server.http.lifecycle import check_catalog_version, finish, submit
from grserve.server.http.metrics import Metrics
from grserve.server.http.offload import off_loop
from grserve.server.llm.answers import sse, usage
from grserve.inputs.beam_schemas import (
    BeamChatChoice,
    BeamChatChunk,
    BeamChatChunkChoice,
    BeamChatDelta,
    BeamChatRequest,
    BeamChatResponse,
    BeamCompletionChoice,
    BeamCompletionChunk,
    BeamCompletionRequest,
    BeamCompletionResponse,
    BeamMessage,
    BeamRequest,
    Thinking,
)
from grserve.inputs.openai_schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, ModelCard, ModelList
from grserve.inputs.prompt_template import PromptTemplate, PromptTemplateError
from grserve.inputs.sid_prompts import beam_start, chat_text, check_sid_text, item_text
from grserve.inputs.refusal import check_length, token_ids

OPENAI_BEAM_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})
_ERRORS: dict[int | str, dict[str, Any]] = {k: {} for k in (400, 401, 404, 413, 429, 500, 503)}


@dataclass
class BeamContext:
    """What the routes need: the engine (or cluster front end), the limits, the served model's name."""

    engine: RetrievalService
    server: ServerConfig
    beams: BeamApiConfig
    model_name: str
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_template: PromptTemplate | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        """``--prompt-template``, loaded and tried once at start-up (a bad file or variable fails here, not later)."""
        path = getattr(self.beams, "prompt_template", None)
        if path is None:
            return
        if getattr(self.engine, "tokenizer", None) is None:
            raise PromptTemplateError(f"--prompt-template {path}: the model has no tokenizer to encode its text")
        template = PromptTemplate.load(path, self.beams.prompt_format)
        template.render(["<item>"], [0])
        self.prompt_template = template

    @property
    def tokenizer(self) -> Any:
        tok = getattr(self.engine, "tokenizer", None)
        if tok is None:
            raise ApiError(400, f"the served model '{self.model_name}' has no tokenizer files, so text and chat "
                                "prompts cannot be encoded; send token ids (/v1/completions with a list prompt) or "
                                "use /v1/recommend", None, "no_tokenizer")
        return tok

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist (served: '{self.model_name}')", "model",
                           "model_not_found")


def _beam_width(ctx: BeamContext, body: BeamRequest) -> int:
    search = ctx.engine.search
    bw = body.requested_beam_width() or int(search.beam_width)
    param = "beam_width" if body.beam_width is not None else "best_of"
    if bw > int(search.max_beam_width):
        raise ApiError(400, f"{param}: {bw} is more than the server's --max-beam-width {search.max_beam_width}", param,
                       "out_of_range")
    limit = min(bw, int(ctx.server.max_top_n))
    if body.n > limit:
        raise ApiError(400, f"n: {body.n} results asked for, at most the beam width {bw} and the server limit "
                            f"{ctx.server.max_top_n}", "n", "out_of_range")
    return bw


def think_spec(ctx: BeamContext, max_think_tokens: int, layout: Any, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, seed: int | None = None) -> ThinkSpec | None:
    """The request's ``ThinkSpec``, None without thinking; 400 over ``--max-think-tokens``. A layout without
    ``sid_begin`` ends the thought at the model's first SID token (``engine/think.py``)."""
    if max_think_tokens == 0:
        return None
    limit = int(ctx.beams.max_think_tokens)
    if max_think_tokens > limit:
        raise ApiError(400, f"max_think_tokens: {max_think_tokens} is more than the server limit {limit} "
                            "(--max-think-tokens)", "max_think_tokens", "out_of_range")
    if layout.sid_begin is None:  # the model's own first SID token ends the thought (engine/think.py)
        first = layout.code_tokens(0)
        return ThinkSpec(max_think_tokens, None, temperature, top_p, top_k, seed,
                         frozenset(int(t) for t in first[first >= 0].tolist()))
    return ThinkSpec(max_think_tokens, int(layout.sid_begin), temperature, top_p, top_k, seed)


@dataclass(frozen=True)
class BeamKnobs:
    """A request's search settings, checked before its prompt is rendered or tokenized."""

    beam_width: int
    think: ThinkSpec | None
    exclude_items: np.ndarray | None
    include: Allow | None = None


def beam_knobs(ctx: BeamContext, body: BeamRequest, catalog: Any) -> BeamKnobs:
    """The cheap checks of a request (400 naming the field): beam width and n, max_tokens vs one item, thinking,
    ``exclude_items`` (413 past ``--max-exclude-items``), the allowlist (``include_items``, ``include_sid_prefix``)."""
    bw = _beam_width(ctx, body)
    max_tokens = body.requested_max_tokens()
    if max_tokens is not None and max_tokens < catalog.depth:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
        raise ApiError(400, f"{param}: {max_tokens} is less than the {catalog.depth} tokens of one item", param,
                       "out_of_range")
    spec = think_spec(ctx, body.max_think_tokens, catalog.layout, body.temperature, body.top_p, body.top_k,
                      body.seed)

    return BeamKnobs(bw, spec, excluded_items(body, ctx.server), allowed(body, catalog, ctx.server))


def retrieval_request(ctx: BeamContext, body: BeamRequest, ids: list[int], catalog: Any, knobs: BeamKnobs,
                      field_name: str) -> RetrievalRequest:
    """The engine request of a prompt's token ids: beam start placed, its length checked (413 a prompt too long).
    Its ``request_id`` is the server's own (the engine's cancel key)."""
    prompt = beam_start(ids, catalog.layout, knobs.think is not None)
    check_length(int(prompt.size), int(ctx.server.max_prompt_tokens), field_name, "the prompt", "prompt_too_long")
    return RetrievalRequest(prompt_tokens=prompt, beam_width=knobs.beam_width, top_n=body.n, think=knobs.think,
                            exclude_items=history_exclusion(body, catalog, prompt, knobs.exclude_items),
                            include=knobs.include, logprobs=body.wants_logprobs())


def _items(result: RetrievalResult, catalog: Any) -> list[dict]:
    return [{"index": i, "item_id": int(it.item_id), "sid": [int(c) for c in it.sid],
             "cumulative_logprob": json_score(it.score),
             "text": item_text(catalog, it.sid)} for i, it in enumerate(result.items)]


def _sid_tokens(catalog: Any, sid: tuple[int, ...]) -> list[str]:
    """Each SID token as text: the catalog's token strings, or the level's code where SIDs have no text."""
    if catalog.text is not None:
        return [catalog.text.strings(level, [c])[0] for level, c in enumerate(sid)]
    return [str(int(c)) for c in sid]


def chat_logprobs(catalog: Any, item: Any) -> ChatLogprobs:
    """A choice's ``logprobs``: one entry per SID token, its own log-probability, no alternatives."""
    return ChatLogprobs(content=[ChatTokenLogprob(token=t, logprob=json_score(lp), bytes=list(t.encode()),
                                                 top_logprobs=[])
                                 for t, lp in zip(_sid_tokens(catalog, item.sid), item.token_logprobs)])


def completion_logprobs(catalog: Any, item: Any) -> CompletionLogprobs:
    """A completion choice's ``logprobs``: the SID tokens, their log-probabilities, their offsets in its text."""
    tokens, text, offsets, pos = _sid_tokens(catalog, item.sid), item_text(catalog, item.sid), [], 0
    for t in tokens:
        at = text.find(t, pos)
        offsets.append(at if at >= 0 else pos)
        pos = offsets[-1] + len(t)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[json_score(x) for x in item.token_logprobs],
                              top_logprobs=[{} for _ in tokens], text_offset=offsets)


async def thought_text(ctx: BeamContext, result: RetrievalResult) -> str | None:
    """The text of the result's thought (its closing ``sid_begin`` left out), decoded on a heavy-work thread; None
    without one."""
    if result.thought is None:
        return None
    tok, ids = ctx.tokenizer, text_tokens(result.thought, ctx.engine.catalogs.current().layout.sid_begin)
    return await off_loop(lambda: tok.decode(ids, skip_special_tokens=False))


async def _thinking(ctx: BeamContext, result: RetrievalResult) -> Thinking | None:
    text = await thought_text(ctx, result)
    if text is None:
        return None
    return Thinking(text=text, tokens=len(result.thought), sid_begin_forced=bool(result.thought_forced))


async def _run(ctx: BeamContext, request: Request, req: RetrievalRequest, catalog: Any) -> tuple:
    result: RetrievalResult = check_catalog_version(await finish(request, ctx.engine, submit(ctx.engine, req)),
                                                    catalog)
    items = _items(result, catalog)
    ctx.metrics.observe_items(len(items))
    n_out = (len(result.thought) if result.thought else 0) + catalog.depth * len(items)
    return result, items, usage(int(req.prompt_tokens.size), n_out, int(result.cached_tokens))


def _stream(chunks: list[Any], include_usage: bool, use: Any) -> StreamingResponse:
    async def body():
        for c in chunks:
            yield sse(c)
        if include_usage:
            yield sse(use)
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def create_beam_router(ctx: BeamContext, route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The OpenAI beam routes around a retrieval engine (``BeamContext``); ``route_class``: the app's
    (``bodies.body_route``: bodies prechecked, parsed and validated off the event loop)."""
    router = APIRouter(route_class=route_class)

    @router.post("/v1/chat/completions", response_model=BeamChatResponse, responses=_ERRORS)
    async def chat_completions(body: BeamChatRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        catalog = ctx.engine.catalogs.current()
        knobs = beam_knobs(ctx, body, catalog)  # cheap checks first, then the heavy work off the event loop
        ids = await off_loop(chat_ids, ctx.tokenizer, catalog, body.messages, body.chat_template_kwargs)
        req = retrieval_request(ctx, body, ids, catalog, knobs, "messages")
        result, items, use = await _run(ctx, request, req, catalog)
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=ctx.model_name,
                    thinking=await _thinking(ctx, result), beam_width=req.beam_width,
                    catalog_version=int(result.catalog_version))
        if body.logprobs:
            for it, got in zip(items, result.items):
                it["logprobs"] = chat_logprobs(catalog, got)
        if body.stream:
            choices = [BeamChatChunkChoice(delta=BeamChatDelta(content=it.pop("text")), **it) for it in items]
            return _stream([BeamChatChunk(choices=choices, **head)], body.include_usage,
                           BeamChatChunk(choices=[], usage=use, **{**head, "thinking": None}))
        choices = [BeamChatChoice(message=BeamMessage(content=it.pop("text")), **it) for it in items]
        return BeamChatResponse(choices=choices, usage=use, **head)

    @router.post("/v1/completions", response_model=BeamCompletionResponse, responses=_ERRORS)
    async def completions(body: BeamCompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        catalog = ctx.engine.catalogs.current()
        knobs = beam_knobs(ctx, body, catalog)
        if isinstance(body.prompt, str):
            ids = await off_loop(text_ids, ctx.tokenizer, catalog, body.prompt)
        else:
            ids = token_ids(body.prompt, int(ctx.engine.vocab_size), "prompt").tolist()
        req = retrieval_request(ctx, body, ids, catalog, knobs, "prompt")
        result, items, use = await _run(ctx, request, req, catalog)
        head = dict(id=f"cmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=ctx.model_name,
                    thinking=await _thinking(ctx, result), beam_width=req.beam_width,
                    catalog_version=int(result.catalog_version))
        if body.wants_logprobs():
            for it, got in zip(items, result.items):
                it["logprobs"] = completion_logprobs(catalog, got)
        choices = [BeamCompletionChoice(**it) for it in items]
        if body.stream:
            return _stream([BeamCompletionChunk(choices=choices, **head)], body.include_usage,
                           BeamCompletionChunk(choices=[], usage=use, **{**head, "thinking": None}))
        return BeamCompletionResponse(choices=choices, usage=use, **head)

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created)])

    return router


def chat_ids(tok: Any, catalog: Any, messages: list, template_kwargs: dict | None) -> list[int]:
    """A chat's prompt token ids: each message's SID text checked, the chat rendered with the model's chat template,
    encoded (a heavy-work thread's job: ``off_loop``)."""
    rendered = [m.for_template() for m in messages]
    for i, m in enumerate(rendered):
        check_sid_text(m["content"] or "", f"messages[{i}].content", catalog)
    return tok.encode(chat_text(tok, rendered, template_kwargs), add_special_tokens=False)


def text_ids(tok: Any, catalog: Any, prompt: str) -> list[int]:
    """A text prompt's token ids: its SID text checked (a trailing ``sid_begin`` is where the beams start), encoded
    (a heavy-work thread's job)."""
    check_sid_text(prompt, "prompt", catalog, ends_at_beam=True)
    return tok.encode(prompt)


def prompt_tokens(ctx: BeamContext, catalog: Any, prompt: str | None, messages: list | None) -> np.ndarray:
    """``/v1/recommend``'s ``prompt`` / ``messages`` history as token ids (chat template, checks; the caller runs it
    on a heavy-work thread)."""
    ids = chat_ids(ctx.tokenizer, catalog, messages, None) if messages is not None else \
        text_ids(ctx.tokenizer, catalog, prompt or "")
    return np.asarray(ids, dtype=np.int64)
