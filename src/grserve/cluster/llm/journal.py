"""The LLM front end's journal: one ``RequestRecord`` per request in flight — what a move needs to finish it
elsewhere (``core/recovery.py``): its prompt and sampling, the tokens delivered (``stream.TokenStream``), the instance
and attempt it runs on, its prompt's K/V snapshot when an instance returned one, and its timings."""

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
