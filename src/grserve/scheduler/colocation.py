"""Online/offline co-location (xLLM §3.1, digest §3.2) as a policy layer around any LLM scheduler.

``ColocationScheduler(inner)`` is itself an ``LLMScheduler``; each iteration it

1. **orders the queues by priority**: W = the online waiting requests, then the offline ones (each in queue order,
   so a preempted offline request — the engine puts it at the front of W — is at the head of the offline queue);
   R = the offline requests already preempted ``max_offline_preemptions`` times, then the online ones, then the
   offline requests that may still be preempted (each group in admission order). A policy that preempts "the
   newest running request" (fcfs, chunked: ``preempt_until_fits``) therefore takes preemptable offline victims
   first and never a capped one before an online one: the bound is strict, so every offline request finishes;
2. asks ``inner`` for a plan;
3. **preempts offline work for online work**: when the first online request still to prefill (waiting, or a
   running prefill that got no tokens) was not scheduled and its blocks do not fit the free pool (or R is at the
   policy's ``max_num_seqs``), it picks offline victims (beyond the policy's own), newest first among those still
   preemptable, until the request fits, and re-plans without them (recompute: the engine frees their blocks and
   puts them back at the front of W). If all victims together would not make it fit, nobody is preempted;
4. **admits offline rows into a latency-strict batch by the latency model**: when the batch holds online work (an
   online row is scheduled or an online request is running), the online rows stay and the offline rows join —
   decodes first, then prefill chunks, a chunk cut to the largest size that fits (an offline prefill proceeds in
   SLO-sized pieces: our stand-in for the paper's interruptible offline prefill) — only while
   ``StepLatencyModel`` predicts the step within ``tpot_slo_s`` — and within what keeps every running online
   request's TPOT so far inside the SLO (a request already slowed by prefill steps gets no offline work added
   to its steps, which protects the TPOT tail); the others are deferred (they keep their blocks
   and wait; ``stats["offline_deferred"]`` counts them per step). A step with no online row while online
   requests run (fcfs planned a prefill of offline requests only) would stall them all: its offline rows are all
   deferred. Whenever rows were deferred it re-plans without the deferred requests (at most twice), so the token
   budget they held goes to the rows that run (an online prompt gets its whole chunk; fcfs decodes instead).
   While an online prompt is pending (waiting, or partly prefilled) offline prefill rows are deferred too (online
   prompts first: chunked serves running prefills before W). Without online work offline decodes run freely,
   but an offline prefill chunk is always cut to what keeps the step within the SLO: the paper interrupts an
   offline prefill when online work arrives; one step cannot be interrupted here, so a step is kept short enough
   that an arriving online request waits about one TPOT SLO at most. A step the layer would leave empty (nothing
   scheduled or preempted) is replaced by the policy's own plan (liveness).

The engine calls ``observe_step(plan, seconds)`` after each executed step: the model learns from every step, and
a correction factor (EWMA of measured / predicted time over latency-strict steps, in [0.5, 2]) scales its
predictions where they are used: the linear fit is dominated by the most frequent steps (big offline batches).
"""

from __future__ import annotations

from dataclasses import replace

from grserve.config import Priority
from grserve.scheduler.llm_types import (
    LLMScheduler,
    ScheduledSeq,
    SchedulerInput,
    SchedulerOutput,
    SeqView,
)
from grserve.scheduler.step_latency import StepFeatures, StepLatencyModel, item_features

_OWN = frozenset({"inner", "name", "tpot_slo_s", "max_offline_preemptions", "offline_admission", "model",
                  "stats", "_last", "_last_pred"})


class ColocationScheduler:
    def __init__(self, inner: LLMScheduler, *, tpot_slo_s: float = 0.1, max_offline_preemptions: int = 3,
                 offline_admission: bool = True, model: StepLatencyModel | None = None):
        self.inner = inner
        self.name = inner.name
        self.tpot_slo_s = tpot_slo_s
        self.max_offline_preemptions = max_offline_preemptions
        self.offline_admission = offline_admission
        self.model = model if model is not None else StepLatencyModel()
        self.stats = {"offline_deferred": 0, "offline_victims": 0}
        self._last: StepFeatures | None = None
        self._last_pred: float | None = None  # the model's prediction of the last step, if it was latency-strict

    # the wrapped policy's knobs read and write through (e.g. ``max_num_seqs``)
    def __getattr__(self, name: str):
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __setattr__(self, name: str, value) -> None:
        if name not in _OWN and "inner" in self.__dict__ and hasattr(self.inner, name):
            setattr(self.inner, name, value)
        else:
            object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ the policy
    def schedule(self, inp: SchedulerInput) -> SchedulerOutput:
        if any(s.priority == Priority.OFFLINE for s in inp.waiting) or any(s.priority == Priority.OFFLINE for s in inp.running):
            out = self._colocated(inp)
        else:
            out = self.inner.schedule(inp)
        self._last = _plan_features(out, {s.seq_id: s for s in (*inp.waiting, *inp.running)})
        scheduled = {x.seq_id for x in out.scheduled}
        strict = any(s.priority != Priority.OFFLINE for s in inp.running) or any(
            s.priority != Priority.OFFLINE and s.seq_id in scheduled for s in inp.waiting)
        self._last_pred = self.model.predict(self._last) if strict else None
        return out

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        if self._last is not None:
            if self._last_pred:
                self.model.observe_strict(self._last_pred, seconds)
            self.model.observe(self._last, seconds)
            self._last = None

    def _preemptable(self, s: SeqView) -> bool:
        return s.priority == Priority.OFFLINE and s.num_preemptions < self.max_offline_preemptions

    def _ordered(self, inp: SchedulerInput) -> SchedulerInput:
        w = [s for s in inp.waiting if s.priority != Priority.OFFLINE] + [s for s in inp.waiting if s.priority == Priority.OFFLINE]
        capped = [s for s in inp.running if s.priority == Priority.OFFLINE and not self._preemptable(s)]
        r = (capped + [s for s in inp.running if s.priority != Priority.OFFLINE]
             + [s for s in inp.running if self._preemptable(s)])
        return replace(inp, waiting=tuple(w), running=tuple(r))

    def _colocated(self, inp: SchedulerInput) -> SchedulerOutput:
        inp = self._ordered(inp)
        out = first = self.inner.schedule(inp)
        victims = self._victims_for_online(inp, out)
        if victims:
            gone = {v.seq_id for v in victims}
            freed = sum(v.freed_by_preemption for v in victims)
            inp = replace(inp, running=tuple(s for s in inp.running if s.seq_id not in gone),
                          pool=replace(inp.pool, free_blocks=inp.pool.free_blocks + freed))
            out = self.inner.schedule(inp)
            self.stats["offline_victims"] += sum(v.priority == Priority.OFFLINE for v in victims)
        for attempt in range(3):
            gated, deferred = self._admit_offline(inp, out)
            if not deferred or attempt == 2:
                out = gated
                break
            # re-plan without the deferred requests (they keep their blocks): the budget they were given goes to
            # the rows that run — an online prompt gets its whole chunk, fcfs decodes instead of an offline
            # prefill. A deferred waiting request holds back the offline requests queued behind it (FIFO), or
            # the re-plan would only pick the next ones
            if any(s.seq_id in deferred for s in inp.waiting):
                deferred = deferred | {s.seq_id for s in inp.waiting if s.priority == Priority.OFFLINE}
            inp = replace(inp, waiting=tuple(s for s in inp.waiting if s.seq_id not in deferred),
                          running=tuple(s for s in inp.running if s.seq_id not in deferred))
            out = self.inner.schedule(inp)
        out.preempted = [v.seq_id for v in victims] + list(out.preempted)
        if not out.scheduled and not out.preempted:
            return first  # co-location never idles the engine: the policy's own plan (liveness)
        return out

    def _victims_for_online(self, inp: SchedulerInput, out: SchedulerOutput) -> list[SeqView]:
        """Offline requests to preempt so that the first online request still to prefill gets in (or [])."""
        scheduled = {x.seq_id for x in out.scheduled}
        todo = [s for s in inp.running if s.priority == Priority.ONLINE and s.num_computed < s.num_tokens - 1]
        todo += [s for s in inp.waiting if s.priority == Priority.ONLINE]
        if not todo or todo[0].seq_id in scheduled:
            return []
        head, pool = todo[0], inp.pool
        need = pool.blocks_for(head.num_tokens, head.cache or "kv") - head.held_blocks
        gone = set(out.preempted)  # the policy's own victims: preempted anyway, their blocks count as free
        already = [s for s in inp.running if s.seq_id in gone]
        growth = _growth(out, inp)  # blocks each scheduled row takes this step
        free = pool.free_blocks + sum(s.freed_by_preemption for s in already) - sum(growth.values())
        seats = getattr(self.inner, "max_num_seqs", None)
        seat_short = head.cache is None and seats is not None and len(inp.running) - len(already) >= seats
        if need <= free and not seat_short:
            return []  # memory is not what keeps it out (the policy's choice, a token budget): no preemption
        candidates = [s for s in inp.running if self._preemptable(s) and s.seq_id not in gone]
        chosen: list[SeqView] = []
        while candidates and (free < need or seat_short):
            v = candidates.pop()  # newest first
            chosen.append(v)
            free += v.freed_by_preemption + growth.get(v.seq_id, 0)
            seat_short = False
        return already + chosen if chosen and free >= need else []

    def _admit_offline(self, inp: SchedulerInput, out: SchedulerOutput) -> tuple[SchedulerOutput, set[int]]:
        """Drop the offline rows that would take a latency-strict step past the TPOT SLO (cut a prefill chunk to
        fit); return the new plan and the ids of the deferred requests."""
        if not out.scheduled:
            return out, set()
        views = {s.seq_id: s for s in (*inp.waiting, *inp.running)}
        gone = set(out.preempted)
        online = [x for x in out.scheduled if views[x.seq_id].priority != Priority.OFFLINE]
        online_running = any(s.priority != Priority.OFFLINE and s.seq_id not in gone for s in inp.running)
        prompt_pending = any(s.priority != Priority.OFFLINE for s in inp.waiting) or any(
            s.priority != Priority.OFFLINE and s.num_computed < s.num_tokens - 1 and s.seq_id not in gone
            for s in inp.running)
        offline = [x for x in out.scheduled if views[x.seq_id].priority == Priority.OFFLINE]
        if not offline:
            return out, set()
        feats = {x.seq_id: item_features(views[x.seq_id].num_tokens, views[x.seq_id].num_computed, x.num_tokens)
                 for x in out.scheduled}
        total = StepFeatures()
        for x in online:
            total = total + feats[x.seq_id]
        limit = self._step_limit(inp, gone)
        plan: dict[int, ScheduledSeq] = {x.seq_id: x for x in online}
        for x in sorted(offline, key=lambda x: feats[x.seq_id].decode_requests == 0):  # decodes first
            v, f = views[x.seq_id], feats[x.seq_id]
            if (online_running and not online) or (prompt_pending and not f.decode_requests):
                n = 0  # a step without the running online requests stalls them; online prompts go first
            elif not self.offline_admission or (f.decode_requests and not (online or online_running)):
                n = x.num_tokens  # no latency-strict work in the batch: offline decodes run freely
            else:  # a strict batch; or an offline prefill chunk, always cut to the SLO (interruptible prefill)
                n = self._fitting_tokens(total, v, x.num_tokens, bool(online or online_running), limit)
            if n > 0:  # the whole row, or a prefill chunk cut to fit (the rest of the prompt waits)
                plan[x.seq_id] = x if n == x.num_tokens else ScheduledSeq(x.seq_id, n, x.cache)
                total = total + item_features(v.num_tokens, v.num_computed, n)
        deferred = {x.seq_id for x in offline if x.seq_id not in plan}
        if len(plan) == len(out.scheduled) and all(plan[x.seq_id] is x for x in out.scheduled):
            return out, set()
        self.stats["offline_deferred"] += len(deferred)
        rows = [plan[x.seq_id] for x in out.scheduled if x.seq_id in plan]
        return SchedulerOutput(out.kind if rows else "idle", rows, list(out.preempted), dict(out.info)), deferred

    def _step_limit(self, inp: SchedulerInput, gone: set[int]) -> float:
        """The longest step that keeps every running online request's TPOT so far within the SLO (at most the
        SLO itself): a request already slowed by prefill steps gets no offline work added to its steps."""
        limit = self.tpot_slo_s
        for s in inp.running:
            if s.priority != Priority.OFFLINE and s.seq_id not in gone and s.first_token_time is not None:
                limit = min(limit, self.tpot_slo_s * s.num_output - (inp.now - s.first_token_time))
        return limit

    def _fitting_tokens(self, total: StepFeatures, v: SeqView, n: int, strict: bool, limit: float) -> int:
        """How many of the row's ``n`` tokens keep the step within the SLO: n, or for a prefill row the largest
        chunk that does (binary search on the model), or 0."""
        if self.model.coef is None:  # no model yet: nothing joins a strict batch; an offline-only step is not cut
            return 0 if strict else n

        def fits(k: int) -> bool:
            t = self.model.predict(total + item_features(v.num_tokens, v.num_computed, k))
            return t is not None and t * self.model.correction <= limit

        if fits(n):
            return n
        if item_features(v.num_tokens, v.num_computed, n).decode_requests or not fits(1):
            return 0
        lo, hi = 1, n  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo


def _growth(out: SchedulerOutput, inp: SchedulerInput) -> dict[int, int]:
    """Blocks each scheduled row of ``out`` adds to what its request holds (a preempted-and-rescheduled row
    starts from nothing)."""
    views = {s.seq_id: s for s in (*inp.waiting, *inp.running)}
    gone = set(out.preempted)
    grow = {}
    for x in out.scheduled:
        v = views[x.seq_id]
        held, done = (0, 0) if v.cache is None or x.seq_id in gone else (v.held_blocks, v.num_computed)
        grow[x.seq_id] = max(0, inp.pool.blocks_for(done + x.num_tokens, x.cache) - held)
    return grow


def _plan_features(out: SchedulerOutput, views: dict[int, SeqView]) -> StepFeatures:
    total = StepFeatures()
    for x in out.scheduled:
        v = views.get(x.seq_id)
        if v is not None:
            total = total + item_features(v.num_tokens, v.num_computed if v.cache is not None else 0, x.num_tokens)
    return total
