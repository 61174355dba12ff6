"""Discrete-event simulation of a multi-instance LLM cluster at GPU scale: static PD, dynamic PD, co-located.

No tensors and no engine: each instance is an iteration-level continuous-batching loop whose iteration time comes
from ``GPUCostModel`` (a roofline); requests move between instances through a KV-transfer link. The policy
decisions (split or not, prefill and decode instance, role flips) are the ones of ``cluster/llm/pd_policy.py``, the
same code the real cluster runs. ``grserve_bench/pd_sim.py`` searches arrival rates for goodput on top of this.

Cost model (``GPUCostModel``; one iteration of one instance running ``n_dec`` decodes with total context ``C`` and
prefill chunks ``(start, new)``):

    T = launch + max(memory, compute)
    memory  = (weight bytes + kv_bytes_per_token · (C + Σ (start + new))) / HBM bandwidth
    compute = (2 · params · (n_dec + Σ new) + 4 · layers · d_model · Σ new · (start + new/2)) / FLOP/s

and a KV transfer of ``L`` tokens takes ``overhead + L · kv_bytes_per_token / link bandwidth`` on the destination's
FCFS migration queue (one transfer at a time per destination, overlapped with compute, as xLLM's local scheduler).
Bandwidths and FLOP/s are effective values (a stated fraction of peak), listed in ``MODELS`` / ``GPUS``.

Instance loop (xLLM's local scheduler): every iteration runs all running decodes plus prefill chunks from the
instance's FCFS prefill queue up to a token budget: ``prefill_budget`` on a prefill-role instance (whole prompts,
batched), ``chunk_tokens`` on a decode-role instance and on every co-located instance (chunked prefill: decodes
first, the remaining budget to prefill). Decodes join the running batch at an iteration boundary once their KV
fits (``kv_capacity_tokens``: HBM left after the weights, 90 %, reserved for prompt + output at admission).

Times: TTFT = first token (end of the last prefill chunk) − arrival; TPOT = (last token − first token) /
(output − 1), so a request's TPOT includes its KV transfer and every stall of its decode instance; a request with
one output token meets any TPOT SLO.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

from grserve.cluster.llm.pd_policy import (
    InstanceSignals,
    PDCostModel,
    Role,
    RolePools,
    TPOTPredictor,
    TTFTPredictor,
    decide_flip,
    pick_decode,
    pick_prefill,
    should_split,
)
from grserve.config import PDConfig, SLOConfig

# model shapes: params, layers, d_model, kv bytes per token (2 · layers · kv_heads · head_dim · 2 bytes, fp16, MHA)
MODELS = {
    "llama2-13b": (13.0e9, 40, 5120, 2 * 40 * 5120 * 2),
    "llama2-7b": (6.7e9, 32, 4096, 2 * 32 * 4096 * 2),
}
# GPUs: effective HBM bandwidth (80 % of peak), effective fp16 FLOP/s (60 % of dense peak), HBM capacity
GPUS = {
    "a100-80gb": (0.8 * 2.039e12, 0.6 * 312e12, 80e9),
    "h100-sxm": (0.8 * 3.35e12, 0.6 * 989e12, 80e9),
}


@dataclass(frozen=True)
class GPUCostModel:
    name: str
    params: float
    layers: int
    d_model: int
    kv_bytes_per_token: int
    hbm_bytes_per_s: float
    flops: float
    hbm_bytes: float
    link_bytes_per_s: float = 25e9  # 200 Gb/s RDMA NIC per instance
    link_overhead_s: float = 0.002
    launch_s: float = 0.003  # kernel launches, sampling, scheduler per iteration

    @classmethod
    def preset(cls, model: str, gpu: str, link_gbps: float = 200.0) -> "GPUCostModel":
        p, layers, d, kv = MODELS[model]
        bw, fl, mem = GPUS[gpu]
        return cls(f"{model}@{gpu}", p, layers, d, kv, bw, fl, mem, link_bytes_per_s=link_gbps * 1e9 / 8)

    def iteration_s(self, n_dec: int, dec_ctx: int, chunks: list[tuple[int, int]]) -> float:
        kv_tokens = dec_ctx + sum(s + n for s, n in chunks)
        new = n_dec + sum(n for _, n in chunks)
        attn = sum(n * (s + n / 2) for s, n in chunks) + dec_ctx
        mem = (2 * self.params + self.kv_bytes_per_token * kv_tokens) / self.hbm_bytes_per_s
        comp = (2 * self.params * new + 4 * self.layers * self.d_model * attn) / self.flops
        return self.launch_s + max(mem, comp)

    def max_chunk_within(self, n_dec: int, dec_ctx: int, seconds: float) -> int:
        """The largest new prefill (from position 0) that, batched with these decodes, keeps ``iteration_s`` within
        ``seconds`` (0 if none): the memory bound is linear in the chunk x, the compute bound quadratic
        (``2·layers·d·x² + 2·params·x + c <= (seconds - launch)·flops``)."""
        t = seconds - self.launch_s
        x_mem = (t * self.hbm_bytes_per_s - 2 * self.params) / self.kv_bytes_per_token - dec_ctx
        a, b = 2 * self.layers * self.d_model, 2 * self.params
        c = 2 * self.params * n_dec + 4 * self.layers * self.d_model * dec_ctx - t * self.flops
        x_comp = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a) if b * b - 4 * a * c >= 0 else -1.0
        return max(0, math.floor(min(x_mem, x_comp) * (1 - 1e-12)))

    def prefill_s(self, tokens: int) -> float:
        return self.iteration_s(0, 0, [(0, tokens)])

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        mem = (2 * self.params + self.kv_bytes_per_token * ctx_tokens) / self.hbm_bytes_per_s
        comp = (2 * self.params * batch + 4 * self.layers * self.d_model * ctx_tokens) / self.flops
        return self.launch_s + max(mem, comp)

    def transfer_s(self, tokens: int) -> float:
        return self.pd_cost().transfer_s(tokens)

    def kv_capacity_tokens(self) -> int:
        return int(0.9 * (self.hbm_bytes - 2 * self.params) / self.kv_bytes_per_token)

    def pd_cost(self, at_tokens: int = 1024) -> PDCostModel:
        return PDCostModel(prefill_tokens_per_s=at_tokens / self.prefill_s(at_tokens),
                           kv_bytes_per_token=self.kv_bytes_per_token,
                           transfer_bytes_per_s=self.link_bytes_per_s, transfer_overhead_s=self.link_overhead_s)

    def profiled_ttft(self) -> TTFTPredictor:
        """The start-up profile of xllm-service: prefill time at a few lengths, fitted ``a + b·L + c·L²``."""
        t = TTFTPredictor()
        for L in (128, 512, 1024, 2048, 4096, 8192):
            t.observe(L, self.prefill_s(L))
        return t

    def profiled_tpot(self) -> TPOTPredictor:
        t = TPOTPredictor()
        for b, c in ((1, 512), (8, 4096), (32, 16384), (64, 65536), (128, 40000), (16, 60000)):
            t.observe(b, c, self.decode_step_s(b, c))
        return t


# ---------------------------------------------------------------------------------------------------- traces

@dataclass
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int
    kind: str  # "prompt_heavy" | "output_heavy"
    first: float | None = None
    finish: float | None = None
    generated: int = 0
    prefill_at: int = -1
    decode_at: int = -1

    @property
    def ttft(self) -> float:
        return math.inf if self.first is None else self.first - self.arrival

    @property
    def tpot(self) -> float:
        if self.finish is None:
            return math.inf
        return 0.0 if self.output <= 1 else (self.finish - self.first) / (self.output - 1)


@dataclass(frozen=True)
class TraceShape:
    """Two request classes (uniform lengths), a share ``h = prompt_heavy_share`` (0.5) prompt-heavy on average.

    ``stable``: Poisson arrivals at ``rate``, each request's class drawn independently.
    ``bursty``: the output-heavy requests arrive as a Poisson stream at ``rate·(1-h)``; the prompt-heavy ones only
    in bursts: the first ``burst_duty`` of every ``burst_period_s`` at ``rate·h/burst_duty``. Same mean rate and
    mix as ``stable``."""

    prompt_heavy: tuple[int, int, int, int] = (1500, 4000, 16, 64)  # prompt lo, hi, output lo, hi
    output_heavy: tuple[int, int, int, int] = (100, 400, 200, 600)
    burst_period_s: float = 30.0
    burst_duty: float = 0.25
    prompt_heavy_share: float = 0.5


def make_trace(kind: str, rate: float, duration_s: float, shape: TraceShape, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    h = shape.prompt_heavy_share
    # (class, rate while on, length of the on window of each period or None: always on)
    if kind == "stable":
        streams = [("prompt_heavy", rate * h, None), ("output_heavy", rate * (1 - h), None)]
    elif kind == "bursty":
        duty = shape.burst_duty
        streams = [("prompt_heavy", rate * h / duty, duty * shape.burst_period_s),
                   ("output_heavy", rate * (1 - h), None)]
    else:
        raise ValueError(f"unknown trace kind {kind!r}")
    arrivals = []
    for cls, lam, on_len in streams:
        u, srng = 0.0, random.Random(rng.random())
        while True:  # Poisson in "on" time u, mapped to real time (the off windows skipped)
            u += srng.expovariate(lam)
            t = u if on_len is None else (u // on_len) * shape.burst_period_s + u % on_len
            if t >= duration_s:
                break
            arrivals.append((t, cls))
    arrivals.sort()
    out = []
    for i, (t, cls) in enumerate(arrivals):
        plo, phi, olo, ohi = getattr(shape, cls)
        out.append(SimRequest(i, t, rng.randint(plo, phi), rng.randint(olo, ohi), cls))
    return out


# ---------------------------------------------------------------------------------------------------- cluster

MIN_CHUNK = 32
REF_PREFILL = 2048


@dataclass
class _Instance:
    idx: int
    prefill_q: deque = field(default_factory=deque)  # [request, tokens done]
    queued_tokens: int = 0
    joining: deque = field(default_factory=deque)  # decodes waiting for their KV to fit / the next iteration
    n_running: int = 0
    ctx_sum: int = 0
    booked_out: int = 0  # output tokens still to generate by running decodes
    kv_reserved: int = 0
    step: int = 0
    finish_at: dict = field(default_factory=dict)  # step -> [requests finishing then]
    busy: bool = False
    link_free: float = 0.0  # destination migration queue: free from this time
    decode_iters: deque = field(default_factory=deque)  # (end time, duration) of iterations with decodes
    cur_chunks: list = field(default_factory=list)
    cur_decodes: int = 0
    decode_sum: float = 0.0  # sum of the durations in decode_iters
    blocked: int = 0  # decodes left waiting for KV space at the last iteration boundary

    def signals(self, now: float, window_s: float) -> InstanceSignals:
        while self.decode_iters and self.decode_iters[0][0] < now - window_s:
            self.decode_sum -= self.decode_iters.popleft()[1]
        tp = self.decode_sum / len(self.decode_iters) if self.decode_iters else None
        return InstanceSignals(queued_prefill_tokens=self.queued_tokens, running_decode_requests=self.n_running,
                               running_decode_tokens=self.ctx_sum, recent_tpot_s=tp,
                               idle=not (self.prefill_q or self.n_running or self.joining or self.busy),
                               waiting_decode_requests=self.blocked)


@dataclass(frozen=True)
class SimSetup:
    mode: str  # "static" | "dynamic" | "colocated"
    instances: int = 4
    prefill_instances: int = 2
    prefill_budget: int = 8192
    chunk_tokens: int = 512
    monitor_interval_s: float = 0.5
    monitor_window_s: float = 2.0
    chunk_when_decoding: bool = True  # a prefill-role instance still finishing decodes prefills in chunks
    overflow_to_decode: bool = True  # dynamic: a prefill the prefill pool cannot serve in time may go to D
    slo_chunking: bool = True  # with decodes running, chunks are cut to keep the iteration inside the TPOT SLO
    slo_chunk_fraction: float = 0.9
    pd: PDConfig = PDConfig(pd=True)
    slo: SLOConfig = SLOConfig()


@dataclass
class SimResult:
    requests: list[SimRequest]
    end: float
    flips: dict
    split: int
    transferred_tokens: int
    aborted: bool
    pool_checks: int = 0
    flip_log: list = field(default_factory=list)  # (time, instance, from pool, to pool)

    def attainment(self, slo: SLOConfig) -> float:
        ok = sum(1 for r in self.requests if r.ttft <= slo.ttft_slo_s and r.tpot <= slo.tpot_slo_s)
        return ok / max(1, len(self.requests))


class ClusterSim:
    """One run: ``requests`` through ``setup.instances`` instances under ``setup.mode``. ``give_up`` (a fraction)
    stops the run once that share of requests has certainly missed an SLO (a goodput search only needs to know the
    attainment is below its threshold). ``check_pools`` asserts the pool invariants after every flip and the KV
    capacity at every iteration."""

    def __init__(self, setup: SimSetup, cost: GPUCostModel, requests: list[SimRequest],
                 give_up: float | None = None, check_pools: bool = False):
        self.s, self.cost, self.reqs = setup, cost, requests
        self.inst = [_Instance(i) for i in range(setup.instances)]
        p = setup.prefill_instances if setup.mode != "colocated" else setup.pd.min_per_role
        self.pools = RolePools(setup.instances, p, setup.pd, now=0.0)
        self.ttft, self.tpot, self.pd_cost = cost.profiled_ttft(), cost.profiled_tpot(), cost.pd_cost()
        self.cap = cost.kv_capacity_tokens()
        h = setup.pd.slo_headroom  # decisions plan against the SLOs with a margin; attainment uses the real ones
        self.plan_slo = SLOConfig(ttft_slo_s=h * setup.slo.ttft_slo_s, tpot_slo_s=h * setup.slo.tpot_slo_s)
        self.ref_per_token = cost.prefill_s(REF_PREFILL) / REF_PREFILL
        self.ev: list = []
        self.seq = 0
        self.failed = 0
        self.give_up = None if give_up is None else give_up * len(requests)
        self.check_pools, self.pool_checks = check_pools, 0
        self.split = self.transferred = 0
        self.mean_prompt, self.seen = 0.0, 0

    # -- events
    def _push(self, t: float, kind: int, data) -> None:
        self.seq += 1
        heapq.heappush(self.ev, (t, self.seq, kind, data))

    def run(self, horizon_s: float) -> SimResult:
        for r in self.reqs:
            self._push(r.arrival, 0, r)
        if self.s.mode == "dynamic":
            self._push(self.s.monitor_interval_s, 3, None)
        now, aborted = 0.0, False
        while self.ev:
            now, _, kind, data = heapq.heappop(self.ev)
            if now > horizon_s or (self.give_up is not None and self.failed > self.give_up):
                aborted = True
                break
            if kind == 0:
                self._arrive(data, now)
            elif kind == 1:
                self._iteration_end(self.inst[data], now)
            elif kind == 2:
                self._transfer_done(data, now)
            elif kind == 3:
                self._monitor(now)
        return SimResult(self.reqs, now, dict(self.pools.flips), self.split, self.transferred, aborted,
                         self.pool_checks, list(self.pools.log))

    def _signals(self, now: float) -> dict[int, InstanceSignals]:
        out = {}
        for inst in self.inst:
            sig = inst.signals(now, self.s.monitor_window_s)
            sig.prefill_slowdown = self._prefill_slowdown(inst)
            out[inst.idx] = sig
        return out

    def _prefill_slowdown(self, inst: _Instance) -> float:
        """The monitor's estimate of how much slower than profiled ``inst`` prefills now: seconds per prefill
        token of one iteration at its current budget next to its running decodes, over the profiled seconds per
        token (of ``REF_PREFILL`` tokens alone)."""
        if not inst.n_running:
            return 1.0
        budget = self._budget(inst)
        per_token = self.cost.iteration_s(inst.n_running, inst.ctx_sum, [(0, budget)]) / budget
        return max(1.0, per_token / self.ref_per_token)

    # -- routing
    def _arrive(self, r: SimRequest, now: float) -> None:
        self.seen += 1
        self.mean_prompt += (r.prompt - self.mean_prompt) / self.seen
        if self.s.mode == "colocated":
            i = min(self.inst, key=lambda x: (x.queued_tokens + x.booked_out, x.n_running, x.idx)).idx
        elif not should_split(r.prompt, self.s.pd, self.pd_cost):
            i = pick_decode(self.pools, self._signals(now), self.plan_slo, None, self.tpot, r.prompt + r.output)
        else:
            self.split += 1
            if self.s.mode == "dynamic":
                self._maybe_flip(now, r.prompt)
            i = pick_prefill(self.pools, self._signals(now), self.ttft, r.prompt, self.plan_slo,
                             allow_decode_instances=self.s.mode == "dynamic" and self.s.overflow_to_decode)
        inst = self.inst[i]
        r.prefill_at = i
        inst.prefill_q.append([r, 0])
        inst.queued_tokens += r.prompt
        self._kick(inst, now)

    def _choose_decode(self, r: SimRequest, i: int, now: float) -> int:
        if self.s.mode == "colocated":
            return i
        return pick_decode(self.pools, self._signals(now), self.plan_slo, i, self.tpot, r.prompt + r.output)

    def _maybe_flip(self, now: float, input_tokens: int) -> None:
        d = decide_flip(self.pools, self._signals(now), self.ttft, self.plan_slo, self.s.pd, now, input_tokens,
                        allow_decode_instances=self.s.overflow_to_decode)
        if d is not None:
            i, role = d
            new_role = self.pools.flip(i, now)
            assert new_role is role
            if self.check_pools:
                self._assert_pools(now)
            self._kick(self.inst[i], now)

    def _assert_pools(self, now: float) -> None:
        k = self.s.pd.min_per_role
        pr, de = self.pools.members(Role.PREFILL), self.pools.members(Role.DECODE)
        assert len(pr) >= k and len(de) >= k and sorted(pr + de) == list(range(self.s.instances))
        for i in range(self.s.instances):
            mine = [t for t, j, *_ in self.pools.log if j == i]
            assert all(b - a >= self.s.pd.min_dwell_s - 1e-9 for a, b in zip([0.0] + mine, mine))
        self.pool_checks += 1

    def _monitor(self, now: float) -> None:
        self._maybe_flip(now, int(self.mean_prompt))
        if self.ev:
            self._push(now + self.s.monitor_interval_s, 3, None)

    # -- instance loop
    def _budget(self, inst: _Instance) -> int:
        prefill_role = self.s.mode != "colocated" and self.pools.role(inst.idx) is Role.PREFILL
        if not inst.n_running:
            return self.s.prefill_budget if prefill_role else self.s.chunk_tokens
        budget = self.s.chunk_tokens if (self.s.chunk_when_decoding or not prefill_role) else self.s.prefill_budget
        if self.s.slo_chunking:
            budget = min(budget, self._slo_chunk(inst))
        return budget

    def _slo_chunk(self, inst: _Instance) -> int:
        """The largest prefill chunk that keeps this iteration (with its running decodes) within
        ``slo_chunk_fraction`` of the TPOT SLO by the cost model; at least ``MIN_CHUNK`` (progress)."""
        target = self.s.slo_chunk_fraction * self.s.slo.tpot_slo_s
        return max(MIN_CHUNK, self.cost.max_chunk_within(inst.n_running, inst.ctx_sum, target))

    def _kick(self, inst: _Instance, now: float) -> None:
        if inst.busy:
            return
        while inst.joining and inst.kv_reserved + inst.joining[0].prompt + inst.joining[0].output <= self.cap:
            r = inst.joining.popleft()
            inst.kv_reserved += r.prompt + r.output
            inst.n_running += 1
            inst.ctx_sum += r.prompt + r.generated
            left = r.output - r.generated
            inst.booked_out += left
            inst.finish_at.setdefault(inst.step + left, []).append(r)
        inst.blocked = len(inst.joining)
        if self.check_pools:
            assert 0 <= inst.kv_reserved <= self.cap, (inst.idx, inst.kv_reserved, self.cap)
        budget, chunks = (self._budget(inst) if inst.prefill_q else 0), []
        for item in inst.prefill_q:
            if budget <= 0:
                break
            r, done = item
            if done == 0 and inst.kv_reserved + r.prompt + r.output > self.cap:
                break
            if done == 0:
                inst.kv_reserved += r.prompt + r.output
            n = min(budget, r.prompt - done)
            chunks.append((item, done, n))
            budget -= n
        if not chunks and inst.n_running == 0:
            return
        inst.cur_chunks = chunks
        inst.cur_decodes = inst.n_running
        dt = (self.cost.iteration_s(inst.n_running, inst.ctx_sum, [(d, n) for _, d, n in chunks]) if chunks
              else self.cost.decode_step_s(inst.n_running, inst.ctx_sum))
        inst.busy = True
        self._push(now + dt, 1, inst.idx)
        if inst.n_running:
            inst.decode_iters.append((now + dt, dt))
            inst.decode_sum += dt

    def _iteration_end(self, inst: _Instance, now: float) -> None:
        inst.busy = False
        if inst.cur_decodes:
            inst.step += 1
            inst.ctx_sum += inst.n_running
            inst.booked_out -= inst.n_running
            for r in inst.finish_at.pop(inst.step, ()):
                r.generated = r.output
                r.finish = now
                inst.n_running -= 1
                inst.ctx_sum -= r.prompt + r.output
                inst.kv_reserved -= r.prompt + r.output
                if r.tpot > self.s.slo.tpot_slo_s and r.ttft <= self.s.slo.ttft_slo_s:
                    self.failed += 1
        for item, done, n in inst.cur_chunks:
            item[1] = done + n
            inst.queued_tokens -= n
        while inst.prefill_q and inst.prefill_q[0][1] >= inst.prefill_q[0][0].prompt:
            r = inst.prefill_q.popleft()[0]
            self._prefill_done(r, inst, now)
        self._kick(inst, now)

    def _prefill_done(self, r: SimRequest, inst: _Instance, now: float) -> None:
        r.first, r.generated = now, 1
        if r.ttft > self.s.slo.ttft_slo_s:
            self.failed += 1
        if r.output <= 1:
            r.finish = now
            inst.kv_reserved -= r.prompt + r.output
            return
        d = self._choose_decode(r, inst.idx, now)
        r.decode_at = d
        if d == inst.idx:
            inst.kv_reserved -= r.prompt + r.output  # re-reserved when it joins
            inst.joining.append(r)
            return
        dst = self.inst[d]
        start = max(now, dst.link_free)
        dst.link_free = start + self.cost.transfer_s(r.prompt)
        self.transferred += r.prompt
        self._push(dst.link_free, 2, (r, inst.idx))

    def _transfer_done(self, data, now: float) -> None:
        r, src = data
        s = self.inst[src]
        s.kv_reserved -= r.prompt + r.output
        self._kick(s, now)
        dst = self.inst[r.decode_at]
        dst.joining.append(r)
        self._kick(dst, now)


def simulate(setup: SimSetup, cost: GPUCostModel, requests: list[SimRequest], horizon_s: float,
             give_up: float | None = None, check_pools: bool = False) -> SimResult:
    for r in requests:
        r.first = r.finish = None
        r.generated, r.prefill_at, r.decode_at = 0, -1, -1
    return ClusterSim(setup, cost, requests, give_up, check_pools).run(horizon_s)
