"""The LLM scheduling contract: what a policy sees (plain views) and what it returns (a plain plan).

Policies never touch tensors or block tables. Each iteration the engine hands a ``SchedulerInput`` — the clock,
the waiting queue W (requests holding no blocks: new, or preempted; in queue order, preempted ones first), the
running set R (requests holding blocks, in admission order) and the pool's block arithmetic — and executes the
returned ``SchedulerOutput``:

1. ``preempted``: free those requests' blocks and put them back at the front of W (recompute preemption; a
   cache-type switch is a preemption too: the paper discards the cache and re-prefills it in the new type);
2. ``scheduled``: for each (seq, num_tokens, cache) grow the request's blocks to hold num_computed + num_tokens
   tokens of ``cache`` and compute those tokens in one packed forward pass; a request whose last token was
   computed samples its next token.

A token count n of a request is "prompt + generated so far"; a request with ``num_computed == num_tokens − 1``
is decoding (its newest token is not yet in the cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from grserve.config import Priority
from grserve.kvcache.blocks import CacheKind
from grserve.registry import Registry

IterationKind = Literal["prefill", "decode", "mixed", "idle"]


class SeqView(NamedTuple):
    """One request as a policy sees it (a named tuple: immutable, and cheap to build — the engine builds one per
    request per iteration, the simulator's hot path)."""

    seq_id: int
    arrival: float
    last_token_time: float | None  # None until the first output token
    num_tokens: int  # prompt + generated so far
    num_computed: int  # tokens whose cache is in the pool (0 for waiting requests)
    num_output: int
    cache: CacheKind | None  # kind of the blocks it holds (None when waiting)
    held_blocks: int
    freeable_blocks: int = -1  # blocks its preemption frees (shared prefix blocks excluded); -1: held_blocks
    last_scheduled: float | None = None  # start of the last iteration that computed tokens for it
    priority: Priority = Priority.ONLINE
    num_preemptions: int = 0  # times it was preempted so far
    first_token_time: float | None = None  # when its first output token came (TPOT so far, co-location)

    @property
    def freed_by_preemption(self) -> int:
        return self.held_blocks if self.freeable_blocks < 0 else self.freeable_blocks

    @property
    def prefilled(self) -> bool:
        return self.last_token_time is not None

    def pending(self, now: float) -> float:
        """p_i (§4.2): time since arrival before the first token, else since the last token."""
        return now - (self.arrival if self.last_token_time is None else self.last_token_time)

    def pending_since_scheduled(self, now: float) -> float:
        """Time since the request was last *scheduled* (the start of the last iteration that computed tokens
        for it), or since arrival if never: the gap its next token will close, which — unlike the time since
        its last token — does not read 0 right after every decode (docs/llm.md, real clocks)."""
        t = self.last_scheduled
        if t is None:
            t = self.arrival if self.last_token_time is None else self.last_token_time
        return now - t


@dataclass(frozen=True)
class PoolView:
    total_blocks: int
    free_blocks: int
    block_size: int
    kv_planes: int = 2
    hidden_planes: int = 1

    def blocks_for(self, num_tokens: int, kind: CacheKind) -> int:
        planes = self.kv_planes if kind == "kv" else self.hidden_planes
        return planes * (-(-num_tokens // self.block_size))


@dataclass(frozen=True)
class SchedulerInput:
    now: float
    waiting: tuple[SeqView, ...]
    running: tuple[SeqView, ...]
    pool: PoolView


@dataclass(frozen=True)
class ScheduledSeq:
    seq_id: int
    num_tokens: int  # new tokens to compute this iteration (1 for a decode step)
    cache: CacheKind


@dataclass
class SchedulerOutput:
    kind: IterationKind
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # policy statistics (knapsack value, ...), for logs and tests


class LLMScheduler(Protocol):
    name: str

    def schedule(self, inp: SchedulerInput) -> SchedulerOutput: ...


# the policies by name: each policy module registers itself; ``scheduler.llm_factory`` imports them all
LLM_SCHEDULERS: Registry[LLMScheduler] = Registry("LLM scheduler")


def preempt_until_fits(running: list[SeqView], pool: PoolView, need: dict[int, int],
                       free: int) -> tuple[list[SeqView], list[int], int]:
    """vLLM's recompute preemption: drop the latest-admitted running requests until every kept request's extra
    blocks (``need[seq_id]``) fit in ``free`` (+ the victims' freed blocks). Returns (kept, preempted, free)."""
    kept = list(running)
    preempted: list[int] = []
    total = sum(need[s.seq_id] for s in kept)
    while kept and total > free:
        victim = kept.pop()
        total -= need[victim.seq_id]
        free += victim.freed_by_preemption
        preempted.append(victim.seq_id)
    return kept, preempted, free - total
