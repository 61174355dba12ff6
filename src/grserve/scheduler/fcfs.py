"""vLLM-like FCFS: prefill whenever the head of W fits, else decode all of R (preempt the newest on OOM).

Prefill and decode are never mixed. Admission stops at the first waiting request that does not fit (strict
FCFS: no overtaking). ``cache="hidden"`` gives the "Apt-Serve with FCFS" ablation (hidden cache for all).
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

    def __init__(self, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256, cache: CacheKind = "kv",
                 **_ignored):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.cache: CacheKind = cache

    def schedule(self, inp: SchedulerInput) -> SchedulerOutput:
        pool = inp.pool
        admitted: list[ScheduledSeq] = []
        free, tokens = pool.free_blocks, 0
        for s in inp.waiting:
            need = pool.blocks_for(s.num_tokens, self.cache)
            if len(inp.running) + len(admitted) >= self.max_num_seqs:
                break
            if admitted and tokens + s.num_tokens > self.max_num_batched_tokens:
                break
            if need > free:
                break
            admitted.append(ScheduledSeq(s.seq_id, s.num_tokens, self.cache))
            free -= need
            tokens += s.num_tokens
        if admitted:
            return SchedulerOutput("prefill", admitted)
        if not inp.running:
            return SchedulerOutput("idle")
        need = {s.seq_id: pool.blocks_for(s.num_tokens, s.cache or self.cache) - s.held_blocks for s in inp.running}
        kept, preempted, _ = preempt_until_fits(list(inp.running), pool, need, pool.free_blocks)
        out = [ScheduledSeq(s.seq_id, s.num_tokens - s.num_computed, s.cache or self.cache) for s in kept]
        return SchedulerOutput("decode", out, preempted)
