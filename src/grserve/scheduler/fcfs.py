"""vLLM-like FCFS: prefill whenever the head of W fits, else decode all of R (preempt the newest on OOM).

Prefill and decode are never mixed. Admission stops at the first waiting request that does not fit (strict
FCFS: no overtaking), as vLLM 0.5's default scheduler: a prefill must leave ``watermark`` × the pool free
(vLLM's block manager, 1 %; 0 by default here), within ``max_num_batched_tokens`` (2048 = max(OPT's 2048
positions, 2048)) and ``max_num_seqs`` (256); a decode that lacks a block preempts the newest running request
(recompute). Cache kind: ``cache="kv"`` (vLLM), ``"hidden"`` (hidden cache for all), or ``"hybrid"`` — the
paper's Table 5 "FCFS" column (FCFS scheduling on the hybrid cache; how kinds are chosen there is not stated,
our reading: KV when it fits, hidden when only that fits, i.e. the hybrid cache as a memory fallback).
"""

from __future__ import annotations

from grserve.kvcache.blocks import CacheKind
from grserve.scheduler.llm_types import (
    LLM_SCHEDULERS,
    ScheduledSeq,
    SchedulerInput,
    SchedulerOutput,
    preempt_until_fits,
)


@LLM_SCHEDULERS.register("fcfs")
class FCFSScheduler:
    name = "fcfs"

    def __init__(self, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, cache: str = "kv",
                 watermark: float = 0.0, **_ignored):
        if cache not in ("kv", "hidden", "hybrid"):
            raise ValueError("cache must be 'kv', 'hidden' or 'hybrid'")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.cache = cache
        self.watermark = watermark

    def _kind(self, s, free: int, pool) -> tuple[CacheKind | None, int]:
        kinds: tuple[CacheKind, ...] = ("kv", "hidden") if self.cache == "hybrid" else (self.cache,)  # type: ignore
        for kind in kinds:
            need = pool.blocks_for(s.num_tokens, kind)
            if need <= free:
                return kind, need
        return None, 0

    def schedule(self, inp: SchedulerInput) -> SchedulerOutput:
        pool = inp.pool
        admitted: list[ScheduledSeq] = []
        free, tokens = pool.free_blocks - int(self.watermark * pool.total_blocks), 0
        for s in inp.waiting:
            if len(inp.running) + len(admitted) >= self.max_num_seqs:
                break
            if admitted and tokens + s.num_tokens > self.max_num_batched_tokens:
                break
            kind, need = self._kind(s, free, pool)
            if kind is None:
                break
            admitted.append(ScheduledSeq(s.seq_id, s.num_tokens, kind))
            free -= need
            tokens += s.num_tokens
        if admitted:
            return SchedulerOutput("prefill", admitted)
        if not inp.running:
            return SchedulerOutput("idle")
        need = {s.seq_id: pool.blocks_for(s.num_tokens, s.cache or "kv") - s.held_blocks for s in inp.running}
        kept, preempted, _ = preempt_until_fits(list(inp.running), pool, need, pool.free_blocks)
        out = [ScheduledSeq(s.seq_id, s.num_tokens - s.num_computed, s.cache or "kv") for s in kept]
        return SchedulerOutput("decode", out, preempted)
