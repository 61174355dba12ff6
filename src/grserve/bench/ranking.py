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
machine is not inflated by other jobs' load (the wall-time speedups are reported beside them). ``--kv-workers N`` (N ≥ 2) adds the cluster comparison: bytes of
item KV moved under HRCS vs full replication vs hash sharding (``grserve.cluster``).

The last output line is one JSON object: ``speedup_vs_up``, ``speedup_vs_recompute``, ``cached_token_fraction``
(BAT), per-system summaries, the workload statistics.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from grserve.engine.ranking import RankingConfig, RankingRequest, RankingRunner, precompute_item_kv, _kv_store
from grserve.kvcache.item_pool import ItemKVPool
from grserve.model import load_model
from grserve.ranking.workload import WorkloadSpec, generate_workload

SYSTEMS = ("bat", "user_prefix", "item_prefix", "greedy_size", "recompute")
LABELS = {"bat": "BAT", "user_prefix": "UP", "item_prefix": "IP", "greedy_size": "greedy-by-size",
          "recompute": "recompute"}
BENCH_DTYPES = ("bfloat16", "float32")  # choices on the command line


def parse_args(argv):
    p = argparse.ArgumentParser(prog="grserve bench ranking",
                                description="BAT ranking throughput: hotness-aware prefix choice vs UP, IP, "
                                            "greedy-by-size and recompute on a synthetic trace.")
    p.add_argument("--model", default="tiny-bat",
                   help="preset or HF directory (default: tiny-bat, Qwen2-1.5B's linear-vs-attention FLOP mix at tiny cost)")
    p.add_argument("--dtype", default="float32", choices=sorted(BENCH_DTYPES))
    p.add_argument("--scale", type=float, default=1.0,
                   help="profile-length scale (default 1.0 = the paper's lengths; candidates stay 100)")
    p.add_argument("--full-scale", action="store_true", help="same as --scale 1.0")
    p.add_argument("--users", type=int, default=25, help="distinct users in the one-hour trace (default 25)")
    p.add_argument("--items", type=int, default=4000, help="catalog size (default 4000)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--user-cache-frac", type=float, default=0.1,
                   help="user-cache budget as a fraction of the distinct users' KV bytes (default 0.1)")
    p.add_argument("--user-cache-mb", type=float, default=None, help="user-cache budget in MiB (overrides frac)")
    p.add_argument("--window-s", type=float, default=1800.0, help="user frequency window W, seconds (default 1800)")
    p.add_argument("--batch", type=int, default=4, help="requests per batch (default 4)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--kv-workers", type=int, default=0, help="N >= 2: also compare HRCS / replicate / hash bytes")
    p.add_argument("--alpha", type=float, default=0.1, help="HRCS tolerable communication/computation ratio")
    p.add_argument("--link-gbps", type=float, default=10.0, help="HRCS link bandwidth (default 10 Gbps)")
    p.add_argument("--hrcs-prefill-s", type=float, default=None,
                   help="HRCS's t (seconds per IP prefill) in Algorithm 1 (default: measured in this run); e.g. 0.1 "
                        "to model a GPU prefill")
    p.add_argument("--hrcs-kv-bytes-per-token", type=int, default=None,
                   help="KV bytes per token for HRCS's link rate B in tokens/s (default: this model's); e.g. 28672 "
                        "for Qwen2-1.5B fp16 (bytes moved are still this model's real tensors)")
    p.add_argument("--ray", action="store_true", help="cluster mode with Ray actors (default: in-process workers)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    scale = 1.0 if a.full_scale else a.scale
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        print(f"grserve bench ranking: error: unknown system(s) {bad}; choose from {SYSTEMS}", file=sys.stderr)
        return 2
    console = Console(stderr=False)
    torch.manual_seed(a.seed)
    torch.set_num_threads(max(1, a.threads))
    model = load_model(a.model, dtype=a.dtype, seed=a.seed)
    spec = WorkloadSpec(num_items=a.items, num_users=a.users, scale=scale, seed=a.seed)
    reg, trace, wstats = generate_workload(spec, model.spec.vocab_size)
    bpt = model.spec.kv_bytes_per_token(torch.empty(0, dtype=model.dtype).element_size())
    distinct_user_bytes = sum(len(reg.user_tokens(u)) for u in {r.user_id for r in trace}) * bpt
    budget = int(a.user_cache_mb * 2**20) if a.user_cache_mb is not None else int(a.user_cache_frac * distinct_user_bytes)

    # the item-KV pool, precomputed once offline and shared (read-only) by every system
    t0 = time.perf_counter()
    item_tokens = sum(len(reg.item_tokens(i)) for i in reg.item_ids())
    pages = sum(-(-len(reg.item_tokens(i)) // a.page_size) for i in reg.item_ids())
    pool = ItemKVPool(_kv_store(model, (pages + 1) * a.page_size * bpt, a.page_size))
    print(f"precomputing the item KV pool: {reg.num_items} items, {item_tokens} tokens", file=sys.stderr)
    precompute_item_kv(model, [(i, reg.item_tokens(i)) for i in reg.item_ids()], pool.put, progress=True)
    precompute_s = time.perf_counter() - t0

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

    table = Table(title=f"BAT ranking bench — {len(reqs)} requests, scale {scale}, {a.threads} thread(s), user cache "
                        f"{budget / 2**20:.1f} MiB ({budget / max(distinct_user_bytes, 1):.0%} of distinct users' KV)")
    for col in ("system", "req/CPU-s", "req/wall-s", "speedup vs UP", "computed frac", "cached frac", "user hit", "item hit",
                "UP share", "evictions"):
        table.add_column(col, justify="right")
    base_up = summ.get("user_prefix", {}).get("throughput_rps")
    for s in systems:
        st = summ[s]
        table.add_row(LABELS[s], f"{st['throughput_rps']:.3f}", f"{st['throughput_wall_rps']:.3f}",
                      f"{st['throughput_rps'] / base_up:.2f}x" if base_up else "-",
                      f"{st['computed_token_fraction']:.3f}", f"{st['cached_token_fraction']:.3f}",
                      f"{st['user_hit_rate']:.3f}", f"{st['item_hit_rate']:.3f}", f"{st['up_share']:.2f}",
                      str(st["user_evictions"]))
    console.print(table)
    console.print(f"cacheable ceiling of this trace (unbounded user cache, every request its larger prefix): "
                  f"{wstats['cacheable_share_ceiling']:.3f} of user + item tokens")

    out = {
        "scale": scale, "requests": len(reqs), "batch": a.batch, "threads": a.threads, "timing": "process_cpu", "user_cache_bytes": budget,
        "user_cache_fraction_of_distinct_users": budget / max(distinct_user_bytes, 1),
        "item_pool_bytes": pool.used_bytes, "precompute_s": precompute_s, "kv_bytes_per_token": bpt,
        "workload": wstats,
    }
    if "bat" in summ:
        bat = summ["bat"]["throughput_rps"]
        for s, key in (("user_prefix", "speedup_vs_up"), ("recompute", "speedup_vs_recompute"),
                       ("item_prefix", "speedup_vs_ip"), ("greedy_size", "speedup_vs_greedy")):
            if s in summ:
                out[key] = bat / summ[s]["throughput_rps"]
                out[key + "_wall"] = summ["bat"]["throughput_wall_rps"] / summ[s]["throughput_wall_rps"]
                out[key.replace("speedup", "computed_token_ratio")] = summ[s]["computed_tokens"] / max(
                    summ["bat"]["computed_tokens"], 1)
        out["cached_token_fraction"] = summ["bat"]["cached_token_fraction"]
        if "user_prefix" in summ:
            out["computed_token_ratio_up_over_bat"] = summ["user_prefix"]["computed_tokens"] / max(
                summ["bat"]["computed_tokens"], 1)
    out["systems"] = {s: {k: v for k, v in summ[s].items()} for s in systems}
    if a.kv_workers >= 2:
        from grserve.cluster.hrcs import compare_placements

        measured = wall.get("item_prefix", 0) / max(len(reqs), 1)
        if a.hrcs_prefill_s is None and not measured:
            print("grserve bench ranking: note: item_prefix was not run, so HRCS's prefill time t is 0 "
                  "(everything replicated); pass --hrcs-prefill-s", file=sys.stderr)
        cl = compare_placements(trace, reg, pool, workers=a.kv_workers, alpha=a.alpha, link_gbps=a.link_gbps,
                                kv_bytes_per_token=a.hrcs_kv_bytes_per_token or bpt,
                                prefill_s=a.hrcs_prefill_s if a.hrcs_prefill_s is not None else measured,
                                use_ray=a.ray)
        out["cluster"] = cl
        ct = Table(title=f"item KV placement over {a.kv_workers} KV-cache workers (IP requests of the trace)")
        for col in ("placement", "replication ratio", "item KV bytes / worker", "remote items", "bytes moved",
                    "moved / request"):
            ct.add_column(col, justify="right")
        for name, r in cl["placements"].items():
            ct.add_row(name, f"{r['replication_ratio']:.3f}", f"{r['bytes_per_worker'] / 2**20:.1f} MiB",
                       f"{r['remote_item_fraction']:.3f}", f"{r['bytes_moved'] / 2**20:.1f} MiB",
                       f"{r['bytes_moved_per_request'] / 2**10:.1f} KiB")
        console.print(ct)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
