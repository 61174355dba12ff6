"""``grserve bench ranking --kv-workers N``: HRCS against its baselines on a trace, counted from the placement.

The placements (BAT §6.4's ablation): ``hrcs`` (``grserve.cluster.gr.hrcs``: Algorithm 1's hot items on every
worker, the rest sharded), ``replicate`` (every item everywhere: BAT-Replicate) and ``hash`` (item id mod N:
BAT-Hash). Item frequency F is taken from the first half of the trace (the "past period"); the second half is
replayed: request k runs on the inference worker colocated with KV-cache worker k mod N, and every candidate whose
KV that worker does not hold is fetched from its home — its bytes are what a fetch moves (the real KV bytes of this
model's pool entries). The served placement (``serve ranking --instances N``, real fetches between Ray actors) is
measured by ``bench ranking --instances N`` (``ranking_cluster.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from grserve.cluster.gr.hrcs import (Placement, compute_replication_ratio, hrcs_placement, max_comm_ratio)


def replicate_placement(items: Iterable[int], workers: int) -> Placement:
    items = list(items)
    return Placement("replicate", workers, {i: i % workers for i in items}, set(items))


def hash_placement(items: Iterable[int], workers: int) -> Placement:
    return Placement("hash", workers, {i: i % workers for i in items}, set())


def _replay(p: Placement, replay, pool, workers: int) -> dict:
    store = pool.store
    moved = remote = total = 0
    for k, r in enumerate(replay):
        here = k % workers
        for i in r.item_ids:
            if i not in pool:
                continue
            total += 1
            if here not in p.owners(i):
                remote += 1
                moved += store.length(i) * store.bytes_per_token
    held = [sum(store.entry_pages(i) for i in p.items_on(w) if i in pool) * store.bytes_per_page
            for w in range(workers)]
    return {"replication_ratio": p.replication_ratio, "bytes_moved": moved,
            "bytes_moved_per_request": moved / max(len(replay), 1), "remote_item_fraction": remote / max(total, 1),
            "bytes_per_worker": max(held)}


def compare_placements(trace, registry, pool, *, workers: int, alpha: float, link_gbps: float,
                       kv_bytes_per_token: int, prefill_s: float, factor: str = "paper") -> dict:
    """HRCS (r from Algorithm 1 on the first half's F), full replication and hash sharding on the second half."""
    half = len(trace) // 2
    hist, replay = trace[:half], trace[half:]
    freq: dict[int, float] = {}
    for r in hist:
        for i in r.item_ids:
            freq[i] = freq.get(i, 0.0) + 1.0
    items = registry.item_ids()
    c = len(trace[0].item_ids)
    tau_i = float(np.mean([len(registry.item_tokens(i)) for i in items]))
    tau_u = float(np.mean([len(registry.user_tokens(r.user_id)) for r in trace]))
    b_tps = link_gbps * 1e9 / 8 / kv_bytes_per_token
    ratio = compute_replication_ratio(b_tps, [freq.get(i, 0.0) for i in items], tau_u, tau_i, alpha, c, workers,
                                      prefill_s, factor)
    out = {"workers": workers, "alpha": alpha, "link_gbps": link_gbps, "bandwidth_tokens_per_s": b_tps,
           "prefill_s": prefill_s, "factor": factor,
           "r_max": max_comm_ratio(alpha, prefill_s, b_tps, c, tau_i, workers, factor), "placements": {}}
    for p in (hrcs_placement(items, freq, ratio, workers), replicate_placement(items, workers),
              hash_placement(items, workers)):
        res = _replay(p, replay, pool, workers)
        res["transfer_s_at_link"] = res["bytes_moved"] / (link_gbps * 1e9 / 8)
        out["placements"][p.name] = res
    return out


def print_placements(console, cl: dict) -> None:
    from rich.table import Table

    ct = Table(title=f"item KV placement over {cl['workers']} KV-cache workers (IP requests of the trace)")
    for col in ("placement", "replication ratio", "item KV bytes / worker", "remote items", "bytes moved",
                "moved / request"):
        ct.add_column(col, justify="right")
    for name, r in cl["placements"].items():
        ct.add_row(name, f"{r['replication_ratio']:.3f}", f"{r['bytes_per_worker'] / 2**20:.1f} MiB",
                   f"{r['remote_item_fraction']:.3f}", f"{r['bytes_moved'] / 2**20:.1f} MiB",
                   f"{r['bytes_moved_per_request'] / 2**10:.1f} KiB")
    console.print(ct)
