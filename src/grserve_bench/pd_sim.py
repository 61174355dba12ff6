"""Part 'sim' of ``grserve bench pd`` (bench/pd.py): goodput of static PD, dynamic PD and co-located serving at
GPU scale, in the discrete-event simulation of ``grserve_bench/pd_simulator.py`` (cost model documented there and in
docs/cluster.md, "PD disaggregation: policy and simulation").

Goodput of a configuration on a trace shape = the highest arrival rate (requests/s) at which at least
``sim_attainment`` (90 %) of the requests meet both SLOs (TTFT ≤ ``sim_ttft_slo_s`` and TPOT ≤ ``sim_tpot_slo_s``),
searched on the rate grid ``sim_rate_lo · 2^(k/16)`` (4.4 % apart): doubling from ``sim_rate_lo`` until a rate
fails, then bisection between the last passing and the first failing rate (``_Search.goodput``). Each rate runs a fresh trace of ``sim_duration_s``
seconds (same seed at every rate: common random numbers); requests not done ``sim_drain_s`` after the trace ends
count as misses.

Configurations (``sim_instances`` instances):
- static PD with every P:D ratio; the static ratio reported for both traces is the best one on the stable trace
  (what profiling a stable workload would choose); the best ratio on the bursty trace (an oracle that knows the
  bursts) is reported too;
- dynamic PD: starts from that same ratio, ``cluster/pd_policy`` routing and role flips;
- co-located: every instance prefills (chunked, ``sim_chunk_tokens`` per iteration) and decodes; least-loaded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from grserve.config import PDConfig, SLOConfig
from grserve.flags import Checked, at_least, flag, fraction, non_negative, positive, positive_int


@dataclass(frozen=True)
class PartConfig(Checked):
    """Flags of part 'sim' (all prefixed ``sim_``)."""

    sim_model: str = flag("llama2-13b", "model shape of the simulation", choices=("llama2-13b", "llama2-7b"))
    sim_gpu: str = flag("a100-80gb", "GPU of every instance", choices=("a100-80gb", "h100-sxm"))
    sim_link_gbps: float = flag(200.0, "KV-transfer link bandwidth per instance, Gbit/s", check=positive)
    sim_instances: int = flag(6, "instances (one GPU each)", check=at_least(2))
    sim_ttft_slo_s: float = flag(1.5, "TTFT SLO, seconds", check=positive)
    sim_tpot_slo_s: float = flag(0.06, "TPOT SLO, seconds", check=positive)
    sim_attainment: float = flag(0.9, "share of requests that must meet both SLOs at the goodput rate",
                                 check=fraction)
    sim_duration_s: float = flag(120.0, "trace length, seconds of simulated time", check=positive)
    sim_drain_s: float = flag(60.0, "simulated time after the trace ends before unfinished requests count as "
                                    "misses", check=non_negative)
    sim_rate_lo: float = flag(1.0, "lowest arrival rate of the goodput search, requests/s", check=positive)
    sim_grid_per_doubling: int = flag(16, "goodput search grid: rates sim_rate_lo · 2^(k/this)",
                                      check=positive_int)
    sim_burst_period_s: float = flag(30.0, "bursty trace: one burst of prompt-heavy requests every this many "
                                           "seconds", check=positive)
    sim_burst_duty: float = flag(0.25, "bursty trace: the share of each period the burst lasts", check=fraction)
    sim_prompt_heavy_share: float = flag(0.5, "share of prompt-heavy requests (prompt 1500-4000, output 16-64) in "
                                              "both traces; the rest output-heavy (prompt 100-400, output "
                                              "200-600)", check=fraction)
    sim_chunk_tokens: int = flag(512, "prefill tokens per iteration on an instance that is decode-role, co-located or "
                                         "still running decodes",
                                 check=positive_int)
    sim_prefill_budget: int = flag(8192, "prefill tokens per iteration on prefill-role instances",
                                   check=positive_int)
    sim_min_dwell_s: float = flag(2.0, "dynamic PD: minimum time in a pool before flipping again",
                                  check=non_negative)
    sim_monitor_interval_s: float = flag(0.5, "dynamic PD: the monitor checks the flip rules this often (and at "
                                              "every arrival)", check=positive)
    sim_seed: int = flag(0, "trace seed")
    sim_ablations: bool = flag(False, "also search dynamic PD without role flips (overflow prefills to decode "
                                      "instances only) and without overflow (flips only)")



def _setup(cfg: PartConfig, mode: str, prefill: int):
    """``mode``: static, dynamic, colocated, or the ablations dynamic-noflip / dynamic-nooverflow."""
    from grserve_bench.pd_simulator import SimSetup

    pd = PDConfig(pd=True, prefill_instances=max(1, prefill), min_dwell_s=cfg.sim_min_dwell_s,
                  role_flips=mode != "dynamic-noflip")
    return SimSetup(mode.split("-")[0], cfg.sim_instances, max(1, prefill), cfg.sim_prefill_budget,
                    cfg.sim_chunk_tokens, cfg.sim_monitor_interval_s, pd=pd, slo=_slo(cfg),
                    overflow_to_decode=mode != "dynamic-nooverflow")


def _slo(cfg: PartConfig) -> SLOConfig:
    return SLOConfig(ttft_slo_s=cfg.sim_ttft_slo_s, tpot_slo_s=cfg.sim_tpot_slo_s)


class _Search:
    """Goodput by rate search; caches every run (config, trace, rate) -> result."""

    def __init__(self, cfg: PartConfig):
        from grserve_bench.pd_simulator import GPUCostModel, TraceShape

        self.cfg = cfg
        self.cost = GPUCostModel.preset(cfg.sim_model, cfg.sim_gpu, cfg.sim_link_gbps)
        self.shape = TraceShape(burst_period_s=cfg.sim_burst_period_s, burst_duty=cfg.sim_burst_duty,
                                prompt_heavy_share=cfg.sim_prompt_heavy_share)
        self.runs = 0
        self.last: dict = {}

    def attainment(self, mode: str, prefill: int, kind: str, rate: float) -> float:
        from grserve_bench.pd_simulator import make_trace, simulate

        c = self.cfg
        reqs = make_trace(kind, rate, c.sim_duration_s, self.shape, c.sim_seed)
        res = simulate(_setup(c, mode, prefill), self.cost, reqs, c.sim_duration_s + c.sim_drain_s,
                       give_up=1.0 - c.sim_attainment)
        self.runs += 1
        self.last[(mode, prefill, kind, rate)] = res
        return res.attainment(_slo(c))

    def goodput(self, mode: str, prefill: int, kind: str) -> tuple[float, dict]:
        """The highest rate of the grid ``sim_rate_lo · 2^(k / sim_grid_per_doubling)`` that meets the attainment,
        by bisection: double k by whole doublings until a rate fails, then bisect the grid indices in between
        (goodput 0 when ``sim_rate_lo`` already fails). Returns (rate, the flips of the run at that rate)."""
        c = self.cfg
        g = c.sim_grid_per_doubling
        rate = lambda k: c.sim_rate_lo * 2 ** (k / g)  # noqa: E731
        ok = lambda k: self.attainment(mode, prefill, kind, rate(k)) >= c.sim_attainment  # noqa: E731
        if not ok(0):
            return 0.0, {}
        lo, hi = 0, g
        while ok(hi):
            lo, hi = hi, hi + g
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        res = self.last.get((mode, prefill, kind, rate(lo)))
        return rate(lo), (dict(res.flips) if res is not None else {})


def run_part(cfg: PartConfig) -> dict:
    """Goodput search for every configuration on both traces; the keys of issue 13 plus the details."""
    t0 = time.perf_counter()
    s = _Search(cfg)
    n = cfg.sim_instances
    static = {kind: {p: s.goodput("static", p, kind)[0] for p in range(1, n)} for kind in ("stable", "bursty")}
    best_p = max(static["stable"], key=lambda p: (static["stable"][p], -p))
    dyn = {kind: s.goodput("dynamic", best_p, kind) for kind in ("stable", "bursty")}
    col = {kind: s.goodput("colocated", 0, kind)[0] for kind in ("stable", "bursty")}
    ratio = lambda a, b: round(a / b, 3) if b > 0 else None  # noqa: E731
    out = {
        "goodput_dynamic_over_static_bursty": ratio(dyn["bursty"][0], static["bursty"][best_p]),
        "goodput_dynamic_over_static_stable": ratio(dyn["stable"][0], static["stable"][best_p]),
        "sim_static_prefill_instances": best_p,
        "sim_instances": n,
        "goodput_static_stable": round(static["stable"][best_p], 3),
        "goodput_static_bursty": round(static["bursty"][best_p], 3),
        "goodput_dynamic_stable": round(dyn["stable"][0], 3),
        "goodput_dynamic_bursty": round(dyn["bursty"][0], 3),
        "goodput_colocated_stable": round(col["stable"], 3),
        "goodput_colocated_bursty": round(col["bursty"], 3),
        "goodput_static_by_prefill_instances": {k: {str(p): round(g, 3) for p, g in v.items()}
                                                for k, v in static.items()},
        "goodput_dynamic_over_best_static_bursty": ratio(dyn["bursty"][0], max(static["bursty"].values())),
        "goodput_colocated_over_static_bursty": ratio(col["bursty"], static["bursty"][best_p]),
        "goodput_colocated_over_static_stable": ratio(col["stable"], static["stable"][best_p]),
        "sim_flips_stable": dyn["stable"][1],
        "sim_flips_bursty": dyn["bursty"][1],
        "sim_model": s.cost.name,
        "sim_slo": {"ttft_s": cfg.sim_ttft_slo_s, "tpot_s": cfg.sim_tpot_slo_s, "attainment": cfg.sim_attainment},
        "sim_runs": s.runs,
    }
    if cfg.sim_ablations:
        for mode in ("dynamic-noflip", "dynamic-nooverflow"):
            for kind in ("stable", "bursty"):
                g = s.goodput(mode, best_p, kind)[0]
                out[f"goodput_{mode.replace('-', '_')}_{kind}"] = round(g, 3)
        out["sim_runs"] = s.runs
    out["sim_seconds"] = round(time.perf_counter() - t0, 2)
    return out
