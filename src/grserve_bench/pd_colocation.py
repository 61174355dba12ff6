"""Part 'colocation' of ``grserve bench pd`` (bench/pd.py): online/offline co-location in one process.

A tiny preset model (seeded random weights) on CPU, one engine, the co-location policy layer
(``scheduler/colocation.py``) around ``--coloc-scheduler``. Time is virtual: the clock advances by each
iteration's measured time (``TimedExecutor``, thread CPU time by default — on a shared machine that is what the
iteration costs on an idle core, not how long other tenants kept the core) and requests arrive on that clock.

1. **capacity**: the online workload's requests all at t=0, online only: capacity = requests / makespan (req/s);
2. **calibration**: online-only Poisson arrivals at ``--coloc-load`` × capacity (fixed seed); its P90 TPOT ×
   ``--coloc-slo-factor`` becomes the online TPOT SLO the offline admission keeps (the operator's SLO: "what
   online traffic gets today");
3. ``--coloc-reps`` rounds of three runs — **online-only** (that trace), **offline-only** (a backlog of requests
   at t=0 run as plain work: the policy alone, at its best for throughput), **co-located** (the same trace + the
   same backlog as offline requests) — run **in lockstep**: one iteration at a time, always of the run whose
   virtual clock is furthest behind, so a slow period of the shared machine falls on the same stretch of virtual
   time in all three. Offline output is counted over W, the online-only run's makespan. Online TTFT / TPOT P90
   are over the pooled requests of every round; the per-round ratios are printed and returned.

Keys: ``online_ttft_p90_ratio``, ``online_tpot_p90_ratio`` (co-located / online-only; target ≤ 1.15),
``offline_throughput_share`` (offline tokens/s co-located / offline alone; target ≥ 0.30), and the absolute numbers.
"""

from __future__ import annotations

import dataclasses as dc
import sys
import time
from dataclasses import dataclass

from grserve.flags import Checked, fraction, flag, non_negative, positive, positive_int


@dataclass(frozen=True)
class PartConfig(Checked):
    """The flags of part 'colocation'."""

    coloc_model: str = flag("tiny", "preset (seeded random weights) or HF dir", metavar="PRESET_OR_DIR")
    coloc_scheduler: str = flag("chunked", "the policy inside the co-location layer", choices=("chunked", "fcfs"))
    coloc_online_requests: int = flag(40, "online requests per run", check=positive_int)
    coloc_offline_requests: int = flag(256, "offline backlog (more than a run can finish)", check=positive_int)
    coloc_load: float = flag(0.6, "online arrival rate as a fraction of the measured capacity", check=fraction)
    coloc_slo_factor: float = flag(1.0, "online TPOT SLO = this x the P90 TPOT of the online-only calibration run",
                                   check=positive)
    coloc_max_offline_preemptions: int = flag(3, "bound on preemptions of one offline request", check=non_negative)
    coloc_reps: int = flag(2, "rounds of (online-only, offline-only, co-located)", check=positive_int)
    coloc_max_num_seqs: int = flag(32, "running requests at most", check=positive_int)
    coloc_token_budget: int = flag(512, "chunked: tokens per iteration; fcfs: max batched tokens", check=positive_int)
    coloc_num_blocks: int = flag(4096, "blocks in the pool (16 tokens each)", check=positive_int)
    coloc_timer: str = flag("thread", "iteration time: engine-thread CPU time (thread) or wall time (wall)",
                            choices=("thread", "wall"))
    coloc_seed: int = flag(0, "seed of the weights, the lengths and the arrivals", check=non_negative)


@dataclass
class _Req:
    arrival: float
    prompt: list[int]
    max_tokens: int
    priority: str
    tag: str = ""  # "offline": a backlog request (counted as offline output even when run as plain work)
    seq_id: int = -1
    times: list[float] | None = None


def _workload(n: int, prio: str, rate: float | None, seed: int, lens: tuple[int, int, int, int]) -> list[_Req]:
    """n requests with uniform prompt / output lengths; Poisson arrivals at ``rate`` (None: all at t=0)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    p = rng.integers(lens[0], lens[1] + 1, n)
    o = rng.integers(lens[2], lens[3] + 1, n)
    t = np.cumsum(rng.exponential(1.0 / rate, n)) if rate else np.zeros(n)
    return [_Req(float(t[i]), [3 + (i * 31 + j * 7) % 500 for j in range(int(p[i]))], int(o[i]), prio, prio)
            for i in range(n)]


ONLINE_LENS = (32, 160, 16, 48)  # prompt lo, hi, output lo, hi
OFFLINE_LENS = (64, 256, 32, 96)


class _Sim:
    """One run on a fresh engine with its own virtual clock, advanced one iteration at a time (``advance``), so
    that several runs can be stepped in lockstep. The step latency model is shared by every run (a serving
    process keeps its fitted model)."""

    def __init__(self, model, cfg: PartConfig, latency_model, slo: float, reqs: list[_Req]):
        from grserve_bench.simulator import TimedExecutor, VirtualClock
        from grserve.engine.llm import LLMEngine, build_model_engine
        from grserve.scheduler.colocation import ColocationScheduler
        from grserve.scheduler.llm_factory import make_llm_scheduler

        inner = make_llm_scheduler(cfg.coloc_scheduler, token_budget=cfg.coloc_token_budget,
                                   max_num_batched_tokens=cfg.coloc_token_budget,
                                   max_num_seqs=cfg.coloc_max_num_seqs)
        self.pol = ColocationScheduler(inner, tpot_slo_s=slo, model=latency_model,
                                       max_offline_preemptions=cfg.coloc_max_offline_preemptions)
        real = build_model_engine(model, self.pol, num_blocks=cfg.coloc_num_blocks, block_size=16)
        self.clock = VirtualClock()
        self.eng = LLMEngine(self.pol, real.pool, TimedExecutor(real.executor, cfg.coloc_timer), clock=self.clock)
        self.eng.keep_finished = True
        self.reqs = sorted((dc.replace(r) for r in reqs), key=lambda r: r.arrival)
        self.by_id: dict[int, _Req] = {}
        self.online_left = sum(r.tag == "online" for r in self.reqs)
        self.nxt = 0

    def done(self, horizon: float | None) -> bool:
        """Every online request finished, and the horizon reached (None: no work and no arrival left)."""
        if self.online_left:
            return False
        if horizon is not None and self.clock() >= horizon:
            return True
        return not self.eng.has_work() and self.nxt >= len(self.reqs)

    def advance(self) -> None:
        from grserve.engine.sampling import SamplingParams

        eng, clock, reqs = self.eng, self.clock, self.reqs
        while self.nxt < len(reqs) and reqs[self.nxt].arrival <= clock():
            r = reqs[self.nxt]
            r.seq_id = eng.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                ignore_eos=True),
                                       arrival=r.arrival, priority=r.priority)
            self.by_id[r.seq_id] = r
            self.nxt += 1
        if not eng.has_work():
            if self.nxt < len(reqs):
                clock.now = max(clock.now, reqs[self.nxt].arrival)
            return
        eng.step()
        if not eng.last_step_progressed:
            nxt = reqs[self.nxt].arrival if self.nxt < len(reqs) else float("inf")
            clock.now = min(clock.now + 0.001, max(clock.now, nxt))
        while eng.finished:
            seq = eng.finished.pop()
            r = self.by_id[seq.seq_id]
            r.times = list(seq.token_times)
            self.online_left -= r.tag == "online"

    def result(self) -> dict:
        for seq_id, r in self.by_id.items():  # unfinished requests: their tokens so far
            seq = self.eng.seqs.get(seq_id)
            if seq is not None:
                r.times = list(seq.token_times)
        return {"reqs": list(self.by_id.values()), "end": self.clock(), "stats": dict(self.eng.stats),
                "pol": dict(self.pol.stats),
                "coef": None if self.pol.model.coef is None else [float(c) for c in self.pol.model.coef]}


def _lockstep(sims: list[_Sim], window_of: int | None = None) -> tuple[list[dict], float | None]:
    """Step the runs together — always the one whose virtual clock is furthest behind — so that a slow period
    of the shared machine falls on the same stretch of virtual time in each. ``window_of``: the run whose
    online makespan W is every other run's horizon. Returns the results and W."""
    w = None
    while True:
        live = [s for s in sims if not s.done(w)]
        if not live:
            break
        min(live, key=lambda s: s.clock()).advance()
        if window_of is not None and w is None and sims[window_of].done(None):
            w = _online(sims[window_of].result())[2]
    return [s.result() for s in sims], w


def _run(model, cfg: PartConfig, latency_model, slo: float, reqs: list[_Req]) -> dict:
    return _lockstep([_Sim(model, cfg, latency_model, slo, reqs)])[0][0]


def _online(run: dict) -> tuple[list[float], list[float], float]:
    """TTFTs, TPOTs of the online requests, and the time the last one finished."""
    ttft, tpot, end = [], [], 0.0
    for r in run["reqs"]:
        if r.tag != "online" or not r.times:
            continue
        ttft.append(r.times[0] - r.arrival)
        if len(r.times) > 1:
            tpot.append((r.times[-1] - r.times[0]) / (len(r.times) - 1))
        end = max(end, r.times[-1])
    return ttft, tpot, end


def _offline_tokens(run: dict, until: float) -> int:
    return sum(sum(t <= until for t in (r.times or [])) for r in run["reqs"] if r.tag == "offline")


def _p90(xs: list[float]) -> float:
    import numpy as np

    return float(np.percentile(xs, 90)) if xs else float("nan")


def run_part(cfg: PartConfig) -> dict:
    """Run this part; return its keys for the JSON line."""
    import torch

    from grserve.model import load_model

    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread: thread CPU time is then the iteration's whole cost
    try:
        from grserve.scheduler.step_latency import StepLatencyModel

        model = load_model(cfg.coloc_model, seed=cfg.coloc_seed)
        lm = StepLatencyModel()  # learns from every step of every run
        n_on, seed = cfg.coloc_online_requests, cfg.coloc_seed
        log = lambda msg: print(f"[colocation {time.perf_counter() - t_start:5.1f}s] {msg}", file=sys.stderr)  # noqa: E731
        _run(model, cfg, lm, 1.0, _workload(4, "online", None, seed + 99, ONLINE_LENS))  # warm-up
        cap_run = _run(model, cfg, lm, 1.0, _workload(n_on, "online", None, seed, ONLINE_LENS))
        capacity = n_on / _online(cap_run)[2]
        rate = cfg.coloc_load * capacity
        online = _workload(n_on, "online", rate, seed + 1, ONLINE_LENS)
        offline = _workload(cfg.coloc_offline_requests, "offline", None, seed + 2, OFFLINE_LENS)
        calib = _online(_run(model, cfg, lm, 1.0, online))
        slo = cfg.coloc_slo_factor * _p90(calib[1])
        log(f"capacity {capacity:.1f} req/s, online rate {rate:.1f} req/s, TPOT SLO {slo * 1e3:.1f} ms")
        pooled = {"on": ([], []), "co": ([], [])}
        tokens = {"off": 0, "co": 0}
        window_total, rounds = 0.0, []
        stats = {"offline_preemptions": 0, "offline_deferred": 0, "offline_victims": 0}
        coef = None
        for rep in range(cfg.coloc_reps):
            # online alone; offline alone (the backlog as plain work: the policy inside, no co-location rule);
            # co-located — stepped in lockstep, offline output of both counted over W (online alone's makespan)
            (a, b, c), w = _lockstep([_Sim(model, cfg, lm, slo, online),
                                      _Sim(model, cfg, lm, slo, [dc.replace(r, priority="online") for r in offline]),
                                      _Sim(model, cfg, lm, slo, online + offline)], window_of=0)
            ttft_a, tpot_a, _ = _online(a)
            ttft_c, tpot_c, _ = _online(c)
            tok_b, tok_c = _offline_tokens(b, w), _offline_tokens(c, w)
            for k, (t1, t2) in (("on", (ttft_a, tpot_a)), ("co", (ttft_c, tpot_c))):
                pooled[k][0].extend(t1)
                pooled[k][1].extend(t2)
            tokens["off"] += tok_b
            tokens["co"] += tok_c
            window_total += w
            stats["offline_preemptions"] += c["stats"]["offline_preemptions"]
            stats["offline_deferred"] += c["pol"]["offline_deferred"]
            stats["offline_victims"] += c["pol"]["offline_victims"]
            coef = c["coef"]
            rnd = {"ttft_p90_ratio": _p90(ttft_c) / _p90(ttft_a), "tpot_p90_ratio": _p90(tpot_c) / _p90(tpot_a),
                   "offline_share": tok_c / max(1, tok_b), "window_s": w}
            rounds.append(rnd)
            log(f"round {rep}: " + ", ".join(f"{k} {v:.3f}" for k, v in rnd.items()))
        (on_ttft, on_tpot), (co_ttft, co_tpot) = pooled["on"], pooled["co"]
        out = {
            "online_ttft_p90_ratio": _p90(co_ttft) / _p90(on_ttft),
            "online_tpot_p90_ratio": _p90(co_tpot) / _p90(on_tpot),
            "offline_throughput_share": tokens["co"] / max(1, tokens["off"]),
            "coloc_online_ttft_p90_s": {"online_only": _p90(on_ttft), "colocated": _p90(co_ttft)},
            "coloc_online_tpot_p90_s": {"online_only": _p90(on_tpot), "colocated": _p90(co_tpot)},
            "coloc_offline_tokens_per_s": {"offline_only": tokens["off"] / window_total,
                                           "colocated": tokens["co"] / window_total},
            "coloc_capacity_req_s": capacity, "coloc_online_rate_req_s": rate, "coloc_tpot_slo_s": slo,
            "coloc_rounds": rounds, **{f"coloc_{k}": v for k, v in stats.items()},
            "coloc_latency_model_coef": coef, "coloc_scheduler": cfg.coloc_scheduler, "coloc_model": cfg.coloc_model,
            "coloc_timer": cfg.coloc_timer, "coloc_wall_s": time.perf_counter() - t_start,
        }
        log(f"TTFT p90 ratio {out['online_ttft_p90_ratio']:.3f}, TPOT p90 ratio {out['online_tpot_p90_ratio']:.3f}, "
            f"offline share {out['offline_throughput_share']:.3f}")
        return out
    finally:
        torch.set_num_threads(threads)
