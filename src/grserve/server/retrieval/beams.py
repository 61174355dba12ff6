"""OpenAI beams: the retrieval server's ``POST /v1/chat/completions`` and ``POST /v1/completions`` (and ``GET
/v1/models``) answer a chat or text prompt with a SID beam search over the catalog — the ranked beams as
``choices[]``, one catalog item each.

    body (inputs/beam_schemas.py) → prompt rendered with the model's chat template, SID text checked, encoded,
    ending where the beams start (inputs/sid_prompts.py) → RetrievalRequest (beam width, n, exclude_items, a ThinkSpec when
    max_think_tokens > 0) → the retrieval engine (submit / finish: auth, limits, queue, cancel-on-disconnect and
    metrics as on /v1/recommend; --instances N alike) → choices: item text, item_id, sid, cumulative_logprob

Errors answer in OpenAI's shape on these paths (their rows of the app's route table). Streaming sends the finished beam set as one chunk
(then usage, then ``[DONE]``): beams finish together, so per-token deltas per beam would carry nothing more.

Hardened as the other routes (issue 25; docs/security.md): bodies are parsed, prechecked and validated by the app's
route class (``server/http/bodies.py``: the prompt's characters, token ids, messages and ``exclude_items`` against the limits
first, ``inputs/retrieval.py``: ``beam_completion_precheck``, ``beam_chat_precheck``); the SID text check, the chat template and the tokenizer run on a
heavy-work thread (``bodies.off_loop``: ``chat_ids`` / ``text_ids``), as does the decoding of a thought; admission counts
a request from the edge on (both paths are queued routes); the engine's key is the server's own (no client id).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.routing import APIRoute

from grserve.engine.think import text_tokens
from grserve.engine.types import RetrievalRequest, RetrievalResult, json_score
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
    Thinking,
)
from grserve.inputs.openai_schemas import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, ModelCard, ModelList, \
    usage
from grserve.inputs.refusal import token_ids
from grserve.inputs.sid_prompts import BeamContext, beam_knobs, beam_request, chat_ids, item_text, text_ids
from grserve.server.http.lifecycle import check_catalog_version, finish, submit
from grserve.server.http.bodies import off_loop
from grserve.server.http.routes import documented
from grserve.server.http.sse import event_stream, finished


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


def create_beam_router(ctx: BeamContext, route_class: type[APIRoute] = APIRoute) -> APIRouter:
    """The OpenAI beam routes around a retrieval engine (``BeamContext``); ``route_class``: the app's
    (``bodies.body_route``: bodies prechecked, parsed and validated off the event loop)."""
    router = APIRouter(route_class=route_class)

    @router.post("/v1/chat/completions", response_model=BeamChatResponse, responses=documented(400, 401, 404, 413, 429, 500, 503))
    async def chat_completions(body: BeamChatRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        catalog = ctx.engine.catalogs.current()
        knobs = beam_knobs(ctx, body, catalog)  # cheap checks first, then the heavy work off the event loop
        ids = await off_loop(chat_ids, ctx.tokenizer, catalog, body.messages, body.chat_template_kwargs)
        req = beam_request(ctx, body, ids, catalog, knobs, "messages")
        result, items, use = await _run(ctx, request, req, catalog)
        head = dict(id=f"chatcmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=ctx.model_name,
                    thinking=await _thinking(ctx, result), beam_width=req.beam_width,
                    catalog_version=int(result.catalog_version))
        if body.logprobs:
            for it, got in zip(items, result.items):
                it["logprobs"] = chat_logprobs(catalog, got)
        if body.stream:
            choices = [BeamChatChunkChoice(delta=BeamChatDelta(content=it.pop("text")), **it) for it in items]
            last = BeamChatChunk(choices=[], usage=use, **{**head, "thinking": None}) if body.include_usage else None
            return event_stream(finished([BeamChatChunk(choices=choices, **head)], last))
        choices = [BeamChatChoice(message=BeamMessage(content=it.pop("text")), **it) for it in items]
        return BeamChatResponse(choices=choices, usage=use, **head)

    @router.post("/v1/completions", response_model=BeamCompletionResponse, responses=documented(400, 401, 404, 413, 429, 500, 503))
    async def completions(body: BeamCompletionRequest, request: Request) -> Any:
        ctx.check_model(body.model)
        catalog = ctx.engine.catalogs.current()
        knobs = beam_knobs(ctx, body, catalog)
        if isinstance(body.prompt, str):
            ids = await off_loop(text_ids, ctx.tokenizer, catalog, body.prompt)
        else:
            ids = token_ids(body.prompt, int(ctx.engine.vocab_size), "prompt").tolist()
        req = beam_request(ctx, body, ids, catalog, knobs, "prompt")
        result, items, use = await _run(ctx, request, req, catalog)
        head = dict(id=f"cmpl-{uuid.uuid4().hex[:24]}", created=int(time.time()), model=ctx.model_name,
                    thinking=await _thinking(ctx, result), beam_width=req.beam_width,
                    catalog_version=int(result.catalog_version))
        if body.wants_logprobs():
            for it, got in zip(items, result.items):
                it["logprobs"] = completion_logprobs(catalog, got)
        choices = [BeamCompletionChoice(**it) for it in items]
        if body.stream:
            last = BeamCompletionChunk(choices=[], usage=use, **{**head, "thinking": None}) if body.include_usage \
                else None
            return event_stream(finished([BeamCompletionChunk(choices=choices, **head)], last))
        return BeamCompletionResponse(choices=choices, usage=use, **head)

    @router.get("/v1/models", response_model=ModelList)
    async def models() -> Any:
        return ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created)])

    return router


