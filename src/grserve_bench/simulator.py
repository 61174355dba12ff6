"""Discrete-event serving: a virtual clock, a cost-model executor (paper scale), and the trace driver.

The same ``LLMEngine`` (same schedulers, same block pool bookkeeping) runs either
- the real model through ``TimedExecutor`` (the clock advances by each iteration's measured wall time, and jumps
  over idle gaps instead of sleeping — identical to real-time serving while busy), or
- ``SimulatedExecutor``: no tensors; iteration time from ``CostModel``.

Cost model (seconds per iteration; digest §10.1 layer B):
    T = a + b·Σ prefill tokens + b_dec·#decodes + c_seq·#requests + c_pre·Σ_prefills new·context
        + c_dec·Σ context (decode reads) + rho_h·Σ_{hidden requests} cached tokens (K/V re-projection)

Two shapes share the paper's one anchor (≈ 120 ms for a 50-request OPT-13B decode, §6.8), differing in how that
time splits between a per-iteration part and a per-request part — the assumption the paper's gain rests on
(docs/results/llm.md, "what moved the result"): ``opt13b_a100()`` (per-request heavy: ≈ 1.1 ms per request, the time
grows almost linearly with the batch) and ``opt13b_a100_roofline()`` (A100 roofline slopes, the rest fixed:
decode is memory-bound, a bigger batch costs little). ``opt13b_a100_physical()`` is the roofline without the
anchor (≈ 41 ms at 50 requests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from grserve.engine.llm import LLMEngine
from grserve.engine.sampling import SamplingParams
from grserve.kvcache.blocks import BlockPool
from grserve.scheduler.llm_factory import make_llm_scheduler


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += max(0.0, dt)


# OPT-13B on an A100-40GB (fp16): the numbers the roofline presets are built from
OPT13B_PARAMS = 12.85e9
OPT13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2  # K and V, 40 layers, d = 5120, fp16: 819,200 B
A100_HBM_BPS = 1.3e12  # effective (peak 1.555 TB/s)
A100_FLOPS = 2.0e11 * 1e3  # 200 TFLOP/s effective fp16 (peak 312)
# attention: QK^T and AV cost 2·d FLOP each per (query, key) pair and layer: 4·d·L = 819,200 FLOP per pair, 4.1 ns at
# 200 TFLOP/s
OPT13B_ATTN_S_PER_PAIR = 4 * 5120 * 40 / A100_FLOPS
ANCHOR_DECODE_S, ANCHOR_BATCH, ANCHOR_CONTEXT = 0.120, 50, 350  # §6.8; context: ShareGPT prompt + output/2


@dataclass(frozen=True)
class CostModel:
    a: float
    b: float
    c_seq: float
    c_pre: float
    c_dec: float
    rho_h: float
    b_dec: float | None = None  # compute per decode token (None: b)
    name: str = "custom"
    overlap_mem: float | None = None  # roofline overlap: memory time per iteration (weights), see iteration_time

    @classmethod
    def opt13b_a100(cls) -> "CostModel":
        """OPT-13B fp16 on one A100-40GB, roofline-derived and anchored to the paper's ≈120 ms decode iteration
        with 50 requests (vLLM 0.5, eager): 26 GFLOP/token at ~200 TFLOP/s; attention 4·d·L FLOP per (q, k) pair;
        KV reads 0.8 MB/token at ~0.55 TB/s effective (paged, eager); 1 ms per-request overhead (Python, sampling);
        K/V re-projection 4·d²·L = 4.2 GFLOP per cached hidden token."""
        return cls(a=0.030, b=1.3e-4, c_seq=1.0e-3, c_pre=OPT13B_ATTN_S_PER_PAIR, c_dec=1.5e-6, rho_h=2.1e-5, name="linear")

    @classmethod
    def opt13b_a100_roofline(cls, anchor_s: float | None = ANCHOR_DECODE_S) -> "CostModel":
        """A100 roofline slopes: a decode step reads the weights once (26 GB / 1.3 TB/s = 20 ms, per iteration)
        and each request's KV (0.82 MB per context token / 1.3 TB/s = 0.63 µs), its 26 GFLOP per token hidden
        under the weight read (b_dec = 0); 0.1 ms per request (sampling, Python); prefill compute-bound
        (0.13 ms per token). With ``anchor_s`` the per-iteration part is raised so a 50-request decode at 350
        tokens of context takes ``anchor_s`` (the paper's 120 ms: eager vLLM 0.5 overheads, per iteration);
        None: 20 ms + 5 ms launch overhead (≈ 41 ms at the anchor point; ``opt13b_a100_physical`` adds the overlap)."""
        c_dec = OPT13B_KV_BYTES_PER_TOKEN / A100_HBM_BPS
        c_seq = 1.0e-4
        a = 2 * OPT13B_PARAMS / A100_HBM_BPS + 0.005
        if anchor_s is not None:
            a = anchor_s - ANCHOR_BATCH * (c_seq + c_dec * ANCHOR_CONTEXT)
        return cls(a=a, b=2 * OPT13B_PARAMS / A100_FLOPS, c_seq=c_seq, c_pre=OPT13B_ATTN_S_PER_PAIR, c_dec=c_dec, rho_h=2.1e-5,
                   b_dec=0.0, name="roofline" if anchor_s is not None else "physical")

    @classmethod
    def opt13b_a100_physical(cls) -> "CostModel":
        """The A100 roofline with overlap, no anchor: T = 5 ms launch + 0.1 ms per request + max(memory,
        compute), memory = weights (20 ms) + KV reads (0.63 µs per context token; a hidden request reads half)
        and compute = 0.13 ms per token computed + attention + the hidden requests' K/V re-projection (21 µs
        per cached token). A decode is memory-bound until its compute (tokens, re-projection) exceeds the
        weight and KV read time — so a few hidden requests ride free, as on the paper's GPU."""
        c_dec = OPT13B_KV_BYTES_PER_TOKEN / A100_HBM_BPS
        return cls(a=0.005, b=2 * OPT13B_PARAMS / A100_FLOPS, c_seq=1.0e-4, c_pre=OPT13B_ATTN_S_PER_PAIR, c_dec=c_dec,
                   rho_h=2.1e-5, name="physical", overlap_mem=2 * OPT13B_PARAMS / A100_HBM_BPS)

    @classmethod
    def preset(cls, name: str) -> "CostModel":
        return {"linear": cls.opt13b_a100, "roofline": cls.opt13b_a100_roofline,
                "physical": cls.opt13b_a100_physical}[name]()

    def iteration_time(self, items) -> float:
        if self.overlap_mem is not None:
            return self._roofline_time(items)
        t = self.a
        b_dec = self.b if self.b_dec is None else self.b_dec
        for it in items:
            ctx = it.start + it.num_new
            t += self.c_seq
            if it.num_new == 1:  # memory-bound: its attention is the KV read (c_dec)
                t += b_dec + self.c_dec * ctx
            else:  # compute-bound: projections and MLP per token, attention per (query, key) pair
                t += self.b * it.num_new + self.c_pre * it.num_new * ctx
            if it.kind == "hidden":
                t += self.rho_h * it.start
        return t


    def _roofline_time(self, items) -> float:
        mem, comp = self.overlap_mem, 0.0
        for it in items:
            ctx = it.start + it.num_new
            comp += self.b * it.num_new + self.c_pre * it.num_new * ctx
            if it.kind == "hidden":
                comp += self.rho_h * it.start
                mem += 0.5 * self.c_dec * ctx
            else:
                mem += self.c_dec * ctx
        return self.a + self.c_seq * len(items) + max(mem, comp)


class SimulatedExecutor:
    def __init__(self, cost: CostModel):
        self.cost = cost

    def execute(self, items, pool):
        return None, self.cost.iteration_time(items)

    @staticmethod
    def dummy_token(seq) -> int:
        return 3


class TimedExecutor:
    """Wraps a real executor: returns its logits and its measured time (for a VirtualClock).

    ``timer="wall"``: wall time (``perf_counter``). ``timer="thread"``: the CPU time of the calling thread
    (``thread_time``) — with one torch thread the whole forward runs on it, so this is the iteration's time on
    an idle core, immune to being descheduled by other tenants of a shared machine (which made wall-clock runs
    non-monotone in rate: docs/llm.md). Only valid with ``torch.set_num_threads(1)``."""

    def __init__(self, inner, timer: str = "wall"):
        if timer not in ("wall", "thread"):
            raise ValueError("timer must be 'wall' or 'thread'")
        self.inner = inner
        self.storage = getattr(inner, "storage", None)
        self._now = time.perf_counter if timer == "wall" else time.thread_time

    def execute(self, items, pool):
        t0 = self._now()
        logits, _ = self.inner.execute(items, pool)
        return logits, self._now() - t0


@dataclass
class RequestRecord:
    arrival: float
    prompt_len: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_output(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else float("inf")

    @property
    def tbts(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class TraceResult:
    requests: list[RequestRecord]
    duration: float
    iterations: int
    stats: dict


class SchedulerStalled(RuntimeError):
    """``run_trace``: the policy scheduled nothing for ``max_stall_s`` of virtual time with no arrival left."""


def run_trace(engine: LLMEngine, trace, clock: VirtualClock, *, progress=None, idle_tick: float = 0.01,
              max_stall_s: float = 600.0) -> TraceResult:
    """Feed ``trace`` (items with arrival, prompt_len, output_len) to ``engine`` on ``clock``; run to completion.

    Prompts are synthetic token ids (3 + i mod 250); outputs run to exactly output_len (ignore EOS), as the Repo's
    client does with max_tokens = reference length.

    Termination: an iteration that schedules and preempts nothing changes no state, so time must pass. With
    nothing running the engine idles until the next arrival (the clock jumps there); with requests running
    (a time-dependent policy may be waiting for pending times to grow) the clock moves by ``idle_tick`` (never
    past the next arrival). If no arrival is left and the policy stays idle for ``max_stall_s`` of virtual time,
    ``SchedulerStalled`` is raised instead of looping forever.
    """
    engine.keep_finished = True
    records: list[RequestRecord] = []
    order = sorted(range(len(trace)), key=lambda i: trace[i].arrival)
    nxt = 0
    ids = {}
    stalled_since: float | None = None
    while nxt < len(order) or engine.has_work():
        if not engine.has_work() and clock() < trace[order[nxt]].arrival:
            clock.now = trace[order[nxt]].arrival  # idle: jump to the next arrival
        while nxt < len(order) and trace[order[nxt]].arrival <= clock():
            r = trace[order[nxt]]
            rec = RequestRecord(r.arrival, r.prompt_len, r.output_len)
            records.append(rec)
            prompt = [3 + (i % 250) for i in range(r.prompt_len)]
            sid = engine.add_request(prompt, SamplingParams(max_tokens=r.output_len, temperature=0.0,
                                                            ignore_eos=True), arrival=r.arrival)
            ids[sid] = rec
            nxt += 1
            stalled_since = None
            if progress is not None:
                progress(1)
        engine.step()
        if engine.last_step_progressed:
            stalled_since = None
            continue
        # no progress: let (virtual) time pass
        next_arrival = trace[order[nxt]].arrival if nxt < len(order) else None
        if next_arrival is not None and not engine.running:
            clock.now = max(clock.now, next_arrival)
            continue
        if stalled_since is None:
            stalled_since = clock()
        if next_arrival is None and clock() - stalled_since > max_stall_s:
            raise SchedulerStalled(
                f"scheduler {getattr(engine.scheduler, 'name', engine.scheduler)!r} made no progress for "
                f"{clock() - stalled_since:.3g} s (virtual) with {len(engine.waiting)} waiting, "
                f"{len(engine.running)} running, {engine.pool.num_free}/{engine.pool.num_blocks} blocks free "
                f"and no arrival left")
        dt = idle_tick if next_arrival is None else max(0.0, min(idle_tick, next_arrival - clock()))
        clock.advance(dt)
    for s in engine.finished:
        rec = ids[s.seq_id]
        rec.token_times = list(s.token_times)
        rec.num_preemptions = s.num_preemptions
    return TraceResult(records, clock(), engine.iterations, dict(engine.stats))


def simulate(trace, scheduler: str, cost: CostModel, *, num_blocks: int, block_size: int = 16,
             hidden_planes: int = 1, ttft_slo: float = 1.0, tbt_slo: float = 1.0, **sched_kw) -> TraceResult:
    """Run ``trace`` through the engine with the cost-model executor (no tensors)."""
    clock = VirtualClock()
    pool = BlockPool(num_blocks, block_size, kv_planes=2, hidden_planes=hidden_planes)
    sched_kw.setdefault("rho", cost.rho_h)
    pol = make_llm_scheduler(scheduler, ttft_slo=ttft_slo, tbt_slo=tbt_slo, **sched_kw)
    eng = LLMEngine(pol, pool, SimulatedExecutor(cost), clock=clock)
    return run_trace(eng, trace, clock)
