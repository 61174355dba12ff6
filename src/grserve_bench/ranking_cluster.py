"""``grserve bench ranking --instances N``: BAT's item-KV placement as served (``serve ranking --instances N``).

The bench's trace (same users, items and requests as the in-process systems) runs on a real ranking cluster on a
local Ray: N instances of the BAT engine and N KV-cache workers holding the item KV (``grserve.cluster.gr``). No
instance precomputes an item pool; they read candidates' KV from the workers. Two phases:

1. the first half of the trace under the start-up placement — no history, so every item on one home worker
   (sharded, r = 0);
2. one re-placement (``ItemKVMetaService.replace``: Algorithm 1 on the hotness the first half served), then the
   second half.

Reported: the item KV each instance's worker holds against full replication (every instance holding the whole pool,
``--kv-cache-workers 0``), and the fetch cost per item-as-prefix request: items and bytes read from another
instance's worker, the time spent fetching (Ray object transfers between processes on this machine), and the
serialized transfer time those bytes would take at ``--link-gbps``. ``--hrcs-prefill-s`` / ``--hrcs-kv-bytes-per-
token`` set Algorithm 1's t and the KV size behind B as in ``--kv-workers`` (the bytes moved stay this model's).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

COUNTERS = ("items_fetched", "items_fetched_remote", "item_bytes_fetched_remote", "item_fetch_failures")
RUNNER = ("requests", "ip_requests", "item_fetch_s", "cached_item_tokens", "computed_tokens", "total_tokens")


def _write(reg, folder: Path) -> tuple[str, str]:
    items, users = folder / "items.jsonl", folder / "users.jsonl"
    items.write_text("".join(json.dumps({"item_id": i, "tokens": reg.item_tokens(i).tolist()}) + "\n"
                             for i in reg.item_ids()))
    users.write_text("".join(json.dumps({"user_id": u, "tokens": reg.user_tokens(u).tolist()}) + "\n"
                             for u in reg.user_ids()))
    return str(items), str(users)


def _totals(eng) -> dict[str, float]:
    time.sleep(3 * eng.cc.poll_wait_s)  # the instances' counters arrive with their polls
    st = eng.runner.stats
    out = {k: float(sum(inst.stats.get(k, 0) for inst in eng.instances)) for k in COUNTERS}
    return {**out, **{k: float(getattr(st, k)) for k in RUNNER}}


def _phase(eng, reg, trace, window: int, link_gbps: float, tag: str) -> dict:
    from grserve.engine.types import RankingRequest

    before, t0, pending = _totals(eng), time.perf_counter(), []
    for k, r in enumerate(trace):
        if len(pending) >= window:
            pending.pop(0).future.result(600)
        pending.append(eng.submit(RankingRequest(reg.user_tokens(r.user_id), [reg.item_tokens(i) for i in r.item_ids],
                                                 user_id=r.user_id, item_ids=list(r.item_ids), top_k=10, now=r.time_s,
                                                 request_id=f"{tag}{k}")))
    for h in pending:
        h.future.result(600)
    wall = time.perf_counter() - t0
    d = {k: v - before[k] for k, v in _totals(eng).items()}
    ip = max(d["ip_requests"], 1)
    return {"requests": int(d["requests"]), "ip_requests": int(d["ip_requests"]), "wall_s": wall,
            "throughput_rps": d["requests"] / wall,
            "cached_item_token_fraction": d["cached_item_tokens"] / max(d["total_tokens"], 1),
            "items_fetched_per_ip_request": d["items_fetched"] / ip,
            "remote_item_fraction": d["items_fetched_remote"] / max(d["items_fetched"], 1),
            "remote_bytes_per_ip_request": d["item_bytes_fetched_remote"] / ip,
            "fetch_ms_per_ip_request": 1e3 * d["item_fetch_s"] / ip,
            "transfer_ms_per_ip_request_at_link": 1e3 * d["item_bytes_fetched_remote"] / ip / (link_gbps * 1e9 / 8),
            "fetch_failures": int(d["item_fetch_failures"])}


def _held(eng) -> list[float]:
    time.sleep(3 * eng.cc.poll_wait_s)  # the workers' stored bytes arrive with their polls
    return [w.stats.get("stored_bytes", 0.0) for w in eng.item_kv.workers]


def run_cluster(a) -> dict:
    """The two phases on ``a.instances`` instances; returns the JSON's ``cluster_served`` part."""
    import torch

    from grserve.cluster.gr.modes import ClusterRankingEngine
    from grserve.config import (ClusterConfig, HRCSConfig, ModelConfig, RankingConfig, RankingDataConfig,
                                RankingServeConfig)
    from grserve.model.loader import resolve_dtype, resolve_spec
    from grserve.ranking.workload import WorkloadSpec
    from grserve_bench.ranking_trace import generate_workload

    spec = resolve_spec(a.model)
    bpt = spec.kv_bytes_per_token(torch.empty(0, dtype=resolve_dtype(a.dtype)).element_size())
    scale = 1.0 if a.full_scale else a.scale
    reg, trace, _ = generate_workload(WorkloadSpec(num_items=a.items, num_users=a.users, scale=scale, seed=a.seed),
                                      spec.vocab_size)
    link = a.link_gbps * bpt / (a.hrcs_kv_bytes_per_token or bpt)  # the same B in tokens/s for this model's KV
    distinct_user_bytes = sum(len(reg.user_tokens(u)) for u in {r.user_id for r in trace}) * bpt
    budget = int(a.user_cache_mb * 2**20) if a.user_cache_mb is not None else int(a.user_cache_frac *
                                                                                  distinct_user_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        items_file, users_file = _write(reg, Path(tmp))
        cfg = RankingServeConfig(
            model=ModelConfig(source=a.model, dtype=a.dtype, seed=a.seed),
            ranking=RankingConfig(policy="bat", user_cache_bytes=budget, page_size=a.page_size,
                                  user_window_s=a.window_s, write_back_items=False),
            data=RankingDataConfig(items_file=items_file, users_file=users_file,
                                   instruction=",".join(str(int(t)) for t in reg.instruction)),
            hrcs=HRCSConfig(hrcs_alpha=a.alpha, hrcs_link_gbps=link, hrcs_prefill_s=a.hrcs_prefill_s,
                            hrcs_interval_s=0),
            cluster=ClusterConfig(instances=a.instances, instance_threads=a.threads, heartbeat_timeout_s=30.0,
                                  restart_instances=False))
        t0 = time.perf_counter()
        eng = ClusterRankingEngine.launch(cfg, cfg.cluster).start()
    startup = time.perf_counter() - t0
    try:
        window, half = a.batch * a.instances, len(trace) // 2
        sharded = _phase(eng, reg, trace[:half], window, a.link_gbps, "s")
        held_sharded = _held(eng)
        ratio = eng.item_kv.replace()
        replaced = _phase(eng, reg, trace[half:], window, a.link_gbps, "r")
        held_replaced = _held(eng)
        replicated = len(eng.item_kv.placed.placement.replicated)
    finally:
        eng.stop()
    pages = sum(-(-len(reg.item_tokens(i)) // a.page_size) for i in reg.item_ids())
    full = pages * a.page_size * bpt
    return {"instances": a.instances, "kv_cache_workers": a.instances, "items": reg.num_items,
            "requests": len(trace), "startup_s": startup, "link_gbps": a.link_gbps,
            "hrcs_prefill_s": a.hrcs_prefill_s, "replication_ratio": ratio, "replicated_items": replicated,
            "item_kv_full_replication_bytes_per_instance": full,
            "item_kv_bytes_per_instance": {"sharded": held_sharded, "after_replacement": held_replaced},
            "item_kv_memory_vs_full_replication": {"sharded": max(held_sharded) / full,
                                                   "after_replacement": max(held_replaced) / full},
            "phases": {"sharded": sharded, "after_replacement": replaced}}


def print_cluster(console, out: dict) -> None:
    from rich.table import Table

    full = out["item_kv_full_replication_bytes_per_instance"]
    t = Table(title=f"served HRCS: {out['instances']} instances + {out['kv_cache_workers']} KV-cache workers, "
                    f"{out['items']:,} items (full replication: {full / 2**20:.1f} MiB per instance)")
    for col in ("phase", "item KV / instance", "vs full", "remote items", "remote KiB / IP req", "fetch ms / IP req",
                f"ms at {out['link_gbps']:g} Gbps", "req/s"):
        t.add_column(col, justify="right")
    for name, label in (("sharded", "sharded (r = 0)"),
                        ("after_replacement", f"hot replicated (r = {out['replication_ratio'] or 0:.3f})")):
        p, held = out["phases"][name], out["item_kv_bytes_per_instance"][name]
        t.add_row(label, f"{max(held) / 2**20:.1f} MiB", f"{max(held) / full:.2f}", f"{p['remote_item_fraction']:.3f}",
                  f"{p['remote_bytes_per_ip_request'] / 2**10:.0f}", f"{p['fetch_ms_per_ip_request']:.1f}",
                  f"{p['transfer_ms_per_ip_request_at_link']:.2f}", f"{p['throughput_rps']:.2f}")
    console.print(t)
