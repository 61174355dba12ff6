"""``grserve bench cache --trace-file PATH``: replay a real trace (Mooncake JSONL or one key per line).

For every mode (``block``: each hash id is one unit-size item; ``radix``: the prefix tree of hash ids, leaves only
evictable, the request's path locked; ``engine``: the LLM engine's shared-block cache, longest cached chain, any
unpinned block evictable — ``eviction/prefix_sim.py``) and every cache size (a fraction of the trace's
unique keys), it runs LRU, Belady (OPT; on leaves in radix mode), every grserve policy (window-LFU, FPB / HF / LARU
with the online LightGBM predictor at the bench settings, ``density``, ``leader``, and ``leader`` with inverted
predictions), and,
in block mode when ``libcachesim`` is installed, its ARC, S3FIFO, LIRS, Cacheus and LeCaR on the same key
sequence. µs per access is the process CPU time of the policy and the cache loop per access (libcachesim: its C
loop), so it stays meaningful on a shared machine.

Printed: one table per mode with the gap closed ((policy − LRU)/(OPT − LRU)) and the margin to the best of LRU and
the libcachesim heuristics at that size. Last stdout line: one JSON object with ``rows`` (trace, cache_size,
size_fraction, mode, policy, predictor, p, hit_rate, us_per_access, …) and ``default_policy`` (the prefix cache's
default policy, ``config.LLMConfig.prefix_cache_policy``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Callable

from grserve_bench.trace_file import (
    LCS_ALGOS, PathTrace, libcachesim_available, load_trace, run_libcachesim, write_lcs_csv)
from grserve.eviction import PredictorConfig, make_policy
from grserve.eviction.predictor import LearnedPredictor
from grserve_bench.eviction import AccessListOracle
from grserve_bench.eviction.prefix_sim import simulate_paths

TRACE_POLICIES = ("lru", "opt", "lfu", "fpb", "hf", "laru", "density", "leader", "leader-inverted", "libcachesim")


def bench_predictor(k: int, static: Callable | None = None) -> LearnedPredictor:
    """The online LightGBM predictor at the cache benches' settings for a cache of ``k`` items."""
    cfg = PredictorConfig(horizon=8 * k, window=max(32 * k, 16_384), retrain_every=max(4 * k, 2048),
                          min_train=256)
    return LearnedPredictor(cfg, static_feature=static)


def default_prefix_policy() -> str:
    from grserve.config import LLMConfig

    return LLMConfig().prefix_cache_policy


def _policy(name: str, k: int, keys: list, oracle_cache: dict) -> tuple[Any, str]:
    if name == "opt":
        if "oracle" not in oracle_cache:
            oracle_cache["oracle"] = AccessListOracle.from_trace(keys)._times
        return make_policy("belady", k, oracle=AccessListOracle(oracle_cache["oracle"])), "oracle"
    if name == "lfu":
        return make_policy("lfu", k, window=10 * k), "none"
    if name in ("fpb", "hf", "laru"):
        kw: dict = dict(mode="async", async_batch=64)
        return make_policy(name, k, predictor=bench_predictor(k), **kw), "lgbm"
    if name in ("density", "leader"):
        return make_policy(name, k), "learned"
    if name == "leader-inverted":
        return make_policy("leader", k, invert=True), "inverted"
    return make_policy(name, k), "none"


def run_one(trace: PathTrace, mode: str, frac: float, name: str, oracle_cache: dict) -> dict:
    k = max(1, int(frac * trace.unique_keys))
    pol, predictor = _policy(name, k, trace.keys if name == "opt" else [], oracle_cache)
    res = simulate_paths(trace.paths, pol, mode=mode)
    pol.close()
    return dict(policy=name.replace("-inverted", ""), predictor=predictor, p=1.0 if predictor == "inverted" else 0.0,
                hit_rate=round(res.hit_rate, 6), cache_size=k,
                us_per_access=round(1e6 * res.policy_seconds / max(res.accesses, 1), 2),
                stats={s: v for s, v in pol.stats.items() if v})


def run_lcs(trace: PathTrace, fracs: list[float], csv: str) -> list[dict]:
    rows = []
    for frac in fracs:
        k = max(1, int(frac * trace.unique_keys))
        for algo in LCS_ALGOS:
            hr, us = run_libcachesim(csv, algo, k)
            rows.append(dict(mode="block", size_fraction=frac, cache_size=k, policy=f"lcs:{algo}",
                             predictor="none", p=0.0, hit_rate=round(hr, 6), us_per_access=round(us, 2)))
    return rows


def run_trace_bench(path: str, fracs: list[float], modes: list[str], policies: list[str],
                    max_requests: int = 0) -> dict:
    from tqdm import tqdm

    trace = load_trace(path, max_requests)
    rows: list[dict] = []
    t_all = time.perf_counter()
    oracle_cache: dict = {}
    grs = [p for p in policies if p != "libcachesim"]
    jobs = [(m, f, p) for m in modes for f in fracs for p in grs]
    for mode, frac, name in tqdm(jobs, desc="trace cache bench", file=sys.stderr, unit="run"):
        rows.append(dict(mode=mode, size_fraction=frac, **run_one(trace, mode, frac, name, oracle_cache)))
    if "libcachesim" in policies and "block" in modes and libcachesim_available():
        with tempfile.TemporaryDirectory() as tmp:
            csv = os.path.join(tmp, "trace.csv")
            write_lcs_csv(trace.keys, csv)
            rows.extend(run_lcs(trace, fracs, csv))
    for r in rows:
        r.update(trace=trace.name, unit="blocks", policy_us_per_request=r["us_per_access"])
    return dict(rows=rows, trace=trace.name, format=trace.format, requests=len(trace.paths),
                accesses=trace.accesses, unique_keys=trace.unique_keys, seconds=round(time.perf_counter() - t_all, 1),
                default_policy=default_prefix_policy())


def _best_baseline(rows: list[dict], mode: str, frac: float) -> float | None:
    vals = [r["hit_rate"] for r in rows if r["mode"] == mode and r["size_fraction"] == frac
            and (r["policy"] == "lru" or r["policy"].startswith("lcs:"))]
    return max(vals) if vals else None


def print_tables(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summary["rows"]
    console = Console(file=sys.stdout, width=150)
    for mode in dict.fromkeys(r["mode"] for r in rows):
        table = Table(title=f"{summary['trace']} ({summary['accesses']} accesses, {summary['unique_keys']} unique "
                            f"keys), {mode} mode, {summary['seconds']:.0f} s")
        for col in ("size", "policy", "predictor", "hit rate", "gap closed", "vs best heuristic", "µs/access"):
            table.add_column(col, justify="left" if col in ("policy", "predictor") else "right")
        for r in (x for x in rows if x["mode"] == mode):
            ref = {x["policy"]: x["hit_rate"] for x in rows if x["mode"] == mode
                   and x["size_fraction"] == r["size_fraction"] and x["policy"] in ("lru", "opt")}
            gap = ""
            if "lru" in ref and "opt" in ref and ref["opt"] > ref["lru"]:
                gap = f"{100 * (r['hit_rate'] - ref['lru']) / (ref['opt'] - ref['lru']):.0f}%"
            best = _best_baseline(rows, mode, r["size_fraction"])
            table.add_row(f"{r['size_fraction']:g} ({r['cache_size']})", r["policy"], r["predictor"],
                          f"{r['hit_rate']:.4f}", gap, "" if best is None else f"{r['hit_rate'] - best:+.4f}",
                          f"{r['us_per_access']:.1f}")
        console.print(table)
