"""Sarathi-like chunked prefill with stall-free (coalesced) batching under a per-iteration token budget.

Every iteration: first one decode token for every decoding request (the newest running requests are preempted,
recompute, if their next block does not fit), then the remaining token budget goes to prefill chunks —
unfinished prefills first, then waiting requests in FCFS order — as long as their blocks fit. KV cache only.
"""

from __future__ import annotations

from grserve.scheduler.llm_types import (
    LLM_SCHEDULERS,
    ScheduledSeq,
    SchedulerInput,
    SchedulerOutput,
    preempt_until_fits,
)


@LLM_SCHEDULERS.register("chunked")
class ChunkedPrefillScheduler:
    name = "chunked"

    def __init__(self, token_budget: int = 512, max_num_seqs: int = 256, **_ignored):
        if token_budget < 1:
            raise ValueError("token_budget must be >= 1")
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs

    def schedule(self, inp: SchedulerInput) -> SchedulerOutput:
        pool = inp.pool
        budget = self.token_budget
        running = list(inp.running)
        decoding = [s for s in running if s.num_computed == s.num_tokens - 1]
        prefilling = [s for s in running if s.num_computed < s.num_tokens - 1]
        # decode first (stall-free); memory for one more token each
        need = {s.seq_id: pool.blocks_for(s.num_tokens, "kv") - s.held_blocks for s in running}
        dec_need = {s.seq_id: need[s.seq_id] for s in decoding}
        # preemption candidates: every running request, newest first (partial prefills included)
        kept, preempted, free = preempt_until_fits(running, pool, {**dec_need, **{s.seq_id: 0 for s in prefilling}},
                                                   pool.free_blocks)
        kept_ids = {s.seq_id for s in kept}
        plan = [ScheduledSeq(s.seq_id, 1, "kv") for s in decoding if s.seq_id in kept_ids]
        budget -= len(plan)
        n_seqs = len(kept)
        for s in [s for s in prefilling if s.seq_id in kept_ids] + list(inp.waiting):
            if budget <= 0:
                break
            is_new = s.cache is None
            if is_new and n_seqs >= self.max_num_seqs:
                break
            chunk = min(budget, s.num_tokens - s.num_computed)
            extra = pool.blocks_for(s.num_computed + chunk, "kv") - s.held_blocks
            if extra > free:
                # shrink the chunk to what fits, block-aligned
                fit_tokens = (s.held_blocks + free) // pool.kv_planes * pool.block_size - s.num_computed
                chunk = min(chunk, fit_tokens)
                if chunk <= 0:
                    break
                extra = pool.blocks_for(s.num_computed + chunk, "kv") - s.held_blocks
            plan.append(ScheduledSeq(s.seq_id, chunk, "kv"))
            free -= extra
            budget -= chunk
            n_seqs += is_new
        if not plan:
            return SchedulerOutput("idle", [], preempted)
        return SchedulerOutput("mixed", plan, preempted)
