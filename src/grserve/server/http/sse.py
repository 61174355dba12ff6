"""Server-sent events, the one way the apps stream: a chunk is a ``data: <json>`` event, an error after the 200 is
a ``data: {"error": ...}`` event in OpenAI's shape (the ``openai`` client raises on it), a finished stream ends with
``data: [DONE]``; ``event_stream`` is the response around a route's events (no caching, no proxy buffering)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

DONE = "data: [DONE]\n\n"


def sse(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


def sse_error(message: str, status: int, code: str | None = None) -> str:
    """The streamed error event (OpenAI's error shape under ``error``; the ``openai`` client raises on it);
    ``code`` the house type (default ``internal`` for a 5xx, ``invalid_value`` for a 4xx)."""
    code = code or ("internal" if status >= 500 else "invalid_value")
    err = {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
           "param": None, "code": code}
    return f"data: {json.dumps({'error': err})}\n\n"


async def finished(chunks: Iterable[BaseModel], last: BaseModel | None = None) -> AsyncIterator[str]:
    """The events of an answer computed whole: its chunks, ``last`` (a usage chunk) when given, then ``[DONE]``."""
    for c in chunks:
        yield sse(c)
    if last is not None:
        yield sse(last)
    yield DONE


def event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
