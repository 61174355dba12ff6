"""The LLM front end's journal: one ``RequestRecord`` per request in flight — what a move needs to finish it
elsewhere (``core/recovery.py``): its prompt and sampling, the tokens delivered (``stream.TokenStream``), the instance
and attempt it runs on, its prompt's K/V snapshot when an instance returned one, and its timings (the front end's,
and the engine phases of the attempt that delivered its first token: ``LLMResult.queue_s`` / ``prefill_s`` /
``decode_s``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from grserve.cluster.llm.stream import TokenStream
from grserve.cluster.wire import Attempt
from grserve.config import Priority

if TYPE_CHECKING:
    import torch

    from grserve.engine.protocol import RequestHandle
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMResult


@dataclass
class RequestRecord:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle[LLMResult]
    stream: TokenStream
    instance: int = -1
    migrations: int = 0
    snapshot: torch.Tensor | None = None  # K/V [L, 2, m, width] of its first m tokens (the front end owns it)
    submitted_at: float = 0.0
    first_token_at: float | None = None
    cached_tokens: int = 0  # prompt tokens the instance of its first token took from its prefix cache (usage)
    recovered: list[Literal["migrate", "recompute"]] = field(default_factory=list)  # per move
    priority: Priority = Priority.ONLINE  # co-location class, carried to every instance it runs on
    first_token_attempt: int | None = None  # the attempt that delivered its first token
    phases: dict[str, float] | None = None  # that attempt's engine phases, from the report that ended it

    def take_phases(self, attempt: int, phases: dict[str, float] | None) -> None:
        """Keep the engine phases an attempt reported at its end, if it is the one that delivered the first token
        (its queue and prefill are the request's)."""
        if phases and attempt == self.first_token_attempt:
            self.phases = phases

    def result_phases(self, attempt: int, now: float) -> dict[str, float]:
        """The finished request's phases for its ``LLMResult``: queue and prefill as the engine that delivered its
        first token measured them (absent when that instance died first); decode as that engine measured it when
        the same attempt ended the request, else (moved, or handed from prefill to decode) the front end's time
        from the first token to ``now``, the last."""
        out = {k: v for k, v in (self.phases or {}).items() if k in ("queue_s", "prefill_s")}
        if attempt == self.first_token_attempt and self.phases and "decode_s" in self.phases:
            out["decode_s"] = self.phases["decode_s"]
        elif self.first_token_at is not None:
            out["decode_s"] = max(now - self.first_token_at, 0.0)
        return out

    @property
    def delivered(self) -> int:
        return len(self.stream.output_ids)

    @property
    def resume_tokens(self) -> int:
        """What its next attempt prefills: the prompt and the tokens delivered."""
        return len(self.prompt_ids) + self.delivered

    def next_attempt(self, snapshot: torch.Tensor | None = None, prefill_only: bool = False) -> Attempt:
        """Its current attempt as it goes to an instance: the prompt, the sampling, the tokens delivered so far."""
        return Attempt(self.request_id, self.stream.attempt, self.prompt_ids, self.params,
                       list(self.stream.output_ids), snapshot, self.priority, prefill_only)
