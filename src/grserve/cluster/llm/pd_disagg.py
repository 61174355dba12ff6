"""Prefill/decode disaggregation on the real cluster (xLLM §3.2, digest §3.3): split a request, hand its KV over.

``PDCoordinator`` is the front end's part of ``serve llm --instances N --pd``. ``ClusterLLMEngine`` calls it at five
points (all under the engine's lock): a new request (``route``), a KV snapshot arriving (``on_snapshot``), the
first token (``on_first_token``), an attempt finishing (``prefill_ended``) and the request leaving
(``forget``: end, cancel, or a move off a dead instance, after which it is an ordinary request).

Per request:

1. **Split or not.** The prefill instance is ``pd_policy.pick_prefill`` over the role pools, with each instance's
   queue taken from the part-1 router cost (``Router.costs``: booked prefill tokens − cached prompt tokens +
   decode weight · booked decode tokens) and its TTFT from the ``TTFTPredictor``. The request is split when its
   prompt's uncached tokens there reach the threshold (``pd_policy.should_split``: ``--split-min-tokens``, or 0 =
   the break-even length of the cost model measured at start-up, ``measure_cost_model``), when the chosen
   instance is in the prefill role, and when its sampling has no output-dependent state (no penalties, no
   ``min_tokens`` > 1: the decode instance sees the first token as part of its prompt). Otherwise it runs whole
   on one instance: a decode-role instance by predicted TPOT (``pick_decode``), or the decode-role instance
   ``pick_prefill`` chose for slack.
2. **Prefill phase.** ``EngineInstance.submit`` runs a ``prefill_only`` attempt: its engine samples the first
   token with the request's own parameters (draws depend on (seed, position) only), hands out the prompt's K/V with
   it and pauses (``engine.types.Handover``: finish reason "pause", the text it holds back stays held back); the
   token streams to the client at once, the K/V comes back in the same poll, so the front end owns it (it outlives
   the instance) and Ray moves it.
3. **Hand-off.** When both the first token and the KV are in, the decode instance is ``pick_decode`` (measured
   recent token interval per instance, lightest first); the request's next attempt (the first token delivered,
   the KV snapshot) goes there: its engine loads the K/V into the request's blocks at admission, computes only the
   first token's row and continues the text where the prefill attempt left it. KV bytes moved are counted
   (= Σ 2 · layers · tokens · kv_heads · head_dim · dtype bytes over the moved tokens). ``TokenStream`` keeps
   each output position exactly once across the two attempts.

A cancel in either phase cancels the attempt where it runs; between the phases there is no attempt anywhere and
the snapshot is dropped with the record. A dead instance's requests move exactly as without PD
(``cluster/core/recovery.py``): recomputed or migrated with the snapshot the front end holds.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from grserve.cluster.llm.pd_policy import (
    InstanceSignals,
    PDCostModel,
    Role,
    RolePools,
    TTFTPredictor,
    pick_decode,
    pick_prefill,
    should_split,
)
from grserve.cluster.wire import Attempt

if TYPE_CHECKING:
    from collections.abc import Callable

    from ray.actor import ActorHandle

    from grserve.cluster.core.front_end import Instance
    from grserve.cluster.core.router import Router
    from grserve.cluster.llm.instance import EngineInstance
    from grserve.cluster.llm.journal import RequestRecord
    from grserve.config import ClusterConfig, PDConfig, SLOConfig
    from grserve.engine.protocol import RequestHandle
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMResult

log = logging.getLogger("grserve.cluster")
DEAD_QUEUE = 2 ** 40  # a dead instance's queued tokens in the signals: never the best choice


@dataclass
class PDRequest:
    phase: str  # "prefill" (split, on its prefill instance), "handoff" (first token in, waiting for KV),
    #             "decode" (on its decode instance), "whole" (not split)
    instance: int
    uncached: int
    max_tokens: int
    queued_before: int  # booked prefill tokens on the instance when it was routed (0: an uncontended TTFT)


class PDFrontEnd(Protocol):
    """What the coordinator reads of the front end (``front_end.ClusterLLMEngine``): its instances and router;
    ``attach_pd`` sets its ``pd``."""

    instances: list[Instance]
    router: Router
    pd: PDCoordinator | None


class PDMonitor(Protocol):
    """What the front end drives of the role monitor (``pd_roles.RoleMonitor``): ``tick`` after each poll; ``log``:
    every flip."""

    log: list[dict]

    def tick(self, now: float | None = None) -> tuple[int, Role] | None: ...


class PDCoordinator:
    def __init__(self, engine: PDFrontEnd, cfg: PDConfig, slo: SLOConfig, cost: PDCostModel,
                 ttft: TTFTPredictor):
        self.engine, self.cfg, self.slo, self.cost, self.ttft = engine, cfg, slo, cost, ttft
        self.pools = RolePools(len(engine.instances), cfg.prefill_instances, cfg, time.monotonic())
        self.threshold = cfg.split_min_tokens if cfg.split_min_tokens > 0 else cost.break_even_tokens()
        self.reqs: dict[str, PDRequest] = {}
        self.counters = {"splits": 0, "whole": 0, "handoffs": 0, "stayed": 0, "kv_bytes_moved": 0,
                         "kv_tokens_moved": 0}
        self.moves: deque = deque(maxlen=100_000)  # (request id, from, to, tokens, bytes) of recent hand-offs
        self.hold_handoff = False  # tests: keep split requests between their phases
        self.recent_input = 0  # uncached tokens of the latest split request (the flip rule's TTFT probe) …
        self.recent_input_at = 0.0  # … and when it was routed (monotonic)
        self.monitor: PDMonitor | None = None
        self.measured_s = 0.0  # seconds the start-up cost model measurement took

    # ---- signals ------------------------------------------------------------------------------------------
    def signals(self, queue: dict[int, float] | None = None) -> dict[int, InstanceSignals]:
        """What the front end knows of every instance: booked prefill tokens (or ``queue``), booked decode
        requests and tokens, the recent token interval the instance measured (its poll's stats)."""
        r = self.engine.router
        dec = r.decode_requests()
        out = {}
        for inst in self.engine.instances:
            i = inst.index
            if not inst.up:
                out[i] = InstanceSignals(DEAD_QUEUE, 0, 0, None, False)
                continue
            ld = r.load[i]
            q = int(max(0.0, queue[i])) if queue is not None and i in queue else ld.prefill_tokens
            st = inst.stats
            busy = ld.prefill_tokens > 0 or dec[i] > 0 or st.get("running", 0) or st.get("waiting", 0)
            # resource shortage: requests wait while under 5 % of the KV blocks are free
            short = int(st.get("waiting", 0)) if 20 * st.get("free_blocks", 1) < st.get("total_blocks", 0) else 0
            out[i] = InstanceSignals(q, dec[i], ld.decode_tokens, st.get("token_interval_s"), not busy, short)
        return out

    def ttft_probe(self, now: float) -> int:
        """The prompt length the flip rule's TTFT check is made for: the latest split request's uncached tokens
        while one was routed within the last TTFT SLO, else 0 (no long prompt arriving: only the queued tokens
        count — a stale probe would hold a TTFT "break" that blocks every P->D flip)."""
        return self.recent_input if now - self.recent_input_at <= self.slo.ttft_slo_s else 0

    def plan_slo(self) -> SLOConfig:
        """The SLOs the decisions plan against: ``--ttft-slo-s`` / ``--tpot-slo-s`` × ``PDConfig.slo_headroom``
        (pd_policy's margin for prediction error; 1 where the config has none)."""
        h = getattr(self.cfg, "slo_headroom", 1.0)
        return replace(self.slo, ttft_slo_s=self.slo.ttft_slo_s * h, tpot_slo_s=self.slo.tpot_slo_s * h)

    def _live(self, role: Role) -> list[int]:
        return [i for i in self.pools.members(role) if self.engine.instances[i].up]

    # ---- a new request -----------------------------------------------------------------------------------
    def route(self, rec: RequestRecord, attempt: Attempt) -> bool:
        """Place a new request (split or whole); False: leave it to the router (a role has no live instance)."""
        if not self._live(Role.PREFILL) or not self._live(Role.DECODE):
            return False
        n, params = len(attempt.tokens), attempt.params
        costs = self.engine.router.costs(attempt)  # {live i: (part-1 cost, cached tokens)}
        sig = self.signals({i: c - n for i, (c, _) in costs.items()})
        p = pick_prefill(self.pools, sig, self.ttft, n, self.plan_slo())
        uncached = max(1, n - costs.get(p, (0, 0))[1])
        if self.pools.role(p) is Role.PREFILL and self.engine.instances[p].up and splittable(params) \
                and should_split(uncached, self.cfg, self.cost):
            self._submit(rec, p, "prefill", uncached, 1)
            self.counters["splits"] += 1
            self.recent_input, self.recent_input_at = uncached, time.monotonic()
            return True
        if self.pools.role(p) is not Role.DECODE or not self.engine.instances[p].up:
            p = pick_decode(self.pools, self.signals(), self.plan_slo(), p)
            if not self.engine.instances[p].up:
                return False
            uncached = max(1, n - costs.get(p, (0, 0))[1])
        self._submit(rec, p, "whole", uncached, attempt.max_new_tokens)
        self.counters["whole"] += 1
        return True

    def _submit(self, rec: RequestRecord, i: int, phase: str, uncached: int, decode: int,
                snapshot: torch.Tensor | None = None) -> None:
        """Book ``uncached`` prefill and ``decode`` tokens on instance ``i`` and send it ``rec``'s next attempt (a
        prefill attempt: one token, then a pause)."""
        r = self.engine.router
        queued = r.load[i].prefill_tokens
        r.book(rec.request_id, i, uncached, decode)
        self.reqs[rec.request_id] = PDRequest(phase, i, uncached, rec.params.max_tokens, queued)
        rec.instance = i
        self.engine.instances[i].actor.submit.remote(rec.next_attempt(snapshot, prefill_only=phase == "prefill"))

    # ---- hooks from the poll ----------------------------------------------------------------------------------
    def on_first_token(self, rec: RequestRecord) -> None:
        """The first token of a split request that found its prefill instance's queue empty teaches the TTFT
        predictor (front end TTFT of its uncached tokens). Whole requests do not: they prefill beside decodes."""
        pr = self.reqs.get(rec.request_id)
        if pr is not None and pr.phase == "prefill" and pr.queued_before == 0:
            self.ttft.observe(pr.uncached, rec.first_token_at - rec.submitted_at)

    def prefill_ended(self, rec: RequestRecord) -> bool:
        """The attempt on the prefill instance paused after its first token: True when the request goes on (to its
        decode phase). A request that ended there (a stop, its last token) never pauses."""
        pr = self.reqs.get(rec.request_id)
        if pr is None or pr.phase != "prefill":
            return False
        pr.phase = "handoff"
        return True

    def on_snapshot(self, rec: RequestRecord) -> None:
        self.try_handoff(rec)

    def try_handoff(self, rec: RequestRecord) -> None:
        pr = self.reqs.get(rec.request_id)
        if pr is None or pr.phase != "handoff" or rec.snapshot is None or self.hold_handoff:
            return
        sig = self.signals()
        d = pick_decode(self.pools, sig, self.plan_slo(), pr.instance)
        if not self.engine.instances[d].up:
            live = self._live(Role.DECODE) or self.engine.router.live()
            if not live:
                return  # nothing to hand to: the prefill instance's death (or the stop) ends it
            d = min(live, key=lambda i: (sig[i].running_decode_tokens, i))
        n, decode = rec.resume_tokens, rec.params.max_tokens - rec.delivered
        self.engine.router.release(rec.request_id)
        rec.stream.new_attempt()
        if d == pr.instance:  # it decodes where it prefilled (now a decode-role instance): its prefix cache has it
            self.counters["stayed"] += 1
            self._submit(rec, d, "decode", 1, decode)
            return
        m = min(int(rec.snapshot.shape[2]), n - 1)
        snap = rec.snapshot[:, :, :m]
        nbytes = snap.numel() * snap.element_size()
        self.counters["handoffs"] += 1
        self.counters["kv_tokens_moved"] += m
        self.counters["kv_bytes_moved"] += nbytes
        self.moves.append((rec.request_id, pr.instance, d, m, nbytes))
        self._submit(rec, d, "decode", n - m, decode, snap)

    def forget(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)

    # ---- state ----------------------------------------------------------------------------------------------
    def phase(self, request_id: str) -> str | None:
        pr = self.reqs.get(request_id)
        return None if pr is None else pr.phase

    def stats(self) -> dict[str, float]:
        out = {f"cluster_pd_{k}": float(v) for k, v in self.counters.items()}
        out["cluster_pd_flips_p_to_d"] = float(self.pools.flips["p_to_d"])
        out["cluster_pd_flips_d_to_p"] = float(self.pools.flips["d_to_p"])
        out["cluster_pd_split_min_tokens"] = float(self.threshold)
        return out

    def describe(self) -> str:
        c = self.cost
        roles = ", ".join(f"{i}:{self.pools.pool(i)}" for i in range(self.pools.n))
        split = "--split-min-tokens" if self.cfg.split_min_tokens else "break-even"
        headroom = getattr(self.cfg, "slo_headroom", 1.0)
        return (f"PD: pools {roles}; cost model prefill {c.prefill_tokens_per_s:.0f} tokens/s, KV "
                f"{c.kv_bytes_per_token} B/token, transfer {c.transfer_bytes_per_s / 1e6:.0f} MB/s + "
                f"{c.transfer_overhead_s * 1e3:.1f} ms (measured in {self.measured_s:.1f} s) -> split at >= "
                f"{self.threshold} uncached tokens ({split}); SLO TTFT {self.slo.ttft_slo_s}s TPOT "
                f"{self.slo.tpot_slo_s}s (x {headroom} headroom); flips {'on' if self.cfg.role_flips else 'off'}"
                f", dwell {self.cfg.min_dwell_s}s, >= {self.cfg.min_per_role} per role")


class QueueTTFTPredictor(TTFTPredictor):
    """``pd_policy.TTFTPredictor`` whose queueing delay is the queued tokens over the measured prefill throughput R
    (start-up cost model) instead of the fit's linear term: with the quadratic term free, the online fit's linear
    coefficient can go negative (seen on this VM: b = −5.9e-5 s/token, c = 2.0e-7 s/token², a fine fit of prefill
    time up to 1536 tokens), and ``max(0, b) · queued`` then ignores every queue. Prefill time of the request itself
    stays the fitted ``a + b·L + c·L²``."""

    def __init__(self, tokens_per_s: float, **prior: float):
        super().__init__(**prior)
        self.tokens_per_s = tokens_per_s

    def predict(self, queued_prefill_tokens: int, input_tokens: int) -> float:
        return queued_prefill_tokens / self.tokens_per_s + self.prefill_s(input_tokens)


def splittable(params: SamplingParams) -> bool:
    """Sampling whose next token depends only on (prompt + tokens so far, seed, position): the decode instance
    sees the first token as prompt, so output-only penalties and ``min_tokens`` would change its draws."""
    return (params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
            and params.min_tokens <= 1 and params.logprobs is None)


# ---- start-up: the measured cost model ---------------------------------------------------------------------------
def _profile_prefill(inst: EngineInstance, lengths: list[int], seed: int) -> list[float]:
    """On an instance: seconds of a ``max_tokens = 1`` request per prompt length (random, uncached tokens)."""
    import numpy as np

    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    rng = np.random.default_rng(seed)
    vocab = inst.engine.model.spec.vocab_size
    out = []
    for n in lengths:
        prompt = rng.integers(3, vocab, n).tolist()
        t0 = time.perf_counter()
        inst.engine.submit(LLMRequest(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
                           ).future.result()
        out.append(time.perf_counter() - t0)
    return out


_PROBE_KV: dict[int, torch.Tensor] = {}  # on an instance: the K/V of the last ``_prefill_random`` of n tokens


def _prefill_random(inst: EngineInstance, n: int, seed: int) -> int:
    """On an instance: prefill ``n`` + 1 random tokens, keeping the K/V of the first ``n`` that its engine hands
    out as it would for a hand-off (``Handover.export_kv``). Returns ``n``."""
    import asyncio

    import numpy as np

    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import Handover, LLMRequest

    async def first_kv(handle: RequestHandle[LLMResult]) -> torch.Tensor | None:
        kv = None
        async for ev in handle.events():
            kv = ev.prompt_kv if ev.prompt_kv is not None else kv
        return kv

    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, inst.engine.model.spec.vocab_size, n + 1).tolist()
    h = inst.engine.submit(LLMRequest(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                                      handover=Handover(export_kv=True)))
    kv = asyncio.run(first_kv(h))
    assert kv is not None
    _PROBE_KV[n] = kv[:, :, :n]
    return n


def _export_kv(inst: EngineInstance, n: int) -> torch.Tensor:
    """On an instance: the K/V of the last ``n``-token probe, copied out (as the engine's export copies rows)."""
    return _PROBE_KV[n].clone()


def _load_kv(inst: EngineInstance, kv: torch.Tensor) -> int:
    """On an instance: write K/V that came from another into memory (as admission writes it into blocks)."""
    torch.empty_like(kv).copy_(kv)
    return int(kv.shape[2])


def engine_stats(inst: EngineInstance) -> dict[str, float]:
    """On an instance: its engine's stats now (tests, the bench: free blocks)."""
    return inst.engine.stats()


def measure_cost_model(instances: list[ActorHandle], lengths: tuple[int, ...] = (32, 256, 1024),
                       repeats: int = 2) -> tuple[PDCostModel, list[tuple[int, float]]]:
    """Measure the split's cost model on the live instances (the first two actors):

    - prefill tokens/s of one instance: the slope of the fastest of ``repeats`` runs of prompts of ``lengths``
      tokens (the fixed per-request cost drops out of the slope; the samples also seed the TTFT predictor);
    - KV transfer: export ``lengths[-1]`` tokens' K/V on instance A (returned to the front end, as a hand-off
      does), then write it into memory on instance B; and the same for 16 tokens. Bytes/s = the extra bytes
      over the extra seconds, the fixed overhead = the 16-token round trip (fastest of ``repeats`` + 1; when the
      big trip is not slower than the small one — load noise — B is taken as 10 GB/s: the threshold is then o·R).
    Returns the model and the (tokens, seconds) prefill samples."""
    import ray

    a, b = instances[0], instances[min(1, len(instances) - 1)]
    times = [ray.get(a.call.remote(_profile_prefill, list(lengths), 1000 + k)) for k in range(repeats)]
    best = [min(t[j] for t in times) for j in range(len(lengths))]
    slope = (best[-1] - best[0]) / max(1, lengths[-1] - lengths[0])
    rate = 1.0 / slope if slope > 0 else lengths[-1] / best[-1]
    trips: dict[int, list[float]] = {16: [], lengths[-1]: []}
    kv_bytes = {}
    for k in range(repeats + 1):  # one more: the transfer's two round trips are the noisiest part
        for n in trips:
            ray.get(a.call.remote(_prefill_random, n, 2000 + 10 * k + n))
            t0 = time.perf_counter()
            kv = ray.get(a.call.remote(_export_kv, n))
            ray.get(b.call.remote(_load_kv, kv))
            trips[n].append(time.perf_counter() - t0)
            kv_bytes[n] = kv.numel() * kv.element_size()
    small, big = min(trips[16]), min(trips[lengths[-1]])
    per_token = kv_bytes[lengths[-1]] // lengths[-1]
    extra = kv_bytes[lengths[-1]] - kv_bytes[16]
    bw = extra / (big - small) if big > small else 1e10
    cost = PDCostModel(prefill_tokens_per_s=rate, kv_bytes_per_token=int(per_token), transfer_bytes_per_s=bw,
                       transfer_overhead_s=small)
    return cost, list(zip(lengths, best))


def attach_pd(engine: PDFrontEnd, cfg: PDConfig, slo: SLOConfig,
              monitor: Callable[[PDCoordinator], PDMonitor]) -> PDCoordinator:
    """Measure the cost model, build the coordinator and its role monitor (``monitor``: ``pd_roles.RoleMonitor``),
    and hook them into ``engine``."""
    live = [inst.actor for inst in engine.instances if inst.up]
    t0 = time.perf_counter()
    cost, samples = measure_cost_model(live)
    measured_s = time.perf_counter() - t0
    a = min(t for _, t in samples)
    ttft = QueueTTFTPredictor(cost.prefill_tokens_per_s, a=a * 0.5, b=1.0 / cost.prefill_tokens_per_s)
    for n, t in samples:
        ttft.observe(n, t)
    coord = PDCoordinator(engine, cfg, slo, cost, ttft)
    coord.measured_s = measured_s
    coord.monitor = monitor(coord)
    engine.pd = coord
    return coord


def check_pd(cfg: PDConfig, cluster: ClusterConfig, prefix_cache_tokens: int) -> None:
    """Refuse a PD set-up that cannot work (before any actor starts)."""
    if cluster.instances < 2:
        raise ValueError("--pd needs --instances >= 2")
    k = cfg.min_per_role
    if not k <= cfg.prefill_instances <= cluster.instances - k:
        raise ValueError(f"--prefill-instances {cfg.prefill_instances} of {cluster.instances} instances leaves a "
                         f"role with fewer than --min-per-role {k}")
    if prefix_cache_tokens <= 0 or not cluster.kv_snapshot:
        raise ValueError("--pd hands each prompt's KV over at the end of its prefill and reuses cached prefixes: it "
                         "needs --prefix-cache-tokens > 0 and --kv-snapshot")
