"""The LLM front end's journal: one ``RequestRecord`` per request in flight — what a move needs to finish it
elsewhere (``core/recovery.py``): its prompt and sampling, the tokens delivered (``stream.TokenStream``), the instance
and attempt it runs on, its prompt's K/V snapshot when an instance returned one, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from grserve.cluster.llm.stream import TokenStream
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
    snapshot: torch.Tensor | None = None  # K/V [L, 2, m, width] of prompt_ids[:m] (owned by the front end)
    submitted_at: float = 0.0
    first_token_at: float | None = None
    recovered: list[Literal["migrate", "recompute"]] = field(default_factory=list)  # per move
    priority: Priority = Priority.ONLINE  # co-location class, carried to every instance it runs on

    @property
    def delivered(self) -> int:
        return len(self.stream.output_ids)

    def resume_prompt(self) -> list[int]:
        return self.prompt_ids + self.stream.output_ids

    def resume_params(self) -> SamplingParams:
        return replace(self.params, max_tokens=self.params.max_tokens - self.delivered)
