"""Hot-Replicated Cold-Sharded (HRCS) item-KV placement (BAT §5.2, Algorithm 1) and its baselines.

``compute_replication_ratio`` is Algorithm 1 as printed:

    t ← PrefillTime(τ_u, c·τ_i);  T_max ← α·t;  S_item ← τ_i
    R_max ← T_max · B · (N−1) / (c · S_item · N)
    sort F descending; r ← the first i/|F| whose CDF ≥ 1 − R_max

with the (N−1)/N factor configurable (``factor="paper"``, default, as printed; ``factor="derived"`` uses N/(N−1),
the reciprocal that a direct derivation gives: a request on one of N nodes finds a sharded item remote with
probability (N−1)/N, so remote tokens = c·τ_i·R·(N−1)/N ≤ α·t·B). F is normalised here. N = 1 → r = 1
(everything is local). B is tokens/s per link (link bytes/s ÷ KV bytes per token).

Placements: ``hrcs`` (top r·|F| items on every worker, the rest round-robin over workers in hotness order — an
even split of both items and load), ``replicate`` (every item everywhere), ``hash`` (item id mod N).
Every item has a *home* worker that always holds it; replicas are extra copies. ``ReReplicator`` recomputes the
replicated set from the meta service's item hotness in the background and moves only the difference.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

FACTORS = ("paper", "derived")


def max_comm_ratio(alpha: float, prefill_s: float, bandwidth_tps: float, candidates: int, item_tokens: float,
                   workers: int, factor: str = "paper") -> float:
    if factor not in FACTORS:
        raise ValueError(f"factor must be one of {FACTORS}, got {factor!r}")
    if workers <= 1:
        return 0.0
    t_max = alpha * prefill_s
    n = workers
    f = (n - 1) / n if factor == "paper" else n / (n - 1)
    return t_max * bandwidth_tps * f / (candidates * item_tokens)


def compute_replication_ratio(bandwidth_tps: float, freq: Iterable[float], tau_u: float, tau_i: float, alpha: float,
                              candidates: int, workers: int,
                              prefill_time: Callable[[float, float], float] | float, factor: str = "paper") -> float:
    """Algorithm 1. ``prefill_time(τ_u, c·τ_i)`` (seconds) or a measured constant."""
    f = np.sort(np.asarray(list(freq), dtype=np.float64))[::-1]
    if f.size == 0:
        return 0.0
    if workers <= 1:
        return 1.0
    t = prefill_time(tau_u, candidates * tau_i) if callable(prefill_time) else float(prefill_time)
    r_max = max_comm_ratio(alpha, t, bandwidth_tps, candidates, tau_i, workers, factor)
    total = f.sum()
    if total <= 0:
        return 0.0
    cdf = np.cumsum(f / total)
    i = int(np.searchsorted(cdf, 1.0 - r_max - 1e-12, side="left"))  # first index with CDF ≥ 1 − R_max
    return min(i + 1, f.size) / f.size


@dataclass
class Placement:
    name: str
    workers: int
    home: dict[int, int]  # item → the worker that always holds it
    replicated: set[int] = field(default_factory=set)  # items held by every worker

    def owners(self, item: int) -> frozenset[int]:
        if item in self.replicated:
            return frozenset(range(self.workers))
        return frozenset((self.home[item],))

    def items_on(self, worker: int) -> list[int]:
        return [i for i, w in self.home.items() if w == worker or i in self.replicated]

    @property
    def replication_ratio(self) -> float:
        return len(self.replicated) / max(len(self.home), 1)


def _by_hotness(items: Iterable[int], freq: Mapping[int, float]) -> list[int]:
    return sorted(items, key=lambda i: (-freq.get(i, 0.0), i))


def hrcs_placement(items: Iterable[int], freq: Mapping[int, float], ratio: float, workers: int) -> Placement:
    order = _by_hotness(items, freq)
    k = min(len(order), int(math.ceil(ratio * len(order) - 1e-9)))
    replicated = set(order[:k])
    home = {i: n % workers for n, i in enumerate(order[k:])}
    home.update({i: i % workers for i in order[:k]})
    return Placement("hrcs", workers, home, replicated)


def replicate_placement(items: Iterable[int], workers: int) -> Placement:
    items = list(items)
    return Placement("replicate", workers, {i: i % workers for i in items}, set(items))


def hash_placement(items: Iterable[int], workers: int) -> Placement:
    return Placement("hash", workers, {i: i % workers for i in items}, set())


class ReReplicator:
    """Background re-replication: keep the replicated area = the currently hottest ``count`` items.

    ``step(freq)`` computes the new top set, copies newly hot items from their home worker to every other worker
    and drops cooled replicas (the home copy stays). ``start(interval_s, freq_fn)`` runs it on a thread.
    """

    def __init__(self, placement: Placement, workers: list, count: int | None = None):
        self.placement = placement
        self.workers = workers  # KVWorkerHandle list
        self.count = len(placement.replicated) if count is None else count
        self.bytes_moved = 0
        self.rounds = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def step(self, freq: Mapping[int, float]) -> tuple[set[int], set[int]]:
        with self._lock:
            p = self.placement
            new = set(_by_hotness(p.home, freq)[: self.count])
            add, drop = new - p.replicated, p.replicated - new
            for item in sorted(drop):
                for w, h in enumerate(self.workers):
                    if w != p.home[item]:
                        h.call("drop_items", [item])
            for item in sorted(add):
                kv = self.workers[p.home[item]].call("get_items", [item])
                for w, h in enumerate(self.workers):
                    if w != p.home[item]:
                        h.call("put_items", [item], kv, [int(kv.shape[2])])
                        self.bytes_moved += kv.numel() * kv.element_size()
            p.replicated = new
            self.rounds += 1
            return add, drop

    def start(self, interval_s: float, freq_fn: Callable[[], Mapping[int, float]]) -> None:
        def loop():
            while not self._stop.wait(interval_s):
                self.step(freq_fn())

        self._thread = threading.Thread(target=loop, name="grserve-rereplicate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def compare_placements(trace, registry, pool, *, workers: int, alpha: float, link_gbps: float, kv_bytes_per_token: int,
                       prefill_s: float, use_ray: bool = False, factor: str = "paper") -> dict:
    """Replay the IP item reads of a trace on ``workers`` KV-cache workers under HRCS / replicate / hash.

    Item frequency F is taken from the first half of the trace (the "past period"); the second half is replayed.
    Request k is served by the inference worker colocated with KV-cache worker k mod N; its candidates' KV are
    fetched through ``ClusterItemSource`` (remote ones through Ray when ``use_ray``), which counts bytes moved.
    """
    from grserve.cluster.gr.kv_workers import ClusterItemSource, start_workers, stop_workers

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
    placements = [hrcs_placement(items, freq, ratio, workers), replicate_placement(items, workers),
                  hash_placement(items, workers)]
    out = {"workers": workers, "alpha": alpha, "link_gbps": link_gbps, "bandwidth_tokens_per_s": b_tps,
           "prefill_s": prefill_s, "factor": factor, "ray": use_ray,
           "r_max": max_comm_ratio(alpha, prefill_s, b_tps, c, tau_i, workers, factor), "placements": {}}
    for p in placements:
        handles = start_workers(p, pool, use_ray=use_ray)
        try:
            sources = [ClusterItemSource(w, handles, p) for w in range(workers)]
            for k, r in enumerate(replay):
                sources[k % workers].fetch(list(r.item_ids))
            moved = sum(s.bytes_moved for s in sources)
            stored = [h.call("stored_bytes") for h in handles]
            out["placements"][p.name] = {
                "replication_ratio": p.replication_ratio, "bytes_moved": moved,
                "bytes_moved_per_request": moved / max(len(replay), 1),
                "remote_item_fraction": sum(s.remote_items for s in sources) / max(sum(s.items for s in sources), 1),
                "bytes_per_worker": max(stored), "transfer_s_at_link": moved / (link_gbps * 1e9 / 8),
            }
        finally:
            stop_workers(handles)
    return out
