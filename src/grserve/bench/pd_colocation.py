"""Part 'colocation' of ``grserve bench pd`` (bench/pd.py): online/offline co-location in one process.

A tiny preset model (seeded random weights) on CPU, one engine, the co-location policy layer
(``scheduler/colocation.py``) around ``--coloc-scheduler``. Time is virtual: the clock advances by each
iteration's measured time (``TimedExecutor``, thread CPU time by default — on a shared machine that is what the
iteration costs on an idle core, not how long other tenants kept the core) and requests arrive on that clock.

1. **capacity**: the online workload's requests all at t=0, online only: capacity = requests / makespan (req/s);
2. ``--coloc-reps`` rounds, each running three runs back to back — **online-only** (Poisson arrivals at
   ``--coloc-load`` × capacity, fixed seed), **offline-only** (a backlog of requests at t=0 run as plain work — the
   policy alone, at its best for throughput — measured over the online-only run's makespan W), **co-located**
   (the same online trace + the same backlog as offline requests; offline output counted over the same W) — so
   that drift of the shared machine hits the three alike. The online TPOT SLO the offline admission keeps is
   round 0's online-only P90 TPOT × ``--coloc-slo-factor`` (the operator's SLO: "what online sees today"). Online
   TTFT / TPOT P90 are over the pooled requests of every round; the per-round ratios are printed and returned.

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
    coloc_slo_factor: float = flag(1.0, "online TPOT SLO = this x the P90 TPOT of round 0's online-only run",
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


def _run(model, cfg: PartConfig, latency_model, slo: float, reqs: list[_Req], *,
         horizon: float | None = None) -> dict:
    """Run ``reqs`` (copies) on a fresh engine until every online request is done, and at least to ``horizon``
    when offline requests remain (or until all are done without online ones and without a horizon). The step
    latency model is shared by every run (a serving process keeps its fitted model)."""
    from grserve.bench.simulator import TimedExecutor, VirtualClock
    from grserve.engine.llm import LLMEngine, build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.scheduler.colocation import ColocationScheduler
    from grserve.scheduler.llm_factory import make_llm_scheduler

    inner = make_llm_scheduler(cfg.coloc_scheduler, token_budget=cfg.coloc_token_budget,
                               max_num_batched_tokens=cfg.coloc_token_budget,
                               max_num_seqs=cfg.coloc_max_num_seqs)
    pol = ColocationScheduler(inner, tpot_slo_s=slo, max_offline_preemptions=cfg.coloc_max_offline_preemptions,
                              model=latency_model)
    real = build_model_engine(model, pol, num_blocks=cfg.coloc_num_blocks, block_size=16)
    clock = VirtualClock()
    eng = LLMEngine(pol, real.pool, TimedExecutor(real.executor, cfg.coloc_timer), clock=clock)
    eng.keep_finished = True
    reqs = sorted((dc.replace(r) for r in reqs), key=lambda r: r.arrival)
    by_id: dict[int, _Req] = {}
    online_left = sum(r.tag == "online" for r in reqs)
    nxt = 0
    while True:
        while nxt < len(reqs) and reqs[nxt].arrival <= clock():
            r = reqs[nxt]
            r.seq_id = eng.add_request(r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                ignore_eos=True),
                                       arrival=r.arrival, priority=r.priority)
            by_id[r.seq_id] = r
            nxt += 1
        if online_left == 0 and (horizon is None or clock() >= horizon) and (horizon is not None or
                                                                             not eng.has_work()):
            break
        if not eng.has_work():
            if nxt >= len(reqs):
                break
            clock.now = max(clock.now, reqs[nxt].arrival)
            continue
        eng.step()
        if not eng.last_step_progressed:
            clock.now = min(clock.now + 0.001, reqs[nxt].arrival) if nxt < len(reqs) else clock.now + 0.001
        while eng.finished:
            s = eng.finished.pop()
            r = by_id[s.seq_id]
            r.times = list(s.token_times)
            online_left -= r.tag == "online"
    for s in list(eng.running) + list(eng.waiting):  # unfinished offline work: its tokens so far
        by_id[s.seq_id].times = list(s.token_times)
    return {"reqs": list(by_id.values()), "end": clock(), "stats": dict(eng.stats), "pol": dict(pol.stats),
            "coef": None if pol.model.coef is None else [float(c) for c in pol.model.coef]}


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
        log(f"capacity {capacity:.1f} req/s, online rate {rate:.1f} req/s")
        slo = 1.0  # set from round 0's online-only run (the online-only runs never look at it)
        pooled = {"on": ([], []), "co": ([], [])}
        tokens = {"off": 0, "co": 0}
        window_total, rounds = 0.0, []
        stats = {"offline_preemptions": 0, "offline_deferred": 0, "offline_victims": 0}
        coef = None
        for rep in range(cfg.coloc_reps):
            a = _run(model, cfg, lm, slo, online)
            ttft_a, tpot_a, w = _online(a)
            if rep == 0:
                slo = cfg.coloc_slo_factor * _p90(tpot_a)
                log(f"TPOT SLO {slo * 1e3:.1f} ms")
            # offline alone: the backlog as plain work (the policy inside, no co-location rule applies)
            b = _run(model, cfg, lm, slo, [dc.replace(r, priority="online") for r in offline], horizon=w)
            c = _run(model, cfg, lm, slo, online + offline, horizon=w)
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
