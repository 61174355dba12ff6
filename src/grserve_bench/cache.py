"""``grserve bench cache``: replay cache traces under LRU, OPT (Belady), FPB, HF and LARU.

Traces (``grserve_bench/traces.py``): Zipf 0.9 over 100k keys (the P5 setting), Zipf with popularity drift, a loop of
1.5k keys (P5), a hot set with scans, an Online-QA-like multi-turn prefix trace through the radix prefix cache
(token hit rate), and DLRM sparse-feature batches through the 64-way set-associative embedding cache.

Predictions for FPB/HF/LARU: the oracle with noise p ∈ {0, 0.25, 0.5, 1} (each prediction replaced by the inverted
one, −(true next-request time), with probability p), and the online LightGBM predictor (``predictor=lgbm``, p = 0,
ASYNC mode, deterministic emulation). Printed per row: hit rate, predictions per request, policy time per request.
Writes ``hit_rate_vs_p.png`` under ``--out-dir``. The last stdout line is one JSON object with a ``rows`` list of
{trace, cache_size, policy, predictor, p, hit_rate} (plus extra fields).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from grserve_bench import traces as T
from grserve_bench.cache_trace import TRACE_POLICIES, bench_predictor
from grserve.eviction import make_policy
from grserve_bench.eviction import AccessListOracle, NoisyPredictor, simulate
from grserve.flags import (Checked, comma_list, config_command, flag, fraction, non_negative, one_of, positive_int,
                           split_commas)

LEARNED = ("fpb", "hf", "laru")


TRACES = ("zipf", "zipf-drift", "loop", "scan-hot", "conversations", "dlrm")
POLICIES = ("lru", "opt", "fpb", "hf", "laru", "lfu", "density", "leader")
OWN_MODEL = ("density", "leader")  # learned policies with their own online model (no predictor, no noise rows)


def _laru_decay(v: str) -> str | None:
    return None if v == "auto" or (v.isdigit() and int(v) > 0) else f"must be a positive integer or 'auto', got {v!r}"


@dataclass(frozen=True)
class CacheBenchConfig(Checked):
    """The knobs of ``grserve bench cache``."""

    traces: str = flag(",".join(TRACES), f"comma-separated subset of: {', '.join(TRACES)}",
                       check=comma_list(allowed=TRACES))
    noise: str = flag("0,0.25,0.5,1", "comma-separated noise levels p", check=comma_list(float, each=fraction))
    policies: str = flag("lru,opt,fpb,hf,laru", "comma-separated policies (lfu, density, leader also available)",
                         check=comma_list(str.lower, allowed=POLICIES))
    learned: bool = flag(True, "the LightGBM-predictor rows (--no-learned: skip them)")
    quick: bool = flag(False, "small traces and one cache size per trace (2.5-4 min on a loaded 2-core machine)")
    out_dir: str = flag("bench-results", "where the PNG and the JSON are written", metavar="DIR")
    laru_decay: str = flag("1", "LARU λ ← λ/b every N prediction-induced misses: 1 (Algorithm 1, DLRM setting) or "
                                "'auto' (the LLM setting, ⌈k/32⌉ for k > 64: better with a decent predictor, weaker "
                                "when adversarial)", check=_laru_decay, metavar="N|auto")
    dlrm_clock: str = flag("lookup", "the DLRM embedding cache's logical clock: batch (one tick per batch), lookup "
                                    "(one per looked-up id) or id (one per distinct id of a batch)",
                            check=one_of("batch", "lookup", "id"), metavar="CLOCK")
    async_batch: int = flag(64, "ASYNC prediction batch for the learned predictor", check=positive_int)
    seed: int = flag(0, "seed of the traces and of the prediction noise", check=non_negative)
    trace_file: str = flag("", "replay this trace instead (Mooncake JSONL with hash_ids, or one key per line); "
                               "see grserve_bench/cache_trace.py", metavar="PATH")
    sizes: str = flag("0.01,0.02,0.05,0.1,0.2", "--trace-file: cache sizes as fractions of the unique keys",
                      check=comma_list(float, each=fraction))
    modes: str = flag("block,radix", "--trace-file: block (each hash id one item), radix (prefix tree, leaves only "
                                     "evictable) and/or engine (the LLM engine's shared-block cache: longest cached "
                                     "chain, any unpinned block evictable)",
                      check=comma_list(allowed=("block", "radix", "engine")))
    trace_policies: str = flag(",".join(TRACE_POLICIES), "--trace-file: policies to run (libcachesim: its ARC, "
                               "S3FIFO, LIRS, Cacheus, LeCaR, block mode)", check=comma_list(allowed=TRACE_POLICIES))
    max_requests: int = flag(0, "--trace-file: replay only the first N requests (0 = all; a sampled run)",
                             check=non_negative)


def add_command(sub) -> None:
    config_command(sub, "cache", help="cache eviction hit rates (LRU, OPT, FPB, HF, LARU) on replayed traces",
                   cls=CacheBenchConfig, run=run, description=__doc__)


@dataclass
class Workload:
    name: str
    sizes: list[int]
    kind: str  # "paging" | "prefix" | "dlrm"
    data: Any
    unit: str = "items"


def build_workloads(names: list[str], quick: bool, seed: int) -> list[Workload]:
    q = quick
    out: list[Workload] = []
    for n in names:
        if n == "zipf":  # P5: Zipf 0.9, 100k keys, cache 2k
            out.append(Workload(n, [2000], "paging",  # 200k requests: libcachesim gives LRU 0.411, Belady 0.594
                                T.zipf(60_000 if q else 200_000, 100_000, 0.9, seed=seed)))
        elif n == "zipf-drift":
            out.append(Workload(n, [1000], "paging", T.zipf(30_000 if q else 60_000, 50_000, 0.9, drift=0.1,
                                                              drift_every=10_000, seed=seed + 1)))
        elif n == "loop":  # P5: loop of 1.5k keys over a cache of 1k
            out.append(Workload(n, [1000], "paging", T.loop(15_000 if q else 30_000, 1500)))
        elif n == "scan-hot":
            out.append(Workload(n, [500], "paging",
                                T.scan_hot(20_000 if q else 40_000, n_hot=1000, scan_len=2000, scan_every=4000,
                                           seed=seed + 2)))
        elif n == "conversations":
            reqs = T.conversations(400 if q else 1000, scale=0.1, seed=seed + 3)
            distinct = len({int(t) for r in reqs for t in r.tokens})
            sizes = [int(distinct * f) for f in ((0.04,) if q else (0.04, 0.08))]
            out.append(Workload(n, sizes, "prefix", reqs, unit="tokens"))
        elif n == "dlrm":
            batches = T.dlrm_batches(8 if q else 16, batch_size=128, pooling=50, n_ids=100_000, seed=seed + 4)
            out.append(Workload(n, [2048], "dlrm", batches, unit="rows"))
        else:
            raise ValueError(f"unknown trace {n!r}; choose from {', '.join(TRACES)}")
    return out


# ---- one run per (workload, size, policy, predictor, p) -----------------------------------------------------------
def _policy_kw(policy: str, args: CacheBenchConfig, predictor_kind: str) -> dict:
    kw: dict = {}
    if predictor_kind == "lgbm":
        kw.update(mode="async", async_batch=args.async_batch)
    if policy == "laru":
        kw["decay_every"] = "auto" if args.laru_decay == "auto" else int(args.laru_decay)
    return kw


def run_paging(keys: list[int], k: int, policy: str, predictor: str, p: float, args) -> dict:
    oracle_times = AccessListOracle.from_trace(keys)._times if policy not in ("lru", *OWN_MODEL) else None
    if policy in ("lru", *OWN_MODEL):
        pol = make_policy(policy, k)
    elif policy == "opt":
        pol = make_policy("belady", k, oracle=AccessListOracle(oracle_times))
    elif predictor == "lgbm":
        pol = make_policy(policy, k, predictor=bench_predictor(k), **_policy_kw(policy, args, "lgbm"))
    else:
        pred = NoisyPredictor(AccessListOracle(oracle_times), p, seed=args.seed)
        pol = make_policy(policy, k, predictor=pred, **_policy_kw(policy, args, "oracle"))
    res = simulate(keys, pol)
    pol.close()
    return dict(hit_rate=res.hit_rate, requests=res.requests, policy_s=res.policy_seconds, stats=pol.stats,
                jobs=getattr(getattr(pol, "jobs", None), "predicted", 0))


def run_prefix(reqs, cap: int, policy: str, predictor: str, p: float, args, times_cache: dict) -> dict:
    from grserve.kvcache.radix import RadixCache
    from grserve_bench.eviction.oracle import prefix_access_times

    prompts = [r.tokens for r in reqs]
    if policy not in ("lru", *OWN_MODEL) and predictor != "lgbm" and "times" not in times_cache:
        times_cache["times"] = prefix_access_times(prompts)
    if policy in ("lru", *OWN_MODEL):
        pol = make_policy(policy, cap)
    elif policy == "opt":
        pol = make_policy("belady", cap, oracle=AccessListOracle(times_cache["times"]))
    elif predictor == "lgbm":
        pol = make_policy(policy, cap, predictor=bench_predictor(256, static=lambda ident: float(ident[0])),
                          **_policy_kw(policy, args, "lgbm"))
    else:
        pred = NoisyPredictor(AccessListOracle(times_cache["times"]), p, seed=args.seed)
        pol = make_policy(policy, cap, predictor=pred, **_policy_kw(policy, args, "oracle"))
    tree = RadixCache(cap, policy=pol)
    spent = 0.0
    for r, toks in enumerate(prompts):
        t0 = time.perf_counter()
        m = tree.match_prefix(toks, now=r)
        tree.lock(m.last_node)  # in use while the request is served
        tree.insert(toks, now=r)
        tree.unlock(m.last_node)
        spent += time.perf_counter() - t0
    pol.close()
    return dict(hit_rate=tree.hit_rate, requests=len(prompts), policy_s=spent, stats=pol.stats,
                jobs=getattr(getattr(pol, "jobs", None), "predicted", 0))


def run_dlrm(batches, cap: int, policy: str, predictor: str, p: float, args, times_cache: dict) -> dict:
    import torch

    from grserve_bench.eviction.embedding_cache import EmbeddingCache, access_times

    ways = 64
    n_ids = int(max(int(b[0].max()) for b in batches)) + 1
    table = torch.zeros(n_ids, 4)
    clock = args.dlrm_clock
    if times_cache.get("clock") != clock:
        times_cache.update(clock=clock, times=access_times((idx for idx, _ in batches), clock))
    times = times_cache["times"]
    if policy in ("lru", *OWN_MODEL):
        factory = lambda s, w: make_policy(policy, w)  # noqa: E731
    elif policy == "opt":
        oracle = AccessListOracle(times)
        factory = lambda s, w: make_policy("belady", w, oracle=oracle)  # noqa: E731
    elif predictor == "lgbm":
        shared = bench_predictor(cap, static=float)
        factory = lambda s, w: make_policy(policy, w, predictor=shared, **_policy_kw(policy, args, "lgbm"))  # noqa: E731
    else:
        shared = NoisyPredictor(AccessListOracle(times), p, seed=args.seed)
        factory = lambda s, w: make_policy(policy, w, predictor=shared, **_policy_kw(policy, args, "oracle"))  # noqa: E731
    cache = EmbeddingCache(table, num_sets=max(1, cap // ways), ways=ways, policy=factory, clock=clock)
    t0 = time.perf_counter()
    for idx, off in batches:
        cache.sparse_length_sum(idx, off)
    spent = time.perf_counter() - t0
    stats: dict[str, int] = {}
    jobs = sum({id(pol.jobs): pol.jobs.predicted for pol in cache.policies if getattr(pol, "jobs", None)}.values())
    for pol in cache.policies:
        for key, v in pol.stats.items():
            stats[key] = stats.get(key, 0) + v
        pol.close()
    n = cache.hits + cache.misses
    return dict(hit_rate=cache.hit_rate, requests=n, policy_s=spent, stats=stats, jobs=jobs)


def plan(workloads: list[Workload], policies: list[str], noise: list[float], learned: bool):
    for w in workloads:
        for size in w.sizes:
            for pol in policies:
                if pol in LEARNED:
                    for p in noise:
                        yield w, size, pol, "oracle", p
                    if learned:
                        yield w, size, pol, "lgbm", 0.0
                else:
                    yield w, size, pol, "none" if pol != "opt" else "oracle", 0.0


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["trace"], r["cache_size"]) for r in rows})
    ncol = min(4, len(groups))
    nrow = (len(groups) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.3 * nrow), squeeze=False)
    for ax, (trace, size) in zip(axes.flat, groups):
        sub = [r for r in rows if r["trace"] == trace and r["cache_size"] == size]
        ps = sorted({r["p"] for r in sub if r["predictor"] == "oracle" and r["policy"] in LEARNED})
        for pol, style in (("fpb", "o-"), ("hf", "s-"), ("laru", "^-")):
            ys = [next((r["hit_rate"] for r in sub if r["policy"] == pol and r["predictor"] == "oracle"
                        and r["p"] == p), np.nan) for p in ps]
            ax.plot(ps, ys, style, label=pol.upper())
        for pol, style in (("lru", "k--"), ("opt", "g:")):
            v = next((r["hit_rate"] for r in sub if r["policy"] == pol), None)
            if v is not None:
                ax.axhline(v, color=style[0], linestyle=style[1:], label=pol.upper())
        lg = next((r["hit_rate"] for r in sub if r["policy"] == "laru" and r["predictor"] == "lgbm"), None)
        if lg is not None:
            ax.axhline(lg, color="tab:purple", linestyle="-.", label="LARU (LightGBM)")
        ax.set_title(f"{trace}, cache {size}", fontsize=9)
        ax.set_xlabel("noise p (inverted predictions)")
        ax.set_ylabel("hit rate")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(cfg: CacheBenchConfig) -> int:
    if cfg.trace_file:
        return run_trace_file(cfg)
    noise = split_commas(cfg.noise, float)
    policies = split_commas(cfg.policies, str.lower)
    workloads = build_workloads(split_commas(cfg.traces), cfg.quick, cfg.seed)
    jobs = list(plan(workloads, policies, noise, cfg.learned))
    rows: list[dict] = []
    caches: dict[str, dict] = {}
    t_all = time.perf_counter()
    for w, size, pol, predictor, p in tqdm(jobs, desc="cache bench", file=sys.stderr, unit="run"):
        pol_run = "lfu" if pol == "lfu" else pol
        if w.kind == "paging":
            if pol == "lfu":
                res = _run_lfu(w.data, size)
            else:
                res = run_paging(w.data, size, pol_run, predictor, p, cfg)
        elif w.kind == "prefix":
            res = run_prefix(w.data, size, pol_run, predictor, p, cfg, caches.setdefault(w.name, {}))
        else:
            res = run_dlrm(w.data, size, pol_run, predictor, p, cfg, caches.setdefault(w.name, {}))
        preds = res["stats"].get("predictions", 0) + res.get("jobs", 0)
        rows.append(dict(trace=w.name, cache_size=size, policy=pol, predictor=predictor, p=p,
                         hit_rate=round(res["hit_rate"], 6), unit=w.unit,
                         predictions_per_request=round(preds / max(res["requests"], 1), 4),
                         policy_us_per_request=round(1e6 * res["policy_s"] / max(res["requests"], 1), 2),
                         line14=res["stats"].get("line14")))
    elapsed = time.perf_counter() - t_all

    console = Console(file=sys.stdout, width=140)
    table = Table(title=f"cache hit rates ({elapsed:.0f} s)", show_lines=False)
    for col in ("trace", "cache", "policy", "predictor", "p", "hit rate", "gap closed", "pred/req", "µs/req"):
        table.add_column(col, justify="right" if col not in ("trace", "policy", "predictor") else "left")
    for r in rows:
        ref = {x["policy"]: x["hit_rate"] for x in rows if x["trace"] == r["trace"]
               and x["cache_size"] == r["cache_size"] and x["policy"] in ("lru", "opt")}
        gap = ""
        if "lru" in ref and "opt" in ref and ref["opt"] > ref["lru"]:
            gap = f"{100 * (r['hit_rate'] - ref['lru']) / (ref['opt'] - ref['lru']):.0f}%"
        table.add_row(r["trace"], f"{r['cache_size']} {r['unit']}", r["policy"], r["predictor"], f"{r['p']:g}",
                      f"{r['hit_rate']:.4f}", gap, f"{r['predictions_per_request']:.2f}",
                      f"{r['policy_us_per_request']:.1f}")
    console.print(table)
    os.makedirs(cfg.out_dir, exist_ok=True)
    png = os.path.join(cfg.out_dir, "hit_rate_vs_p.png")
    plot(rows, png)
    summary = {"rows": rows, "png": png, "seconds": round(elapsed, 1), "quick": cfg.quick,
               "laru_decay": cfg.laru_decay}
    with open(os.path.join(cfg.out_dir, "cache.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {png}", file=sys.stderr)
    print(json.dumps(summary))
    return 0


def run_trace_file(cfg: CacheBenchConfig) -> int:
    from grserve_bench.cache_trace import print_tables, run_trace_bench
    from grserve.flags import UsageError

    if not os.path.exists(cfg.trace_file):
        from grserve_bench.cluster import TRACE_SOURCE

        raise UsageError(f"--trace-file: no such file {cfg.trace_file!r} (a Mooncake JSONL with hash_ids, e.g. "
                         f"{TRACE_SOURCE}, or a file of one key per line)")
    summary = run_trace_bench(cfg.trace_file, split_commas(cfg.sizes, float), split_commas(cfg.modes),
                              split_commas(cfg.trace_policies), cfg.max_requests)
    print_tables(summary)
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, f"cache_{summary['trace']}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return 0


def _run_lfu(keys: list[int], k: int) -> dict:
    pol = make_policy("lfu", k, window=10 * k)
    res = simulate(keys, pol)
    return dict(hit_rate=res.hit_rate, requests=res.requests, policy_s=res.policy_seconds, stats=pol.stats, jobs=0)

