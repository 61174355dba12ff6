"""``grserve bench prefix``: GR retrieval with and without prompt-prefix KV reuse (``kvcache/prefix_blocks.py``).

Two workloads, each replayed through the real retrieval engine with the cache off and on (the same model, catalog,
batches and beam width; every engine advances batch by batch in lockstep, so the machine's load falls on all of
them alike), and a third that measures the cache's cost where it cannot help:

* **instruction**: chat prompts in OneRec's format (``<|im_start|>system … <|im_end|><|im_start|>user …``) as token
  ids: one shared system prompt + instruction of ``--instruction-tokens`` (256), then a user history of 20–100
  Amazon Beauty items (each ``<|sid_begin|>`` + its 4 SID tokens + ``<|sid_end|>``), then the assistant header.
  Every request is another user: only the instruction repeats.
* **returning**: Amazon Beauty's sequences (the bundled dataset, ``beauty/data.py``) as visits: a user's k-th visit
  asks with the first k items of their sequence (4 SID tokens each, newest last, at most ``--max-prompt-tokens``).
  Users with at least ``--min-items`` items, ``--users`` of them drawn with a seed; they arrive in a heavy-tailed
  order (each arrival picks a user by Zipf(``--zipf``) over a random ranking; a user whose sequence is used up is
  not picked again).
* **routing** (``--instances``, no model): the returning trace through ``--instances`` prefix caches behind the
  cluster's ``Router`` and ``GlobalKVIndex`` (the wiring of ``serve --instances N``), ``kv`` routing vs
  ``round_robin``; each window of 2 × ``--batch`` requests is routed together, then served, then released.
* **cold**: new users only (first visits of histories of the returning workload's lengths, no shared prefix), sent
  to an engine whose cache is already full: the cache's overhead (a lookup, a store, its copies) with no hit.

Cache sizes are fractions (``--sizes``: 1, 5, 10, 25 %) of the replay's distinct prefix tokens (distinct full
blocks × block size). For each size and policy the hit rate (prompt tokens loaded / prompt tokens) comes from a
replay of the trace through ``PrefixBlockCache`` itself with K/V of one element (what the engine's cache does, batch
by batch: all loads of a batch, then all stores). libcachesim's heuristics (ARC, S3FIFO, LIRS, Cacheus, LeCaR) cannot
drive the engine's cache; as ``bench cache --trace-file`` does, they replay the flattened block-key sequence as
independent items (block mode), and so do grserve's policies for a like-for-like comparison: block mode counts a
cached block after a miss as a hit, which the engine cannot use, so it flatters every policy alike.

Engines (``--engine-runs``): the cache off, and the cache on at the sizes and policies listed; throughput is
requests / Σ batch wall time (closed loop: one batch at a time, no queueing), latency a request's batch time
(p50 / p99), and every on-engine's beams are compared with the off-engine's (items in order, scores ≤ 1e-4).
The last stdout line is one JSON object with every number (``rows``) and the goals as measured (``goals``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from grserve.flags import Checked, comma_list, config_command, flag, fraction, positive, positive_int
from grserve_bench.machine import machine_info

POLICIES = ("lru", "laru", "leader", "density", "lfu")
TOL = 1e-4
LCS_MIN_BLOCKS = 16


@dataclass(frozen=True)
class PrefixBenchConfig(Checked):
    """The knobs of ``grserve bench prefix``."""

    workloads: str = flag("instruction,returning,cold", "comma-separated workloads",
                          check=comma_list(allowed=("instruction", "returning", "cold")))
    model: str = flag("tiny", "model preset or directory (random weights for a preset; Qwen3-shaped: tiny)")
    beam_width: int = flag(64, "beam width of every request", check=positive_int)
    batch: int = flag(8, "requests per engine batch", check=positive_int)
    block_size: int = flag(16, "tokens per prefix block", check=positive_int)
    sizes: str = flag("0.01,0.05,0.1,0.25", "cache sizes as fractions of the replay's distinct prefix tokens",
                      check=comma_list(float, each=fraction))
    policies: str = flag("lru,laru,leader", "grserve policies replayed for hit rates (libcachesim's are added)",
                         check=comma_list(str.lower, allowed=POLICIES))
    engine_runs: str = flag("returning:0.01:leader,returning:0.05:leader,returning:0.1:lru,returning:0.1:laru,"
                            "returning:0.1:leader,returning:0.25:leader,instruction:0.1:lru,instruction:0.1:laru,"
                            "instruction:0.1:leader",
                            "the cache-on engines run for throughput and latency: WORKLOAD:SIZE:POLICY,... (the "
                            "cache-off engine always runs; cold: the best returning engine's settings)")
    instruction_tokens: int = flag(256, "instruction workload: tokens of the shared system prompt + instruction",
                                   check=positive_int)
    instruction_requests: int = flag(96, "instruction workload: requests (each a new user)", check=positive_int)
    visits: int = flag(1200, "returning workload: visits (the hit-rate replay and the engines replay the same ones)",
                       check=positive_int)
    users: int = flag(400, "returning workload: users drawn", check=positive_int)
    min_items: int = flag(20, "returning workload: only users with at least this many items", check=positive_int)
    zipf: float = flag(1.0, "returning workload: Zipf exponent of the arrival order", check=positive)
    max_prompt_tokens: int = flag(1024, "longest prompt (a returning user's oldest items are dropped beyond it)",
                                  check=positive_int)
    cold_batches: int = flag(16, "cold workload: batches", check=positive_int)
    instances: int = flag(2, "returning workload: instances of the routing replay (1: none)", check=positive_int)
    routing_policy: str = flag("leader", "eviction policy of the routing replay's caches", check=comma_list(
        str.lower, allowed=POLICIES))
    threads: int = flag(1, "torch threads (1: steadier on a shared machine)", check=positive_int)
    seed: int = flag(0, "seed of every draw")
    out: str | None = flag(None, "also write the JSON here", metavar="FILE")


def add_command(sub) -> None:
    config_command(sub, "prefix", help="GR retrieval with prompt-prefix KV reuse vs without (instruction, "
                                       "returning users, cold users)", cls=PrefixBenchConfig, run=run,
                   description=__doc__)


# ---- workloads ------------------------------------------------------------------------------------------------------
@dataclass
class Trace:
    name: str
    prompts: list[np.ndarray]
    block_size: int
    paths: list[list[int]] = field(default_factory=list)  # each prompt's full-block hashes

    def __post_init__(self) -> None:
        from grserve.kvcache.block_hash import chained_block_hashes

        self.paths = [chained_block_hashes(p, self.block_size) for p in self.prompts]

    @property
    def distinct_prefix_tokens(self) -> int:
        return len({h for p in self.paths for h in p}) * self.block_size

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def _beauty():
    from grserve.beauty.data import load_sid_dataset

    return load_sid_dataset()


class ChatFormat:
    """OneRec-like token ids on top of the catalog's arithmetic SID tokens (``token_offset`` 16, 4 × 256 codes):
    specials just below the vocabulary's end, text tokens from a range no SID token uses."""

    def __init__(self, vocab: int, rng: np.random.Generator, instruction_tokens: int):
        self.im_start, self.im_end, self.sid_begin, self.sid_end = vocab - 4, vocab - 3, vocab - 2, vocab - 1
        text = rng.integers(2000, vocab - 8, instruction_tokens + 8)
        self.system = np.concatenate([[self.im_start], text[:instruction_tokens - 2], [self.im_end]])
        self.user_head = np.array([self.im_start, int(text[-8]), int(text[-7])])
        self.tail = np.array([self.im_end, self.im_start, int(text[-6]), int(text[-5])])

    def prompt(self, sid_tokens: np.ndarray) -> np.ndarray:
        """sid_tokens [n_items, depth] → system + instruction, user turn with the wrapped items, assistant header."""
        n = sid_tokens.shape[0]
        wrapped = np.concatenate([np.full((n, 1), self.sid_begin), sid_tokens, np.full((n, 1), self.sid_end)], 1)
        return np.concatenate([self.system, self.user_head, wrapped.ravel(), self.tail]).astype(np.int64)


def instruction_trace(cfg: PrefixBenchConfig, data, layout, vocab: int) -> Trace:
    rng = np.random.default_rng(cfg.seed)
    fmt = ChatFormat(vocab, rng, cfg.instruction_tokens)
    prompts = []
    for _ in range(cfg.instruction_requests):
        items = rng.choice(data.item_ids, int(rng.integers(20, 101)), replace=False)
        prompts.append(fmt.prompt(layout.sid_tokens(items)))
    return Trace("instruction", prompts, cfg.block_size)


def returning_trace(cfg: PrefixBenchConfig, data, layout) -> tuple[Trace, list[int]]:
    """The visits in arrival order, and each visit's k (its number of items)."""
    rng = np.random.default_rng(cfg.seed + 1)
    long = [s for s in data.sequences if len(s) >= cfg.min_items]
    pick = rng.choice(len(long), min(cfg.users, len(long)), replace=False)
    users = [long[i] for i in pick]
    weights = 1.0 / np.arange(1, len(users) + 1) ** cfg.zipf
    next_k = [1] * len(users)
    max_items = cfg.max_prompt_tokens // layout.depth
    prompts, ks = [], []
    live = np.ones(len(users), dtype=bool)
    while len(prompts) < cfg.visits and live.any():
        w = weights * live
        u = int(rng.choice(len(users), p=w / w.sum()))
        k = next_k[u]
        items = users[u][max(0, k - max_items):k]
        prompts.append(layout.sid_tokens(items).ravel().astype(np.int64))
        ks.append(k)
        next_k[u] += 1
        if next_k[u] > len(users[u]):
            live[u] = False
    return Trace("returning", prompts, cfg.block_size), ks


def cold_trace(cfg: PrefixBenchConfig, data, layout, lengths: list[int]) -> Trace:
    """First visits of new users: random items, the returning replay's prompt lengths (in items)."""
    rng = np.random.default_rng(cfg.seed + 2)
    n = cfg.cold_batches * cfg.batch
    ks = rng.choice(lengths, n)
    prompts = [layout.sid_tokens(rng.choice(data.item_ids, int(k), replace=False)).ravel().astype(np.int64)
               for k in ks]
    return Trace("cold", prompts, cfg.block_size)


class Layout:
    """Item → SID tokens of the catalog (arithmetic layout)."""

    def __init__(self, catalog):
        self.catalog = catalog
        self.depth = catalog.depth

    def sid_tokens(self, items) -> np.ndarray:
        return self.catalog.layout.items_to_tokens(self.catalog.sids_of_items(np.asarray(items))).reshape(
            len(items), self.depth)


# ---- hit rates without the model -----------------------------------------------------------------------------------
def replay_hit_rate(trace: Trace, capacity_tokens: int, policy: str, batch: int) -> tuple[float, float]:
    """(token hit rate, µs of cache time per request) of ``PrefixBlockCache`` on the trace, batch by batch."""
    import torch

    from grserve.kvcache.prefix_blocks import PrefixBlockCache

    cache = PrefixBlockCache(capacity_tokens, block_size=trace.block_size, num_layers=1, num_kv_heads=1, head_dim=1,
                             policy=policy)
    bufs: dict[int, tuple] = {}
    t0 = time.process_time()
    for s in range(0, len(trace.prompts), batch):
        group = trace.prompts[s:s + batch]
        loaded = []
        for p in group:
            kv = bufs.get(len(p)) or bufs.setdefault(len(p), (torch.zeros(1, 1, len(p), 1),
                                                               torch.zeros(1, 1, len(p), 1)))
            loaded.append((p, cache.load(p, *kv), kv))
        for p, m, kv in loaded:
            cache.store(p, m, *kv)
    spent = time.process_time() - t0
    cache.tiers[0].policy.close()
    return cache.hit_rate, 1e6 * spent / max(len(trace.prompts), 1)


def block_mode_rates(trace: Trace, sizes_blocks: list[int], policies: list[str]) -> list[dict]:
    """Block-mode hit rates (independent items) of grserve's policies and libcachesim's heuristics."""
    from grserve.kvcache.shared_prefix import block_policy
    from grserve_bench.eviction.prefix_sim import simulate_paths
    from grserve_bench.trace_file import LCS_ALGOS, libcachesim_available, run_libcachesim, write_lcs_csv

    rows = []
    for k in sizes_blocks:
        for name in policies:
            pol = block_policy(name, k)
            res = simulate_paths(trace.paths, pol, mode="block")
            pol.close()
            rows.append(dict(cache_blocks=k, policy=name, hit_rate=round(res.hit_rate, 6)))
    if libcachesim_available():
        with tempfile.TemporaryDirectory() as tmp:
            csv = os.path.join(tmp, "trace.csv")
            write_lcs_csv([h for p in trace.paths for h in p], csv)
            for k in sizes_blocks:
                if k < LCS_MIN_BLOCKS:  # S3FIFO aborts the process on a cache this small (its FIFOs round to 0)
                    continue
                for algo in LCS_ALGOS:
                    hr, _ = run_libcachesim(csv, algo, k)
                    rows.append(dict(cache_blocks=k, policy=f"lcs:{algo}", hit_rate=round(hr, 6)))
    return rows


def routing_hit_rate(trace: Trace, capacity_tokens: int, policy: str, routing: str, instances: int,
                     window: int) -> tuple[float, list[int]]:
    """(token hit rate, requests per instance) of ``instances`` prefix caches behind the cluster's ``Router`` and
    ``GlobalKVIndex`` (each cache's blocks published by a ``KVEventPublisher``, as ``serve --instances N`` wires
    them): ``window`` requests are routed (booked) together, then served, then released."""
    import torch

    from grserve.cluster.core.kv_index import GlobalKVIndex, KVEventPublisher
    from grserve.cluster.core.router import Router
    from grserve.engine.types import RetrievalRequest
    from grserve.kvcache.prefix_blocks import PrefixBlockCache

    index = GlobalKVIndex()
    caches, pubs = [], []
    for i in range(instances):
        index.register(i, f"bench{i}")
        pub = KVEventPublisher(i, f"bench{i}", trace.block_size, "hbm")
        cache = PrefixBlockCache(capacity_tokens, block_size=trace.block_size, num_layers=1, num_kv_heads=1,
                                 head_dim=1, policy=policy)
        cache.listener = pub
        index.apply_snapshot(pub.snapshot())
        caches.append(cache)
        pubs.append(pub)
    router = Router(instances, routing, block_size=trace.block_size, index=index, decode_weight=0.0,
                    cache_weight=2.0)
    per = [0] * instances
    for s in range(0, len(trace.prompts), window):
        group = [(f"r{s + j}", p) for j, p in enumerate(trace.prompts[s:s + window])]
        chosen = [(rid, p, router.route(RetrievalRequest(prompt_tokens=p, beam_width=1, top_n=1,
                                                         request_id=rid)).instance) for rid, p in group]
        for i in range(instances):  # each instance runs its share as one batch: loads, then stores
            mine = [p for _, p, k in chosen if k == i]
            per[i] += len(mine)
            kvs = [(torch.zeros(1, 1, len(p), 1), torch.zeros(1, 1, len(p), 1)) for p in mine]
            loaded = [caches[i].load(p, *kv) for p, kv in zip(mine, kvs)]
            for p, m, kv in zip(mine, loaded, kvs):
                caches[i].store(p, m, *kv)
            index.apply(i, *pubs[i].take_events())
        for rid, _, _ in chosen:
            router.release(rid)
    hits = sum(c.stats["hit_tokens"] for c in caches)
    for c in caches:
        c.tiers[0].policy.close()
    return hits / max(trace.prompt_tokens, 1), per


# ---- engines ---------------------------------------------------------------------------------------------------------
def _engine(model, catalog, cfg: PrefixBenchConfig, tokens: int, policy: str):
    from grserve.catalog import CatalogStore
    from grserve.config import PrefixCacheConfig, SchedulerConfig, SearchConfig
    from grserve.engine.retrieval_engine import RetrievalEngine

    search = SearchConfig(beam_width=cfg.beam_width, max_beam_width=max(512, cfg.beam_width), warmup=False)
    prefix = PrefixCacheConfig(prefix_cache_tokens=tokens, prefix_cache_policy=policy, prefix_block_size=cfg.block_size)
    return RetrievalEngine(model, CatalogStore(catalog), search, SchedulerConfig(), prefix=prefix)


def run_lockstep(engines: dict[str, object], prompts: list[np.ndarray], cfg: PrefixBenchConfig) -> dict[str, dict]:
    """Every engine runs the same batches, one batch each in turn. Per engine: batch wall and CPU times, each
    request's latency (its batch's wall time), cached tokens and beams."""
    from grserve.engine.types import RetrievalRequest

    out = {name: dict(wall=[], cpu=[], latency=[], cached=[], beams=[]) for name in engines}
    order = list(engines)
    for b, s in enumerate(range(0, len(prompts), cfg.batch)):
        group = prompts[s:s + cfg.batch]
        for name in order[b % len(order):] + order[:b % len(order)]:  # rotate who goes first
            reqs = [RetrievalRequest(prompt_tokens=p, beam_width=cfg.beam_width, top_n=10) for p in group]
            w0, c0 = time.perf_counter(), time.process_time()
            res = engines[name].run_batch(reqs)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            o = out[name]
            o["wall"].append(wall)
            o["cpu"].append(cpu)
            o["latency"] += [wall * 1e3] * len(group)
            o["cached"] += [r.cached_tokens for r in res]
            o["beams"] += [[(i.item_id, i.score) for i in r.items] for r in res]
    return out


def _identical(a: list, b: list) -> bool:
    return all([i for i, _ in x] == [i for i, _ in y] and all(abs(p - q) <= TOL for (_, p), (_, q) in zip(x, y))
               for x, y in zip(a, b))


def _summary(run: dict, n: int, prompt_tokens: int) -> dict:
    lat = np.array(run["latency"])
    return dict(requests=n, throughput_rps=round(n / sum(run["wall"]), 3),
                cpu_throughput_rps=round(n / sum(run["cpu"]), 3),
                p50_ms=round(float(np.percentile(lat, 50)), 1), p99_ms=round(float(np.percentile(lat, 99)), 1),
                hit_rate=round(sum(run["cached"]) / prompt_tokens, 4))


# ---- the run ---------------------------------------------------------------------------------------------------------
def run(cfg: PrefixBenchConfig) -> int:
    import torch

    from grserve.catalog import Catalog
    from grserve.model import load_model

    torch.set_num_threads(cfg.threads)
    t_all = time.perf_counter()
    load0 = os.getloadavg()
    data = _beauty()
    catalog = Catalog.from_arrays(data.item_ids, data.sids, codebook_sizes=data.codebook_sizes)
    layout = Layout(catalog)
    model = load_model(cfg.model, seed=cfg.seed)
    vocab = model.spec.vocab_size
    workloads = cfg.workloads.split(",")
    sizes = [float(x) for x in cfg.sizes.split(",")]
    policies = cfg.policies.split(",")
    engine_runs = [tuple(x.split(":")) for x in cfg.engine_runs.split(",") if x]
    traces: dict[str, Trace] = {}
    if "instruction" in workloads:
        traces["instruction"] = instruction_trace(cfg, data, layout, vocab)
    ks: list[int] = []
    if "returning" in workloads or "cold" in workloads:
        traces["returning"], ks = returning_trace(cfg, data, layout)
    rows: list[dict] = []
    summary: dict = {}

    # hit rates: every size × policy through the engine's cache, and block mode with libcachesim's heuristics
    for name, trace in traces.items():
        distinct = trace.distinct_prefix_tokens
        summary[name] = dict(prompts=len(trace.prompts), prompt_tokens=trace.prompt_tokens,
                             distinct_prefix_tokens=distinct,
                             mean_prompt_tokens=round(trace.prompt_tokens / len(trace.prompts), 1))
        for frac in sizes:
            cap = max(cfg.block_size, int(frac * distinct) // cfg.block_size * cfg.block_size)
            for pol in policies:
                hr, us = replay_hit_rate(trace, cap, pol, cfg.batch)
                rows.append(dict(kind="replay", workload=name, size_fraction=frac, cache_tokens=cap, policy=pol,
                                 hit_rate=round(hr, 4), cache_us_per_request=round(us, 1)))
                print(f"replay {name} {frac:.0%} {pol}: hit rate {hr:.3f}", file=sys.stderr, flush=True)
        for frac in sizes:
            for r in block_mode_rates(trace, [max(1, int(frac * distinct) // cfg.block_size)], policies):
                rows.append(dict(kind="block_mode", workload=name, size_fraction=frac, **r))

    # --instances N: prefix routing vs round-robin (each instance's cache as large as the one engine's)
    if "returning" in traces and cfg.instances > 1:
        trace = traces["returning"]
        for frac in sizes:
            cap = max(cfg.block_size, int(frac * trace.distinct_prefix_tokens) // cfg.block_size * cfg.block_size)
            for routing in ("kv", "round_robin"):
                hr, per = routing_hit_rate(trace, cap, cfg.routing_policy, routing, cfg.instances, 2 * cfg.batch)
                rows.append(dict(kind="routing", workload="returning", size_fraction=frac, cache_tokens=cap,
                                 policy=cfg.routing_policy, routing=routing, instances=cfg.instances,
                                 hit_rate=round(hr, 4), requests_per_instance=per))

    # engines in lockstep: the cache off and each listed cache-on setting
    for name, trace in traces.items():
        prompts = trace.prompts
        runs = [(float(f), p) for w, f, p in engine_runs if w == name]
        if not runs:
            continue
        distinct = Trace(name, prompts, cfg.block_size).distinct_prefix_tokens
        engines = {"off": _engine(model, catalog, cfg, 0, "lru")}
        for f, p in runs:
            cap = max(cfg.block_size, int(f * distinct) // cfg.block_size * cfg.block_size)
            engines[f"{p}@{f:g}"] = _engine(model, catalog, cfg, cap, p)
        print(f"engines {name}: {len(prompts)} requests x {len(engines)} engines", file=sys.stderr, flush=True)
        res = run_lockstep(engines, prompts, cfg)
        n, tokens = len(prompts), sum(len(p) for p in prompts)
        off = _summary(res["off"], n, tokens)
        rows.append(dict(kind="engine", workload=name, setting="off", **off))
        for key in engines:
            if key == "off":
                continue
            s = _summary(res[key], n, tokens)
            pol, f = key.split("@")
            rows.append(dict(kind="engine", workload=name, setting=key, policy=pol, size_fraction=float(f),
                             speedup=round(s["throughput_rps"] / off["throughput_rps"], 3),
                             cpu_speedup=round(s["cpu_throughput_rps"] / off["cpu_throughput_rps"], 3),
                             beams_identical=_identical(res["off"]["beams"], res[key]["beams"]), **s))
        if name == "returning" and "cold" in workloads:  # the best returning engine, full, meets new users
            best = max((r for r in rows if r["kind"] == "engine" and r["workload"] == "returning"
                        and r["setting"] != "off"), key=lambda r: r["throughput_rps"])
            cold = cold_trace(cfg, data, layout, ks)
            cres = run_lockstep({"off": engines["off"], best["setting"]: engines[best["setting"]]}, cold.prompts, cfg)
            c_off = _summary(cres["off"], len(cold.prompts), cold.prompt_tokens)
            c_on = _summary(cres[best["setting"]], len(cold.prompts), cold.prompt_tokens)
            rows.append(dict(kind="engine", workload="cold", setting="off", **c_off))
            rows.append(dict(kind="engine", workload="cold", setting=best["setting"], **c_on,
                             speedup=round(c_on["throughput_rps"] / c_off["throughput_rps"], 3),
                             cpu_speedup=round(c_on["cpu_throughput_rps"] / c_off["cpu_throughput_rps"], 3),
                             beams_identical=_identical(cres["off"]["beams"], cres[best["setting"]]["beams"])))
        for e in engines.values():
            if e.prefix is not None:
                e.prefix.tiers[0].policy.close()

    result = dict(bench="prefix", model=cfg.model, beam_width=cfg.beam_width, batch=cfg.batch,
                  block_size=cfg.block_size, threads=cfg.threads, workloads=summary, rows=rows,
                  goals=goals(rows, sizes, policies), loadavg_start=[round(x, 2) for x in load0],
                  loadavg_end=[round(x, 2) for x in os.getloadavg()], cpu=machine_info()["cpu"],
                  machine=machine_info(),
                  seconds=round(time.perf_counter() - t_all, 1))
    print_table(result)
    line = json.dumps(result)
    if cfg.out:
        with open(cfg.out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


def goals(rows: list[dict], sizes: list[float], policies: list[str]) -> dict:
    """The issue's goals as measured in this run (None where this run did not measure them)."""
    eng = [r for r in rows if r["kind"] == "engine"]

    def best_speedup(w: str, frac: float | None = None) -> float | None:
        vals = [r["speedup"] for r in eng if r["workload"] == w and "speedup" in r
                and (frac is None or r.get("size_fraction") == frac)]
        return max(vals) if vals else None

    margins = {}
    for frac in sizes:
        blk = [r for r in rows if r["kind"] == "block_mode" and r["size_fraction"] == frac
               and r["workload"] == "returning"]
        heur = [r["hit_rate"] for r in blk if r["policy"] == "lru" or r["policy"].startswith("lcs:")]
        rep = {r["policy"]: r["hit_rate"] for r in rows if r["kind"] == "replay" and r["size_fraction"] == frac
               and r["workload"] == "returning"}
        learned = {p: r["hit_rate"] for r in blk for p in ("laru", "leader") if r["policy"] == p}
        if heur and learned:
            margins[f"{frac:g}"] = dict(
                block_mode_best_heuristic=max(heur), block_mode_laru=learned.get("laru"),
                block_mode_leader=learned.get("leader"),
                engine_lru=rep.get("lru"), engine_laru=rep.get("laru"), engine_leader=rep.get("leader"))
    identical = all(r.get("beams_identical", True) for r in eng)
    routing = {}
    for frac in sizes:
        rr = {r["routing"]: r["hit_rate"] for r in rows if r["kind"] == "routing" and r["size_fraction"] == frac}
        if "kv" in rr and "round_robin" in rr:
            routing[f"{frac:g}"] = dict(kv=rr["kv"], round_robin=rr["round_robin"],
                                        ratio=round(rr["kv"] / rr["round_robin"], 3) if rr["round_robin"] else None)
    return dict(instruction_speedup=best_speedup("instruction"), returning_speedup_at_10pct=best_speedup(
        "returning", 0.1), cold_speedup=best_speedup("cold"), hit_rates_by_size=margins, routing_hit_rates=routing,
        beams_identical=identical)


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"bench prefix: {result['model']}, BW {result['beam_width']}, batch {result['batch']}, "
                    f"block {result['block_size']}")
    for c in ("workload", "setting", "hit rate", "req/s", "speedup", "CPU speedup", "p50 ms", "p99 ms", "identical"):
        t.add_column(c)
    for r in result["rows"]:
        if r["kind"] == "engine":
            t.add_row(r["workload"], r["setting"], f"{r['hit_rate']:.3f}", f"{r['throughput_rps']:.2f}",
                      str(r.get("speedup", "")), str(r.get("cpu_speedup", "")), f"{r['p50_ms']:.0f}",
                      f"{r['p99_ms']:.0f}", str(r.get("beams_identical", "")))
    Console(stderr=True).print(t)
    h = Table(title="hit rates (engine replay | block mode)")
    for c in ("workload", "size", "policy", "engine replay", "block mode"):
        h.add_column(c)
    blk = {(r["workload"], r["size_fraction"], r["policy"]): r["hit_rate"] for r in result["rows"]
           if r["kind"] == "block_mode"}
    for r in result["rows"]:
        if r["kind"] == "replay":
            h.add_row(r["workload"], f"{r['size_fraction']:.0%}", r["policy"], f"{r['hit_rate']:.4f}",
                      f"{blk.get((r['workload'], r['size_fraction'], r['policy']), float('nan')):.4f}")
    for (w, f, p), v in blk.items():
        if p.startswith("lcs:"):
            h.add_row(w, f"{f:.0%}", p, "", f"{v:.4f}")
    Console(stderr=True).print(h)
