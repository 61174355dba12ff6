"""``grserve bench ranking``: BAT vs UP-only, IP-only, greedy-by-size and recompute, in one engine, one run.

Every system is a ``RankingRunner`` with its own prefix policy and user cache (same byte budget for all) over the
same model, the same precomputed item-KV pool and the same trace. Systems run **interleaved batch by batch**
(batch b of every system, then batch b+1, ...), so load from other processes on a shared machine hits all of
them alike; each system's throughput is requests / its own busy seconds.

Default: the paper's lengths (profiles lognormal median 1250, cap 8K; 100 candidates × 10–18 tokens); the CPU
scale is in the number of users (25 → 85 requests) and the model (``tiny``), not in the lengths. ``--scale``
shrinks profile lengths only (changes the user/item token ratio: for quick runs, not for the targets). The
user-cache budget defaults to a fraction of the distinct users' KV (``--user-cache-frac``), so it binds.
Timing: ``--threads`` intra-op threads (default 1) and each system's busy time is measured both as wall time
and as this process's CPU time (``time.process_time``); the headline speedups use CPU time, which on a shared
machine is not inflated by other jobs' load (the wall-time speedups are reported beside them). ``--kv-workers N``
(N ≥ 2) adds the placement comparison: bytes of item KV moved under HRCS vs full replication vs hash sharding,
counted from the placements (``hrcs_compare.py``). ``--instances N`` (N ≥ 2) runs the trace on a served ranking
cluster instead — N instances, N KV-cache workers, HRCS — and reports item-KV memory per instance against full
replication and the fetch cost (``ranking_cluster.py``).

The last output line is one JSON object: ``speedup_vs_up``, ``speedup_vs_recompute``, ``cached_token_fraction``
(BAT), per-system summaries, the workload statistics.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from grserve.config import RANKING_POLICIES, RankingConfig
from grserve.flags import Checked, comma_list, config_command, flag, non_negative, positive, positive_int, split_commas

SYSTEMS = RANKING_POLICIES  # bat, user_prefix, item_prefix, greedy_size, recompute
LABELS = {"bat": "BAT", "user_prefix": "UP", "item_prefix": "IP", "greedy_size": "greedy-by-size",
          "recompute": "recompute"}
BENCH_DTYPES = ("auto", "bfloat16", "float32")  # choices on the command line


@dataclass(frozen=True)
class RankingBenchConfig(Checked):
    """The knobs of ``grserve bench ranking``."""

    model: str = flag("tiny-bat", "preset or HF directory (tiny-bat: Qwen2-1.5B's linear-vs-attention FLOP mix at "
                                  "tiny cost)", metavar="PRESET_OR_DIR")
    dtype: str = flag("auto", "model dtype (auto: what grserve serve would pick here, model/dtype_choice.py)",
                      choices=BENCH_DTYPES)
    scale: float = flag(1.0, "profile-length scale (1.0 = the paper's lengths; candidates stay 100)", check=positive)
    full_scale: bool = flag(False, "same as --scale 1.0")
    users: int = flag(25, "distinct users in the one-hour trace", check=positive_int)
    items: int = flag(4000, "catalog size", check=positive_int)
    threads: int = flag(1, "torch intra-op threads", check=positive_int)
    user_cache_frac: float = flag(0.1, "user-cache budget as a fraction of the distinct users' KV bytes",
                                  check=non_negative)
    user_cache_mb: float | None = flag(None, "user-cache budget in MiB (default: --user-cache-frac)",
                                       check=non_negative)
    window_s: float = flag(RankingConfig().user_window_s, "user frequency window W, seconds", check=positive)
    batch: int = flag(4, "requests per batch", check=positive_int)
    page_size: int = flag(RankingConfig().page_size, "tokens per KV page", check=positive_int)
    systems: str = flag(",".join(SYSTEMS), f"comma list of {', '.join(SYSTEMS)}", check=comma_list(allowed=SYSTEMS))
    kv_workers: int = flag(0, "N >= 2: also compare HRCS / replicate / hash bytes", check=non_negative)
    alpha: float = flag(0.1, "HRCS tolerable communication/computation ratio", check=non_negative)
    link_gbps: float = flag(10.0, "HRCS link bandwidth (Gbps)", check=positive)
    hrcs_prefill_s: float | None = flag(None, "HRCS's t (seconds per IP prefill) in Algorithm 1 (default: measured "
                                              "in this run); e.g. 0.1 to model a GPU prefill", check=non_negative)
    hrcs_kv_bytes_per_token: int | None = flag(None, "KV bytes per token for HRCS's link rate B in tokens/s "
                                                     "(default: this model's); e.g. 28672 for Qwen2-1.5B fp16 (bytes "
                                                     "moved are still this model's real tensors)",
                                               check=positive_int)
    instances: int = flag(0, "N >= 2: serve the trace on a ranking cluster of N instances with the item KV on N "
                             "KV-cache workers (HRCS) instead of the in-process systems: item-KV memory per instance "
                             "vs full replication, fetch cost", check=non_negative)
    seed: int = flag(0, "seed of the weights and the trace", check=non_negative)


def add_command(sub) -> None:
    config_command(sub, "ranking", help="BAT ranking throughput: hotness-aware prefix choice vs UP, IP, greedy, "
                                        "recompute",
                   cls=RankingBenchConfig, run=run, description=__doc__)


def run(a: RankingBenchConfig) -> int:
    import torch
    from rich.console import Console

    from grserve.engine.ranking_runner import _kv_store, precompute_item_kv
    from grserve.kvcache.item_pool import ItemKVPool
    from grserve.model import load_model
    from grserve.ranking.workload import WorkloadSpec
    from grserve_bench.ranking_trace import generate_workload

    scale = 1.0 if a.full_scale else a.scale
    systems = split_commas(a.systems)
    console = Console(stderr=False)
    if a.instances >= 2:
        from grserve_bench.ranking_cluster import print_cluster, run_cluster

        served = run_cluster(a)
        print_cluster(console, served)
        print(json.dumps({"cluster_served": served}))
        return 0
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    model = load_model(a.model, dtype=a.dtype, seed=a.seed)
    spec = WorkloadSpec(num_items=a.items, num_users=a.users, scale=scale, seed=a.seed)
    reg, trace, wstats = generate_workload(spec, model.spec.vocab_size)
    bpt = model.spec.kv_bytes_per_token(torch.empty(0, dtype=model.dtype).element_size())
    distinct_user_bytes = sum(len(reg.user_tokens(u)) for u in {r.user_id for r in trace}) * bpt
    budget = int(a.user_cache_mb * 2**20) if a.user_cache_mb is not None else \
        int(a.user_cache_frac * distinct_user_bytes)

    # the item-KV pool, precomputed once offline and shared (read-only) by every system
    t0 = time.perf_counter()
    item_tokens = sum(len(reg.item_tokens(i)) for i in reg.item_ids())
    pages = sum(-(-len(reg.item_tokens(i)) // a.page_size) for i in reg.item_ids())
    pool = ItemKVPool(_kv_store(model, (pages + 1) * a.page_size * bpt, a.page_size))
    print(f"precomputing the item KV pool: {reg.num_items} items, {item_tokens} tokens", file=sys.stderr)
    precompute_item_kv(model, [(i, reg.item_tokens(i)) for i in reg.item_ids()], pool.put, progress=True)
    precompute_s = time.perf_counter() - t0

    summ, wall = _run_systems(model, reg, trace, pool, systems, a, budget)
    reqs = trace  # one request per trace entry
    _print_systems(console, summ, f"BAT ranking bench — {len(reqs)} requests, scale {scale}, {a.threads} thread(s), "
                   f"user cache {budget / 2**20:.1f} MiB ({budget / max(distinct_user_bytes, 1):.0%} of distinct "
                   "users' KV)")
    console.print(f"cacheable ceiling of this trace (unbounded user cache, every request its larger prefix): "
                  f"{wstats['cacheable_share_ceiling']:.3f} of user + item tokens")

    out = {
        "dtype": model.dtype_choice.name, "dtype_reason": model.dtype_choice.reason, "quantization": "none",
        "scale": scale, "requests": len(reqs), "batch": a.batch, "threads": a.threads, "timing": "process_cpu",
        "user_cache_bytes": budget,
        "user_cache_fraction_of_distinct_users": budget / max(distinct_user_bytes, 1),
        "item_pool_bytes": pool.used_bytes, "precompute_s": precompute_s, "kv_bytes_per_token": bpt,
        "workload": wstats,
    }
    out.update(_headline(summ))
    out["systems"] = {s: {k: v for k, v in summ[s].items()} for s in systems}
    if a.kv_workers >= 2:
        from grserve_bench.hrcs_compare import compare_placements, print_placements

        measured = wall.get("item_prefix", 0) / max(len(reqs), 1)
        if a.hrcs_prefill_s is None and not measured:
            print("grserve bench ranking: note: item_prefix was not run, so HRCS's prefill time t is 0 "
                  "(everything replicated); pass --hrcs-prefill-s", file=sys.stderr)
        cl = compare_placements(trace, reg, pool, workers=a.kv_workers, alpha=a.alpha, link_gbps=a.link_gbps,
                                kv_bytes_per_token=a.hrcs_kv_bytes_per_token or bpt,
                                prefill_s=a.hrcs_prefill_s if a.hrcs_prefill_s is not None else measured)
        out["cluster"] = cl
        print_placements(console, cl)
    print(json.dumps(out))
    return 0


def _print_systems(console, summ: dict, title: str) -> None:
    from rich.table import Table

    table = Table(title=title)
    for col in ("system", "req/CPU-s", "req/wall-s", "speedup vs UP", "computed frac", "cached frac", "user hit",
                "item hit", "UP share", "evictions"):
        table.add_column(col, justify="right")
    base_up = summ.get("user_prefix", {}).get("throughput_rps")
    for s, st in summ.items():
        table.add_row(LABELS[s], f"{st['throughput_rps']:.3f}", f"{st['throughput_wall_rps']:.3f}",
                      f"{st['throughput_rps'] / base_up:.2f}x" if base_up else "-",
                      f"{st['computed_token_fraction']:.3f}", f"{st['cached_token_fraction']:.3f}",
                      f"{st['user_hit_rate']:.3f}", f"{st['item_hit_rate']:.3f}", f"{st['up_share']:.2f}",
                      str(st["user_evictions"]))
    console.print(table)


def _headline(summ: dict) -> dict:
    """BAT against each other system: throughput (CPU and wall time) and computed-token ratios."""
    out: dict = {}
    if "bat" not in summ:
        return out
    bat = summ["bat"]
    for s, key in (("user_prefix", "speedup_vs_up"), ("recompute", "speedup_vs_recompute"),
                   ("item_prefix", "speedup_vs_ip"), ("greedy_size", "speedup_vs_greedy")):
        if s in summ:
            out[key] = bat["throughput_rps"] / summ[s]["throughput_rps"]
            out[key + "_wall"] = bat["throughput_wall_rps"] / summ[s]["throughput_wall_rps"]
            out[key.replace("speedup", "computed_token_ratio")] = summ[s]["computed_tokens"] / max(
                bat["computed_tokens"], 1)
    out["cached_token_fraction"] = bat["cached_token_fraction"]
    if "user_prefix" in summ:
        out["computed_token_ratio_up_over_bat"] = summ["user_prefix"]["computed_tokens"] / max(
            bat["computed_tokens"], 1)
    return out


def _run_systems(model, reg, trace, pool, systems: list[str], a: RankingBenchConfig, budget: int
                 ) -> tuple[dict, dict[str, float]]:
    """Every system on the trace, interleaved batch by batch; per system its stats summary and busy times."""
    from tqdm import tqdm

    from grserve.engine.ranking_runner import RankingRequest, RankingRunner

    cfg = dict(user_cache_bytes=budget, page_size=a.page_size, user_window_s=a.window_s, write_back_items=False)
    runners = {s: RankingRunner(model, reg, RankingConfig(policy=s, **cfg), item_source=pool) for s in systems}
    reqs = [RankingRequest(reg.user_tokens(r.user_id), [reg.item_tokens(i) for i in r.item_ids], user_id=r.user_id,
                           item_ids=list(r.item_ids), top_k=10, now=r.time_s, request_id=str(k))
            for k, r in enumerate(trace)]
    batches = [reqs[k:k + a.batch] for k in range(0, len(reqs), a.batch)]
    busy = dict.fromkeys(systems, 0.0)  # CPU seconds of this process
    wall = dict.fromkeys(systems, 0.0)
    for k, b in enumerate(tqdm(batches, desc="bench ranking", unit="batch", file=sys.stderr)):
        # rotate the order every batch so no system always runs right after another one (cache/load effects)
        for s in systems[k % len(systems):] + systems[:k % len(systems)]:
            t, c = time.perf_counter(), time.process_time()
            runners[s].run(b)
            busy[s] += time.process_time() - c
            wall[s] += time.perf_counter() - t

    summ = {}
    for s in systems:
        st = runners[s].stats.summary()
        st["busy_cpu_s"] = busy[s]
        st["busy_wall_s"] = wall[s]
        st["throughput_rps"] = st["requests"] / busy[s]
        st["throughput_wall_rps"] = st["requests"] / wall[s]
        st["computed_tokens_per_s"] = st["computed_tokens"] / busy[s]
        uc = runners[s].user_cache
        st["user_cache_used_bytes"] = uc.store.used_bytes if uc is not None else 0
        summ[s] = st
    return summ, wall
