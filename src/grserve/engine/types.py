"""Plain request/result types that cross the engine boundary (server → engine → server).

The server validates and converts every user input into a ``RetrievalRequest`` (prompt tokens already laid out),
so the engine can assume valid requests.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from grserve.config import Priority

if TYPE_CHECKING:
    from grserve.catalog.allowlist import Allow
    import torch

    from grserve.engine.sampling import SamplingParams
    from grserve.engine.think import ThinkSpec


@dataclass
class RetrievalRequest:
    prompt_tokens: np.ndarray  # int64 [L], L >= 1, every id < vocab_size
    beam_width: int
    top_n: int  # 1 <= top_n <= beam_width
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    arrival: float = field(default_factory=time.perf_counter)
    exclude_items: np.ndarray | None = None  # int64 item ids masked out inside the search (unknown ids: no-op)
    include: "Allow | None" = None  # the only items it may get (include_items / include_sid_prefix), masked alike
    think: "ThinkSpec | None" = None  # write free text until sid_begin first (think-then-recommend)
    logprobs: bool = False  # each item's per-token log-probabilities wanted (the host-driven search gives them)

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_tokens.shape[0])


def json_score(score: float) -> float:
    """A score as the APIs write it: JSON cannot carry a non-finite number, so -inf (or nan) is -1e30."""
    score = float(score)
    return score if math.isfinite(score) else -1e30


@dataclass(frozen=True)
class RetrievedItem:
    item_id: int
    sid: tuple[int, ...]
    score: float  # summed log-probability of the SID tokens under the configured scoring convention
    token_logprobs: tuple[float, ...] = ()  # per SID token (the host-driven search; empty from the device path)


@dataclass
class RetrievalResult:
    request_id: str
    items: list[RetrievedItem]  # best first; fewer than top_n when fewer valid items exist
    queue_ms: float = 0.0  # arrival → batch start
    compute_ms: float = 0.0  # batch start → result
    batch_size: int = 1  # requests in the batch that served this one
    candidates_visited: int = 0  # top-BW candidates an early-terminated scan touched, summed over steps
    catalog_version: int = 0
    kv_bytes: int = 0  # KV cache bytes this request held: (L + BW·ND) · bytes_per_token
    thought: list[int] | None = None  # think-then-recommend: the tokens written, ending in sid_begin
    thought_forced: bool = False  # sid_begin was appended at max_think_tokens
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not computed)


@dataclass(frozen=True)
class Handover:
    """What an LLM request carries across cluster instances (a move off a dead instance, PD's hand-off from its
    prefill to its decode instance): the engine runs one attempt of it."""

    delivered: list[int] = field(default_factory=list)  # output tokens the client has: the engine continues after
    #                                                     them (they count as output); its events carry what follows
    prompt_kv: torch.Tensor | None = None  # K/V [L, 2, m, width] of the first m tokens (prompt + delivered),
    #                                        computed elsewhere: loaded at admission instead of computed
    export_kv: bool = False  # hand out the K/V its prefill computed with its first token (``TokenEvent.prompt_kv``)
    pause_after: int | None = None  # end the attempt after this many new tokens, finish reason "pause": the
    #                                 request goes on elsewhere, so the text held back stays held back


@dataclass
class LLMRequest:
    """One LLM generation request: prompt token ids (already validated) and its sampling parameters."""

    prompt_ids: list[int]
    params: "SamplingParams"
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    priority: Priority = Priority.ONLINE  # co-location class (issue 13: online work preempts offline work)
    handover: Handover | None = None  # an attempt of a request that began on another cluster instance

    def __post_init__(self) -> None:
        self.priority = Priority.of(self.priority)  # the API hands its "online" / "offline" strings


@dataclass(frozen=True)
class LLMFit:
    """What an LLM engine can ever hold — the one fit check of a request, made by the engine (``add_request``) and
    by a cluster front end for its instances (``ClusterLLMEngine.submit``, from the instances' ``LLMFit``)."""

    max_model_len: int | None  # None: no model length limit (a simulated engine)
    num_blocks: int
    block_size: int
    kv_planes: int = 2  # blocks per token group of a KV cache (its K and V planes)

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """``ValueError`` when a prompt of ``prompt_tokens`` with ``max_tokens`` to generate can never run: empty,
        longer than the model, or more KV blocks than the whole pool."""
        if prompt_tokens < 1:
            raise ValueError("prompt must have at least one token")
        total = prompt_tokens + max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise ValueError(f"prompt ({prompt_tokens}) + max_tokens ({max_tokens}) exceeds the model length "
                             f"{self.max_model_len}")
        if self.kv_planes * -(-total // self.block_size) > self.num_blocks:
            raise ValueError(f"prompt + max_tokens = {total} tokens never fits the KV pool ({self.num_blocks} "
                             f"blocks of {self.block_size})")


@dataclass
class LLMResult:
    """The end of an LLM request: every generated token, the text, and why it stopped ("stop" | "length"; "pause":
    an attempt that ended for a hand-off, ``Handover.pause_after``)."""

    request_id: str
    output_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (its last admission)
    # its phases in the engine, in seconds (None where the engine does not report them, e.g. a cluster):
    queue_s: float | None = None  # arrival → first scheduled
    prefill_s: float | None = None  # first scheduled → first token
    decode_s: float | None = None  # first token → last token


@dataclass
class RankingRequest:
    """One BAT ranking request: a user profile and candidate items as tokens (already validated)."""


    user_tokens: np.ndarray  # int64 profile 𝒰
    item_tokens: list[np.ndarray]  # per candidate; the last token is its identifier token
    user_id: int | None = None  # None: raw tokens, never cached
    item_ids: list[int | None] | None = None  # None entries: raw candidates (never cached)
    top_k: int = 10
    now: float | None = None  # hotness clock (trace seconds); None → time.time()
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        return len(self.user_tokens) + sum(len(t) for t in self.item_tokens)


@dataclass
class RankingResult:
    request_id: str
    order: list[int]  # candidate indices, best first
    scores: list[float]  # softmax probabilities of ``order`` (over the request's candidates)
    layout: str
    total_tokens: int
    computed_tokens: int
    cached_tokens: int
    user_cache_hit: bool
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    batch_size: int = 1
    logprobs: list[float] = field(default_factory=list)  # of ``order``: identifier token, full vocabulary
