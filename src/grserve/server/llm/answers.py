"""How the OpenAI routes word their answers: completions and chat differ only here (whole answers, SSE chunks,
usage, logprobs in each API's shape, the streamed error event)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from grserve.engine.sampling import TokenLogprobs
from grserve.inputs.openai_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from grserve.inputs.openai_tools import ToolPlan, parse_tool_calls


class Choice:
    """One choice as it accumulates from its token events."""

    def __init__(self, prefix: str = "") -> None:
        self.parts: list[str] = [prefix] if prefix else []
        self.n_out = 0
        self.reason = "stop"
        self.logprobs: list[TokenLogprobs] = []
        self.text_len = len(prefix)  # for completions' text_offset
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (set when the request ends)

    def add(self, ev: Any) -> None:
        self.parts.append(ev.text)
        self.n_out += len(ev.token_ids)
        if ev.logprobs:
            self.logprobs.extend(ev.logprobs)
        if ev.finished:
            self.reason = ev.finish_reason if ev.finish_reason in ("stop", "length") else "stop"

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _text(tokenizer: Any, token_id: int) -> tuple[str, bytes]:
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), b


class Shape:
    """How one route words its answer: whole, or as SSE chunks."""

    def __init__(self, rid: str, created: int, model: str, tokenizer: Any) -> None:
        self.rid, self.created, self.model, self.tokenizer = rid, created, model, tokenizer

    def opening(self, n: int) -> list[BaseModel]:
        return []

    def delta(self, i: int, ev: Any, choice: Choice) -> BaseModel:
        raise NotImplementedError

    def usage(self, usage: Usage) -> BaseModel:
        raise NotImplementedError

    def whole(self, choices: list[Choice], usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionShape(Shape):
    def __init__(self, rid: str, created: int, model: str, tokenizer: Any, echo: str = "") -> None:
        super().__init__(rid, created, model, tokenizer)
        self.echo = echo

    def _logprobs(self, lps: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in lps:
            s, _ = _text(self.tokenizer, lp.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({_text(self.tokenizer, t)[0]: v for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(s)
        return out

    def _answer(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, n: int) -> list[BaseModel]:
        if not self.echo:
            return []
        return [self._answer([CompletionChoice(index=i, text=self.echo, finish_reason=None) for i in range(n)])]

    def delta(self, i: int, ev: Any, choice: Choice) -> BaseModel:
        lp = None
        if ev.logprobs:
            lp = self._logprobs(ev.logprobs, choice.text_len)
            choice.text_len = lp.text_offset[-1] + len(lp.tokens[-1])
        reason = choice.reason if ev.finished else None
        return self._answer([CompletionChoice(index=i, text=ev.text, logprobs=lp, finish_reason=reason)])

    def usage(self, usage: Usage) -> BaseModel:
        return self._answer([], usage)

    def whole(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return self._answer([CompletionChoice(index=i, text=self.echo + c.text,
                                              finish_reason=c.reason,  # type: ignore[arg-type]
                                              logprobs=self._logprobs(c.logprobs, len(self.echo))
                                              if c.logprobs else None)
                             for i, c in enumerate(choices)], usage)


class ChatShape(Shape):
    """With tools the model may call (``tool_choice`` not ``none``), the answer is parsed into ``tool_calls`` by the
    server's parser (``inputs/openai_tools.py``); streamed, the text is held until the choice ends, then sent as one
    delta of its content (if any) and its calls (OpenAI's ``tool_calls`` deltas: index, id, name, arguments)."""

    def __init__(self, rid: str, created: int, model: str, tokenizer: Any, tools: ToolPlan | None = None,
                 tool_parser: str = "hermes") -> None:
        super().__init__(rid, created, model, tokenizer)
        self.tools = tools if tools is not None and tools.parses else None
        self.tool_parser = tool_parser

    def _parsed(self, c: Choice) -> tuple[str | None, list[dict], str]:
        if self.tools is None:
            return c.text, [], c.reason
        content, calls = parse_tool_calls(c.text, self.tool_parser)
        return content, calls, "tool_calls" if calls and c.reason == "stop" else c.reason

    def _logprobs(self, lps: list[TokenLogprobs]) -> ChatLogprobs:
        def top(t: int, v: float) -> TopLogprob:
            s, b = _text(self.tokenizer, t)
            return TopLogprob(token=s, logprob=v, bytes=list(b))

        out = []
        for lp in lps:
            s, b = _text(self.tokenizer, lp.token_id)
            out.append(ChatTokenLogprob(token=s, logprob=lp.logprob, bytes=list(b),
                                        top_logprobs=[top(t, v) for t, v in lp.top]))
        return ChatLogprobs(content=out)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self, n: int) -> list[BaseModel]:
        return [self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                             for i in range(n)])]

    def delta(self, i: int, ev: Any, choice: Choice) -> BaseModel | None:
        if self.tools is not None:  # held until the end: only then is it known what is a call
            if not ev.finished:
                return None
            content, calls, reason = self._parsed(choice)
            lp = self._logprobs(choice.logprobs) if choice.logprobs else None
            deltas = [ToolCallDelta(index=k, **c) for k, c in enumerate(calls)] or None
            return self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=content or None, tool_calls=deltas),
                                                logprobs=lp, finish_reason=reason)])  # type: ignore[arg-type]
        lp = self._logprobs(ev.logprobs) if ev.logprobs else None
        reason = choice.reason if ev.finished else None
        return self._chunk([ChatChunkChoice(index=i, delta=ChatDelta(content=ev.text or None), logprobs=lp,
                                            finish_reason=reason)])  # type: ignore[arg-type]

    def usage(self, usage: Usage) -> BaseModel:
        return self._chunk([], usage)

    def whole(self, choices: list[Choice], usage: Usage) -> BaseModel:
        return ChatCompletionResponse(
            id=self.rid, created=self.created, model=self.model, usage=usage,
            choices=[self._choice(i, c) for i, c in enumerate(choices)])

    def _choice(self, i: int, c: Choice) -> ChatChoice:
        content, calls, reason = self._parsed(c)
        msg = AssistantMessage(content=content, tool_calls=[ToolCall(**x) for x in calls] or None)
        return ChatChoice(index=i, message=msg, finish_reason=reason,  # type: ignore[arg-type]
                          logprobs=self._logprobs(c.logprobs) if c.logprobs else None)
