"""The messages between a front end and its engine-core process, and how they are written.

Front end → core, one ZeroMQ frame each, pickled (a request carries numpy arrays, sampling parameters, allow-lists:
one frame per request, written once):

- ``Submit(front_end, incarnation, request)``: run it; its events and its end go back to ``front_end``;
- ``Cancel(incarnation, request_id)``;
- ``Control(front_end, incarnation, call_id, op, arg)``: ``drain`` (arg: the timeout) / ``stop`` on a thread of the
  core, or ``state``: a change of the engine's state applied in order with the requests around it (arg a
  ``cluster.wire`` ``CatalogReplace`` or ``RegistryUpdate``, as a cluster instance is sent), answered by a
  ``reply``.

A message for another incarnation (sent to a core that has died since) is dropped: the front end has failed
those requests already.

Core → front end, one frame per batch (everything the engine produced since the last send: one decode step's tokens
for every request of that front end), as msgpack (``msgspec``): a list of tuples, the first field the kind:

- ``("t", request_id, token_ids, text, finished, finish_reason, cached_tokens, seq_id)``: an LLM token event without
  log-probabilities, error or K/V (the hot path: 4–5x cheaper to write and read than pickling ``TokenEvent``);
- ``("e", request_id, pickled event)``: any other event;
- ``("r", request_id, pickled result)``: the request's end;
- ``("x", request_id, error class name, message)``: its failure (``ERRORS`` names the classes rebuilt);
- ``("h", incarnation, pickled CoreStatus)``: the heartbeat, every ``HEARTBEAT_S`` and in answer to a hello;
- ``("c", call_id, pickled answer)``: a control's reply.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from grserve.engine.protocol import (
    EngineError,
    EngineOverloaded,
    EngineStepFailed,
    EngineStopped,
    RequestCancelled,
    RequestTimedOut,
)

HEARTBEAT_S = 0.25  # the core's status to every front end at this period
HELLO = b"hello"  # a front end's first frame on its output socket (and again while it waits for a new core)


class EngineCoreDied(EngineError):
    """The engine-core process died while the request was in it (HTTP 503 with Retry-After: the core restarts)."""

    http_status = 503
    error_type = "engine_died"


# the errors a core may report for a request, rebuilt by name at the front end (anything else: EngineStepFailed)
ERRORS: dict[str, type[BaseException]] = {c.__name__: c for c in (
    EngineOverloaded, EngineStopped, RequestCancelled, RequestTimedOut, EngineStepFailed, EngineCoreDied, ValueError)}


@dataclass(frozen=True)
class Submit:
    front_end: bytes
    incarnation: int
    request: Any


@dataclass(frozen=True)
class Cancel:
    incarnation: int
    request_id: str


@dataclass(frozen=True)
class Control:
    front_end: bytes
    incarnation: int
    call_id: int
    op: Literal["drain", "stop", "state"]
    arg: Any = None


@dataclass(frozen=True)
class CoreStatus:
    """What a front end knows of its core between two heartbeats: ``/health`` and ``/metrics`` read it (never the
    core itself, so they never wait on it)."""

    incarnation: int
    pid: int
    status: str  # the engine's: ok / draining / stopped
    queue_depth: int
    running: int
    health_detail: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)  # what the engine is (its builder's facts)
    batches: list[tuple[int, int]] = field(default_factory=list)  # (requests, tokens) of each batch since the last
    extra: dict[str, Any] = field(default_factory=dict)  # the mode's own facts (ranking: its RankingStats)


def encode_in(msg: Submit | Cancel | Control) -> bytes:
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


def decode_in(frame: bytes) -> Submit | Cancel | Control:
    return pickle.loads(frame)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def event_row(request_id: str, ev: Any) -> tuple:
    """One event as a row of a batch: the compact form for an LLM token event that has nothing else."""
    if (getattr(ev, "token_ids", None) is not None and getattr(ev, "logprobs", 1) is None
            and getattr(ev, "prompt_kv", 1) is None and getattr(ev, "error", 1) is None):
        return ("t", request_id, ev.token_ids, ev.text, ev.finished, ev.finish_reason, ev.cached_tokens, ev.seq_id)
    return ("e", request_id, pickle.dumps(ev, protocol=pickle.HIGHEST_PROTOCOL))


def end_row(request_id: str, result: Any = None, error: BaseException | None = None) -> tuple:
    if error is None:
        return ("r", request_id, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    return ("x", request_id, type(error).__name__, str(error))


def status_row(status: CoreStatus) -> tuple:
    return ("h", status.incarnation, pickle.dumps(status, protocol=pickle.HIGHEST_PROTOCOL))


def reply_row(call_id: int, answer: Any, error: BaseException | None = None) -> tuple:
    """A control's answer, or its failure (raised again at the caller)."""
    return ("c", call_id, pickle.dumps((answer, error), protocol=pickle.HIGHEST_PROTOCOL))


def encode_out(rows: list[tuple]) -> bytes:
    return _encoder.encode(rows)


def decode_out(frame: bytes) -> list[list]:
    return _decoder.decode(frame)


def rebuild_error(name: str, message: str) -> BaseException:
    """A failure the core reported, as the class the routes map to an answer (``server/http/lifecycle.py``)."""
    return ERRORS.get(name, EngineStepFailed)(message)


_token_event: Any = None  # engine.llm.TokenEvent, imported on first use (a retrieval front end never needs it)


def token_event(row: list) -> Any:
    """A ``("t", ...)`` row back as the engine's ``TokenEvent``."""
    global _token_event
    if _token_event is None:
        from grserve.engine.llm import TokenEvent

        _token_event = TokenEvent
    _, _rid, token_ids, text, finished, reason, cached, seq_id = row
    return _token_event(seq_id, token_ids, text, finished, reason, cached_tokens=cached)
