"""Ranking instances on Ray: does routing by the user's cached KV keep users' KV hits across instances?

    python -m grserve_bench.cluster_gr [--instances 2] [--requests 160] [--policies kv,round_robin,least_loaded]

(not a ``grserve bench`` command: a quick check of ``serve ranking --instances N``; docs/cluster.md). Every policy
gets fresh instances (empty user caches) and the same requests: users drawn Zipf-like from a synthetic registry,
random candidates, ``--concurrency`` requests in flight. Each instance's user cache holds ``--cache-share`` of all
users' KV, so one instance cannot hold everyone but the instances together can: routing by the user's KV
partitions the users, round robin makes every instance cycle through all of them. The prefix policy is
``user_prefix`` (every request reads / admits the user's KV), so the hit rate is the router's doing alone.
Last line: one JSON object — per policy the user-cache hit rate, computed-token fraction, mean and P99 latency,
requests per instance; ``hit_rate_kv_over_rr`` and ``latency_rr_over_kv``.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _requests(reg, n: int, candidates: int, seed: int) -> list:
    from grserve.engine.ranking_runner import RankingRequest

    rng = np.random.default_rng(seed)
    users, items = reg.user_ids(), reg.item_ids()
    weights = 1.0 / np.arange(1, len(users) + 1) ** 0.8
    picks = rng.choice(len(users), n, p=weights / weights.sum())
    out = []
    for k, u in enumerate(picks):
        cands = [int(i) for i in rng.choice(items, candidates, replace=False)]
        uid = users[u]
        out.append(RankingRequest(reg.user_tokens(uid), [reg.item_tokens(i) for i in cands], user_id=uid,
                                  item_ids=cands, top_k=5, request_id=f"r{k}"))
    return out


def _cache_bytes(args, vocab_size: int) -> int:
    """``--cache-share`` of the pages every user's KV takes (the tiny preset's KV bytes per token)."""
    from grserve.config import RankingConfig, RankingDataConfig
    from grserve.model.spec import PRESETS
    from grserve.ranking.startup_data import build_registry

    reg = build_registry(RankingDataConfig(num_items=args.items, num_users=args.users, seed=args.seed), vocab_size)
    page = RankingConfig().page_size
    pages = sum(-(-len(reg.user_tokens(u)) // page) for u in reg.user_ids())
    spec = PRESETS["tiny"]
    per_token = spec.kv_bytes_per_token(4)
    return int(pages * args.cache_share) * page * per_token


def run_policy(policy: str, args, cache_bytes: int) -> dict:
    import dataclasses

    from grserve.cluster.gr.modes import ClusterRankingEngine
    from grserve.config import ClusterConfig, RankingConfig, RankingDataConfig, RankingServeConfig

    cfg = RankingServeConfig(ranking=RankingConfig(policy="user_prefix", user_cache_bytes=cache_bytes),
                             data=RankingDataConfig(num_items=args.items, num_users=args.users, seed=args.seed))
    cc = ClusterConfig(instances=args.instances, routing=policy, heartbeat_timeout_s=5.0)
    eng = ClusterRankingEngine.launch(cfg, cc).start()
    try:
        reqs = _requests(eng.registry, args.requests, args.candidates, args.seed)

        def one(req):
            t0 = time.perf_counter()
            eng.submit(dataclasses.replace(req)).future.result(300)
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            lat = list(pool.map(one, reqs))
        wall = time.perf_counter() - t0
        time.sleep(2 * cc.poll_wait_s)  # the last polls: the instances' stats
        s = eng.runner.stats.summary()
        return {"user_hit_rate": round(s["user_hit_rate"], 4),
                "computed_token_fraction": round(s["computed_token_fraction"], 4),
                "latency_mean_s": round(float(np.mean(lat)), 4), "latency_p99_s": round(float(np.percentile(lat, 99)), 4),
                "wall_s": round(wall, 2), "requests_per_instance": list(eng.router.routed),
                "decisions": dict(eng.router.decisions)}
    finally:
        eng.stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--users", type=int, default=24)
    p.add_argument("--items", type=int, default=300)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--candidates", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--cache-share", type=float, default=0.6, help="one instance's user cache / all users' KV")
    p.add_argument("--policies", default="kv,round_robin")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import ray

    from grserve.cluster.core.ray_runtime import start_ray

    owns = start_ray(None)
    try:
        from grserve.model.spec import PRESETS

        cache = _cache_bytes(args, PRESETS["tiny"].vocab_size)
        out: dict = {"instances": args.instances, "users": args.users, "requests": args.requests,
                     "user_cache_bytes": cache}
        for policy in args.policies.split(","):
            out[policy] = run_policy(policy, args, cache)
            print(f"{policy}: {out[policy]}", flush=True)
        if "kv" in out and "round_robin" in out:
            rr, kv = out["round_robin"], out["kv"]
            out["hit_rate_kv_over_rr"] = round(kv["user_hit_rate"] / max(rr["user_hit_rate"], 1e-9), 3)
            out["latency_rr_over_kv"] = round(rr["latency_mean_s"] / kv["latency_mean_s"], 3)
    finally:
        if owns:
            ray.shutdown()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
