"""One generation request through the LLM engine, seen from the OpenAI routes (``app.py``): ``submit`` → its
handle's token events (streamed as chunks, or collected) → ``result()``; ``n > 1`` submits n engine requests
(choice i seeded ``choice_seed(seed, i)``, ``inputs/generation.py``). A client that disconnects has its requests
cancelled, which frees their blocks at once.

An engine error is never a normal finish: non-streaming, a 500 in OpenAI's error shape; streaming, the status
line waits for the request's first event (``_opened``), so a request that never starts (queue deadline, engine
stopping, first step failed) is a 503/500 in OpenAI's shape; a failure after that (the 200 is sent) is a
``data: {"error": {...}}`` event and the stream ends without ``[DONE]`` (the ``openai`` client raises
``APIError`` on it).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from grserve.engine.protocol import Engine, EngineStepFailed, RequestHandle
from grserve.engine.structured import StructuredSpec
from grserve.engine.tokenizer import ChatTemplateError
from grserve.engine.types import LLMRequest
from grserve.inputs.generation import encode, fitting_max_tokens, sampling_params
from grserve.inputs.openai_schemas import ChatCompletionRequest, ChatMessage, ModelCard, SamplingRequest, usage
from grserve.inputs.refusal import ApiError
from grserve.server.http.bodies import off_loop
from grserve.server.http.lifecycle import engine_failure, finish, submit
from grserve.server.http.sse import DONE, event_stream, sse, sse_error
from grserve.server.llm.answers import Choice, Shape
from grserve.server.llm.metrics import LLMMetrics, RequestTimer

log = logging.getLogger("grserve.server")


class _Group:
    """n engine requests as one: cancelling one cancels all (for ``core.finish``)."""

    def __init__(self, engine: Engine, handles: list[RequestHandle]) -> None:
        self.engine, self.handles = engine, handles

    def cancel(self, _request_id: str = "") -> None:
        for h in self.handles:
            self.engine.cancel(h.request_id)


async def _collect(handle: RequestHandle, timer: RequestTimer) -> Choice:
    """One choice of a request, from its token events; raises if the request failed."""
    c = Choice()
    async for ev in handle.events():
        timer.on_event(ev)
        c.add(ev)
    try:
        result = await handle.result()
    except BaseException:
        timer.failed()
        raise
    c.cached_tokens = getattr(result, "cached_tokens", 0)
    timer.done(c.reason)
    timer.phases(result)
    return c


async def _collect_all(group: _Group, timers: list[RequestTimer]) -> list[Choice]:
    try:
        return list(await asyncio.gather(*(_collect(h, t) for h, t in zip(group.handles, timers))))
    except EngineStepFailed as exc:  # the request failed in the engine: a 500 that says why
        raise _engine_error(group, exc) from None
    except BaseException:
        group.cancel()
        raise


async def _merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, event) of n requests as they come; raises the first failure."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for ev in h.events():
                await queue.put((i, ev, None))
            await h.result()
            await queue.put((i, None, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, None, exc))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, ev, exc = await queue.get()
            if exc is not None:
                raise exc
            if ev is None:
                left -= 1
            else:
                yield i, ev
    finally:
        for t in tasks:
            t.cancel()


async def _first_event(events: AsyncIterator[tuple[int, Any]]) -> tuple[int, Any] | None:
    """The first (choice index, event) of a request, None if it ended without one; raises its failure."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return None


async def _opened(request: Request, group: _Group, timers: list[RequestTimer]) -> tuple[Any, Any]:
    """Wait for the request's first event before the stream's status line is sent, so a request that never
    starts (dropped at its queue deadline, engine stopping, failed in the engine) is an error status (503/500),
    never a 200 with an empty stream. Returns (the events, the first one)."""
    events = _merged(group.handles)
    try:
        first = await finish(request, group, group.handles[0], _first_event(events))
    except EngineStepFailed as exc:
        raise _engine_error(group, exc) from None
    except BaseException:
        group.cancel()
        for t in timers:
            t.failed()
        raise
    return events, first


def _engine_error(group: _Group, exc: BaseException) -> ApiError:
    group.cancel()
    log.error("request %s failed in the engine: %s", group.handles[0].request_id, exc)
    return ApiError(500, f"the request failed in the engine: {exc}", None, "engine_error")


def _stream_failure(exc: Exception, rid: str) -> ApiError:
    """How a stream whose 200 is sent ends when its request fails: a failed engine step is a 500 that says why;
    a planned drain (the engine stopped) a 503 ``stopped``, as a request that has not started gets (``lifecycle``)."""
    if isinstance(exc, EngineStepFailed):
        log.exception("engine failed on streamed request %s", rid)
        return ApiError(500, f"the request failed in the engine: {exc}", None, "internal")
    return engine_failure(exc, rid)


async def _events(group: _Group, shape: Shape, timers: list[RequestTimer], n_prompt: int, body: SamplingRequest,
                  metrics: LLMMetrics, events: AsyncIterator[tuple[int, Any]],
                  first: tuple[int, Any] | None) -> AsyncIterator[str]:
    """SSE chunks of one request (its n choices), from its ``first`` event on (``_opened``); with
    ``stream_options.include_usage`` a last usage chunk, with ``continuous_usage_stats`` too the usage so far in
    every chunk (vLLM's). Closed early (the client went away): requests cancelled."""
    done = False
    choices = [Choice() for _ in group.handles]

    def chunk(c: Any) -> str:
        if body.continuous_usage:
            c.usage = usage(n_prompt, sum(ch.n_out for ch in choices))
        return sse(c)

    async def rest() -> AsyncIterator[tuple[int, Any]]:
        if first is not None:
            yield first
        async for item in events:
            yield item

    try:
        for c in shape.opening(len(choices)):
            yield chunk(c)
        async for i, ev in rest():
            timers[i].on_event(ev)
            choices[i].add(ev)
            if ev.text or ev.finished or ev.logprobs:
                d = shape.delta(i, ev, choices[i])
                if d is not None:  # None: held back (a chat answer that may be a tool call)
                    yield chunk(d)
            if ev.finished:
                timers[i].done(choices[i].reason)
        done = True
        results = [h.future.result() for h in group.handles]  # all finished: the events ended with them
        for t, r in zip(timers, results):
            t.phases(r)
        if body.include_usage:
            cached = getattr(results[0], "cached_tokens", 0)
            yield sse(shape.usage(usage(n_prompt, sum(c.n_out for c in choices), cached)))
        yield DONE
    except Exception as exc:  # noqa: BLE001 - the status line is sent: an error event, never a clean finish
        done = True
        group.cancel()
        for t in timers:
            t.failed()
        error = _stream_failure(exc, shape.rid)
        metrics.error(error.status)
        yield sse_error(error.message, error.status, error.type)
    finally:
        if not done:
            group.cancel()


@dataclass
class OpenAIContext:
    """What every OpenAI route needs: the engine, the tokenizer, the served model and the per-request limits."""

    engine: Engine
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int
    metrics: LLMMetrics
    max_n: int = 16
    max_logprobs: int = 20
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ApiError(404, f"the model '{name}' does not exist (served: '{self.model_name}')", "model",
                           "model_not_found")

    def check_limits(self, body: SamplingRequest) -> None:
        if body.n > self.max_n:
            raise ApiError(400, f"n must be at most {self.max_n}", "n", "invalid_value")
        k = body.logprobs_k()
        if k is not None and k > self.max_logprobs:
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise ApiError(400, f"{param} must be at most {self.max_logprobs}", param, "invalid_value")

    def chat_prompt(self, messages: list[dict], tools: list | None, add_generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), "messages", "chat_template_error") from None

    def chat_ids(self, messages: list[ChatMessage], tools: list | None, add_generation_prompt: bool = True,
                 add_special_tokens: bool = False) -> list[int]:
        """The chat's prompt token ids: rendered by the chat template, then encoded (a heavy-work thread's job)."""
        text = self.chat_prompt([m.for_template() for m in messages], tools, add_generation_prompt)
        return encode(self.tokenizer, text, "messages", add_special_tokens=add_special_tokens)

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` (``param``: the field a missing tokenizer's 400 names) on a heavy-work thread."""
        return await off_loop(lambda: encode(self.tokenizer, text, param, add_special_tokens=add_special_tokens))

    def card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)


async def generate(ctx: OpenAIContext, request: Request, body: SamplingRequest, prompt_ids: list[int],
                   max_tokens: int | None, shape: Shape, structured: StructuredSpec | None = None) -> Any:
    """Submit the request's n choices and answer whole or as an SSE stream (``structured``: a grammar beyond the
    body's own, a tool choice's)."""
    max_tokens = fitting_max_tokens(body, len(prompt_ids), max_tokens, ctx.max_model_len)
    extra_eos = tuple(getattr(ctx.tokenizer, "extra_eos_ids", ()))
    if (structured or body.structured_spec()) is not None and getattr(ctx.tokenizer, "tok", None) is None:
        field = "tool_choice" if structured is not None else body.structured_field
        raise ApiError(400, "structured output needs the model's tokenizer (this model directory has none)", field,
                       "no_tokenizer")
    # every engine request carries a seed (drawn here when the client gave none), so a replay of prompt + tokens
    # so far with its SamplingParams samples the same continuation (engine/sampling.py: draws = f(seed, position))
    seed = body.seed if body.seed is not None else random.getrandbits(63)
    params = [sampling_params(body, max_tokens, ctx.vocab_size, i, extra_eos, seed, structured)
              for i in range(body.n)]
    handles: list[RequestHandle] = []
    try:
        for i, p in enumerate(params):
            rid = shape.rid if body.n == 1 else f"{shape.rid}-{i}"
            req = LLMRequest(prompt_ids, p, request_id=rid, priority=body.priority)
            handles.append(submit(ctx.engine, req, "max_tokens"))
    except BaseException:
        _Group(ctx.engine, handles).cancel()
        raise
    group = _Group(ctx.engine, handles)
    ctx.metrics.request(body.n, max_tokens)
    timers = [ctx.metrics.timer(len(prompt_ids) if i == 0 else 0) for i in range(len(handles))]  # prompt once
    if body.stream:
        events, first = await _opened(request, group, timers)
        return event_stream(_events(group, shape, timers, len(prompt_ids), body, ctx.metrics, events, first))
    choices = await finish(request, group, handles[0], _collect_all(group, timers))
    return shape.whole(choices, usage(len(prompt_ids), sum(c.n_out for c in choices), choices[0].cached_tokens))
