"""Apt-Serve's adaptive scheduler (§5): iteration type by pending time, greedy hybrid-cache knapsack, SLO demotion.

Per iteration (digest §5.7; our decisions are in docs/llm.md):

1. p_i = time since arrival (no token yet) or since the last token (``pending="last_token"``, the paper's
   words), or since the request was last scheduled (``pending="last_scheduled"``, the default: the start of the
   last iteration that computed for it; on a real clock the time since the last token reads ≈ 0 right after
   every decode, so Σ_R p ≈ 0 and any waiting request wins the iteration type — docs/llm.md); m_i = KV blocks
   for all n_i tokens (for a running request that includes the slot of the token it is about to compute).
   The SLO-violation test (4.) always uses the time since the last token (that is what the TBT SLO measures).
2. Iteration type: with R empty → prefill. Otherwise prefill iff Σ_W p > Σ_R p **and** the prefill greedy picks
   something (Repo's fallback); else decode.
3. Values (Eq. 5–6): g_kv = p_i, g_hidden = p_i − N·ρ·n_i with N = |W| + |R| minus the requests already past their
   SLO (Repo) and ρ in seconds per cached token (the K/V re-projection cost over all layers, profiled).
4. A request past its SLO (TTFT for never-served requests, TBT since its last token otherwise) is demoted:
   ``demotion="near_zero"``: KV-only with θ = min waiting p · 1e-4 / total blocks (1e-6 without waiting
   requests) (Repo); ``demotion="decay"``: both values × 0.4 (the paper's Scheduling*).
5. Prefill: U = W, M = free blocks; the chosen requests are admitted with their chosen cache kind, in the greedy's
   order, within the token / sequence caps. Decode: U = R, M = all blocks; unselected running requests are
   preempted (recompute). A running request's only option in the decode greedy is the kind it holds (value
   g_kv or g_hidden, that kind's blocks): a kind switch would be a preemption (the paper discards the cache and
   re-prefills), i.e. no decode this iteration, so offering it at value p was inconsistent and churned every
   freshly prefilled hidden request (docs/llm.md). A preempted request's new kind is decided by the prefill greedy.
"""

from __future__ import annotations

from grserve.scheduler.knapsack import Candidate, greedy
from grserve.scheduler.llm_types import LLM_SCHEDULERS, ScheduledSeq, SchedulerInput, SchedulerOutput, SeqView


PENDING_RULES = ("last_token", "last_scheduled")


def pending_time(s: SeqView, now: float, rule: str) -> float:
    return s.pending(now) if rule == "last_token" else s.pending_since_scheduled(now)


@LLM_SCHEDULERS.register("aptserve")
class AptServeScheduler:
    name = "aptserve"

    def __init__(self, ttft_slo: float = 1.0, tbt_slo: float = 1.0, rho: float = 0.0, hybrid: bool = True,
                 demotion: str = "near_zero", decay: float = 0.4, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, pending: str = "last_scheduled", **_ignored):
        if demotion not in ("near_zero", "decay"):
            raise ValueError("demotion must be 'near_zero' or 'decay'")
        if pending not in PENDING_RULES:
            raise ValueError(f"pending must be one of {PENDING_RULES}")
        self.pending = pending
        self.ttft_slo, self.tbt_slo = ttft_slo, tbt_slo
        self.rho = rho
        self.hybrid = hybrid
        self.demotion = demotion
        self.decay = decay
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs

    # ------------------------------------------------------------------ pieces (tested one by one)
    def violated(self, s: SeqView, now: float) -> bool:
        return s.pending(now) > (self.tbt_slo if s.prefilled else self.ttft_slo)

    @staticmethod
    def iteration_type(inp: SchedulerInput, pending: str = "last_token") -> str:
        """The paper's rule: prefill iff Σ_W p > Σ_R p (R empty → prefill; W empty → decode)."""
        if not inp.waiting:
            return "decode"
        if not inp.running:
            return "prefill"
        now = inp.now
        return "prefill" if sum(pending_time(s, now, pending) for s in inp.waiting) > \
            sum(pending_time(s, now, pending) for s in inp.running) else "decode"

    def candidates(self, inp: SchedulerInput, seqs: tuple[SeqView, ...], decode: bool = False) -> list[Candidate]:
        """One candidate per request. ``decode=True`` (U = R): a running request can only be kept in the kind
        it holds (a switch is a preemption: it would not run this iteration), so its single option is that kind,
        valued g_kv or g_hidden, costing that kind's blocks; the solution's "kv" then means "keep"."""
        now, pool = inp.now, inp.pool
        everyone = inp.waiting + inp.running
        late = {s.seq_id for s in everyone if self.violated(s, now)}
        n = max(1, len(everyone) - len(late))
        since_scheduled = self.pending != "last_token"
        waiting_p = [s.pending_since_scheduled(now) if since_scheduled else s.pending(now) for s in inp.waiting]
        eps = (min(waiting_p) * 1e-4 / pool.total_blocks) if waiting_p else 1e-6
        eps = max(eps, 1e-12)
        out = []
        for s in seqs:
            p = s.pending_since_scheduled(now) if since_scheduled else s.pending(now)
            c_kv = pool.blocks_for(s.num_tokens, "kv")
            c_h = pool.blocks_for(s.num_tokens, "hidden") if self.hybrid else None
            g_h = p - n * self.rho * s.num_tokens if self.hybrid else None
            if decode and s.cache == "hidden":  # keep-as-hidden is the only option: value g_h, cost c_h
                c_kv, p, c_h, g_h = pool.blocks_for(s.num_tokens, "hidden"), p - n * self.rho * s.num_tokens, \
                    None, None
            elif decode:  # keep-as-KV is the only option
                c_h, g_h = None, None
            if s.seq_id in late:
                if self.demotion == "near_zero":
                    out.append(Candidate(s.seq_id, p, c_kv, theta_override=eps))
                    continue
                p *= self.decay
                g_h = None if g_h is None else g_h * self.decay
            out.append(Candidate(s.seq_id, p, c_kv, g_h, c_h))
        return out

    # ------------------------------------------------------------------ the policy
    def schedule(self, inp: SchedulerInput) -> SchedulerOutput:
        if not inp.waiting and not inp.running:
            return SchedulerOutput("idle")
        if self.iteration_type(inp, self.pending) == "prefill":
            out = self._prefill(inp)
            if out.scheduled or not inp.running:
                return out
        return self._decode(inp)

    def _prefill(self, inp: SchedulerInput) -> SchedulerOutput:
        sol = greedy(self.candidates(inp, inp.waiting), inp.pool.free_blocks)
        by_id = {s.seq_id: s for s in inp.waiting}
        plan, tokens = [], 0
        room = self.max_num_seqs - len(inp.running)
        for sid, kind in sol.choice.items():  # greedy (θ) order
            n = by_id[sid].num_tokens
            if len(plan) >= room or (plan and tokens + n > self.max_num_batched_tokens):
                break
            plan.append(ScheduledSeq(sid, n, kind))
            tokens += n
        return SchedulerOutput("prefill" if plan else "idle", plan,
                               info={"value": sol.value, "broke": sol.broke, "single_won": sol.single_won})

    def _decode(self, inp: SchedulerInput) -> SchedulerOutput:
        # Each running request's only option is its held kind: offering the other kind (as the prefill greedy
        # does) books value p for an option a decode cannot run — a switch is a preemption — and preempted every
        # freshly prefilled hidden request (p = 0 < 2Nρm forbids hidden) at once: re-prefill, 1 token, repeat.
        sol = greedy(self.candidates(inp, inp.running, decode=True), inp.pool.total_blocks, keeping=True)
        plan, preempted = [], []
        for s in inp.running:
            if s.seq_id not in sol.choice:
                preempted.append(s.seq_id)
            else:
                plan.append(ScheduledSeq(s.seq_id, s.num_tokens - s.num_computed, s.cache or "kv"))
        return SchedulerOutput("decode", plan, preempted,
                               info={"value": sol.value, "broke": sol.broke, "single_won": sol.single_won})


@LLM_SCHEDULERS.register("aptserve-kv")
def aptserve_kv(**kw) -> AptServeScheduler:
    """Apt-Serve's scheduling with the KV cache only (the paper's "Apt-Serve KV-only" ablation)."""
    return AptServeScheduler(**{**kw, "hybrid": False})
