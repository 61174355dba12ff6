"""``grserve bench cluster``: routing policies and a fault run on N engine instances (Ray actors), one machine.

Workload: a contiguous slice of the Mooncake conversation trace (``--trace``; FAST '25). Its ``hash_ids`` are
512-token prompt blocks whose id fixes the whole prefix; each becomes ``--block-tokens`` tokens drawn from a
generator seeded by (``--seed``, hash id), so equal ids give equal tokens in every run and process. The last
block keeps its share of ``input_length``; prompts are cut at ``--max-prompt-blocks`` blocks. Output lengths are
``output_length × --output-scale`` (1 … ``--max-output``), decoded greedily with EOS ignored. Arrivals are the
trace's timestamps compressed so the slice spans ``--duration-s``, or (``--duration-s 0``, the default) so that
the offered prompt tokens per second are ``--load`` × the instances' throughput measured at start-up. Each
instance's prefix cache holds ``--cache-fraction`` of the slice's unique prompt blocks.

Every policy (round_robin, least_loaded, kv) replays the same requests at the same arrivals on the same instances,
each starting from empty prefix caches; round_robin and kv run in adjacent slots of each round, and the TTFT ratio
is the median of the per-round ratios. Per policy: prefix-cache hit rate (prompt tokens copied from a prefix
cache ÷ prompt tokens; also in blocks: hit tokens ÷ ``--block-tokens`` ÷ prompt blocks), mean, median and P99 TTFT (submit → first token at the front end), requests per instance. Then the
fault run: the kv policy again, and when one instance holds a request still in prefill and one in decode, that
instance is killed by its own PID (SIGKILL); the run is compared with the kv run without the fault. Last line: one
JSON object (keys in ``docs/cluster.md``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grserve.flags import (Checked, UsageError, config_command, flag, fraction, non_negative, positive,
                           positive_int)

POLICIES = ("round_robin", "least_loaded", "kv")
TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE_SOURCE = ("the Mooncake conversation trace (FAST '25): conversation_trace.jsonl under FAST25-release/traces "
                "in https://github.com/kvcache-ai/Mooncake")


@dataclass(frozen=True)
class ClusterBenchConfig(Checked):
    """The knobs of ``grserve bench cluster``."""

    trace: str = flag(f"../shared/traces/{TRACE_NAME}", "Mooncake trace (JSON lines); a relative path not found "
                                                         "here is also looked for from each parent directory",
                      metavar="FILE")
    start: int = flag(0, "first request of the slice", check=lambda v: None if v >= 0 else "must be >= 0")
    requests: int = flag(300, "requests in the slice (300: the whole bench takes ~9 min here; 600 overloaded "
                              "the shared machine when its load rose after the capacity was measured)",
                         check=positive_int)
    block_tokens: int = flag(16, "tokens per trace block (512 in the trace; 16: the default slice is 85k prompt "
                                 "tokens; docs/cluster.md)", check=positive_int)
    max_prompt_blocks: int = flag(32, "prompts are cut after this many blocks", check=positive_int)
    output_scale: float = flag(1 / 64, "output tokens = trace output_length × this", check=positive)
    max_output: int = flag(16, "most output tokens per request", check=positive_int)
    duration_s: float = flag(0.0, "the slice's arrivals are compressed to span this many seconds; 0 = from --load "
                                  "and the measured prefill capacity", check=non_negative)
    load: float = flag(0.8, "with --duration-s 0: offered prompt tokens per second = this × the instances' "
                            "sustained throughput, measured at start-up on requests shaped like the slice's (no "
                            "cache hits counted: misses queue)", check=positive)
    instances: int = flag(3, "engine instances (Ray actors)", check=positive_int)
    model: str = flag("tiny", "preset or HF dir", metavar="PRESET_OR_DIR")
    prefix_cache_tokens: int = flag(65536, "prefix cache per instance (tokens), when --cache-fraction is 0",
                                    check=positive_int)
    cache_fraction: float = flag(0.33, "prefix cache per instance = this × the slice's unique prompt blocks × "
                                       "--block-tokens (0: --prefix-cache-tokens)", check=non_negative)
    num_blocks: int = flag(4096, "KV pool blocks per instance", check=positive_int)
    decode_weight: float = flag(0.1, "router: weight of a booked decode token", check=lambda v: None if v >= 0
                                else "must be >= 0")
    cache_weight: float = flag(2.0, "router: weight of a cached prompt token", check=lambda v: None if v >= 0
                               else "must be >= 0")
    heartbeat_timeout_s: float = flag(5.0, "instances silent this long are fenced (a SIGKILL is seen by Ray at once, "
                                           "so the fault run's detection does not wait for it; 2 s fenced all three "
                                           "instances under a load average of 15)", check=positive)
    kill_after: float = flag(0.3, "fault run: look for a victim once this fraction of requests was submitted",
                             check=fraction)
    rounds: int = flag(3, "rounds over the policies; round_robin and kv run in adjacent slots, in turn first "
                          "(the machine's background load drifts); the TTFT ratio is the median of the per-round "
                          "ratios, the other per-policy numbers are means over rounds", check=positive_int)
    fault: bool = flag(True, "run the fault run (--no-fault: policies only)")
    fault_fraction: float = flag(0.5, "the fault run replays this first fraction of the slice (same arrivals)",
                                 check=fraction)
    seed: int = flag(0, "seed of the synthesized block tokens", check=lambda v: None if v >= 0 else "must be >= 0")
    out: str | None = flag(None, "also write the JSON result here", metavar="FILE")


def add_command(sub) -> None:
    config_command(sub, "cluster", help="KV-aware routing vs round-robin / least-loaded on N Ray instances, and a "
                                        "fault run (kill one instance by PID)", cls=ClusterBenchConfig, run=run,
                   description=__doc__)


# ---- workload ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt: list[int]
    max_tokens: int
    blocks: int


def block_tokens(hash_id: int, n: int, seed: int, vocab: int = 32000) -> list[int]:
    rng = np.random.default_rng([seed, hash_id])
    return rng.integers(3, vocab, n).tolist()


def find_trace(path: str) -> Path:
    """``path``, or for a relative one not found here, the first of parent/path and parent/shared/traces/NAME over
    the parents of the working directory; a ``UsageError`` naming the file and where to get it if none exists."""
    p = Path(path)
    if p.is_file():
        return p
    if not p.is_absolute():
        for parent in Path.cwd().resolve().parents:
            for candidate in (parent / p, parent / "shared" / "traces" / p.name):
                if candidate.is_file():
                    return candidate
    raise UsageError(f"--trace {path}: no such file (a relative path is also looked for from each parent directory "
                     f"and its shared/traces/); get {TRACE_SOURCE}, and pass its path with --trace")


def load_trace(cfg: ClusterBenchConfig) -> list[TraceRequest]:
    rows = []
    path = find_trace(cfg.trace)
    with open(path) as f:
        for i, line in enumerate(f):
            if i >= cfg.start + cfg.requests:
                break
            if i >= cfg.start:
                rows.append(json.loads(line))
    if not rows:
        raise UsageError(f"--start {cfg.start}: {path} has fewer requests than that")
    t0, t1 = rows[0]["timestamp"], rows[-1]["timestamp"]
    span = max(t1 - t0, 1)
    duration = cfg.duration_s or 1.0  # 0: arrivals as fractions of the span, scaled once capacity is measured
    B = cfg.block_tokens
    out = []
    for r in rows:
        ids = r["hash_ids"][:cfg.max_prompt_blocks]
        last = max(1, min(B, round((r["input_length"] - 512 * (len(r["hash_ids"]) - 1)) * B / 512)))
        if len(ids) < len(r["hash_ids"]):
            last = B
        prompt: list[int] = []
        for j, h in enumerate(ids):
            prompt += block_tokens(h, B if j < len(ids) - 1 else last, cfg.seed)
        out_len = max(1, min(cfg.max_output, round(r["output_length"] * cfg.output_scale)))
        out.append(TraceRequest((r["timestamp"] - t0) / span * duration, prompt, out_len, len(ids)))
    return out


def unique_blocks(cfg: ClusterBenchConfig) -> int:
    """Distinct prompt blocks of the slice (a trace hash id names its whole prefix), after the prompt cut."""
    seen: set[int] = set()
    with open(find_trace(cfg.trace)) as f:
        for i, line in enumerate(f):
            if i >= cfg.start + cfg.requests:
                break
            if i >= cfg.start:
                seen.update(json.loads(line)["hash_ids"][:cfg.max_prompt_blocks])
    return len(seen)


def measure_capacity(engine, reqs: list[TraceRequest], seed: int, per_instance: int = 20) -> float:
    """Throughput of the instances together in prompt tokens/s, on the machine as it is now: a queue of
    ``per_instance`` requests per instance shaped like the slice's first requests (prompt and output lengths, so
    decode and the KV snapshots are paid as in the replay) with fresh tokens (no cache hits), all submitted at once
    (least-loaded placement), timed until the last one ends. A deep queue, because an instance's throughput falls
    with the requests it holds: a burst of 4 per instance, or a closed loop of 2 in flight, measured ~2x what the
    replays then sustained (docs/cluster.md)."""
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    engine.reset("least_loaded")
    shapes = [(len(r.prompt), r.max_tokens) for r in reqs[:per_instance * sum(i.up for i in engine.instances)]]
    t0 = time.perf_counter()
    hs = [engine.submit(LLMRequest(block_tokens(10 ** 9 + k, n, seed),
                                   SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                                   request_id=f"cap{k}")) for k, (n, m) in enumerate(shapes)]
    for h in hs:
        h.future.result(timeout=600)
    return sum(n for n, _ in shapes) / (time.perf_counter() - t0)


# ---- one replay ----------------------------------------------------------------------------------------------------
def replay(engine, reqs: list[TraceRequest], on_submit=None) -> dict:
    """Submit every request at its arrival; wait for all; per-request outcome and TTFT."""
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    engine.keep_finished = True
    handles = []
    t0 = time.perf_counter()
    for k, r in enumerate(reqs):
        delay = t0 + r.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        handles.append(engine.submit(LLMRequest(r.prompt, params, request_id=f"r{k}")))
        if on_submit is not None:
            on_submit(k)
    outputs, lost = {}, 0
    for k, h in enumerate(handles):
        try:
            outputs[k] = h.future.result(timeout=600).output_ids
        except Exception:  # noqa: BLE001 - counted as lost
            lost += 1
    time.sleep(4 * engine.cc.poll_wait_s + 0.2)  # the last polls bring the instances' final stats
    recs = {rec.request_id: rec for rec in engine.finished}
    ttft = [recs[f"r{k}"].first_token_at - recs[f"r{k}"].submitted_at for k in range(len(reqs))
            if f"r{k}" in recs and recs[f"r{k}"].first_token_at is not None]
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    hits = sum(inst.stats.get("prefix_hit_tokens", 0) for inst in engine.instances)
    block = max(1, engine.cc.kv_block_size)  # the bench sets it to --block-tokens: one trace block
    hit_blocks = sum(inst.stats.get("prefix_hit_tokens", 0) // block for inst in engine.instances)
    detail = [(recs[f"r{k}"].instance, len(r.prompt), recs[f"r{k}"].submitted_at - t0,
               (recs[f"r{k}"].first_token_at or float("nan")) - recs[f"r{k}"].submitted_at)
              for k, r in enumerate(reqs) if f"r{k}" in recs]
    return {"outputs": outputs, "lost": lost, "requests": detail, "ttft_mean": float(np.mean(ttft)), "ttft_p99": float(np.percentile(ttft, 99)),
            "ttft_median": float(np.median(ttft)), "hit_rate": hits / prompt_tokens,
            "hit_rate_blocks": hit_blocks / max(1, sum(r.blocks for r in reqs)), "per_instance": list(engine.router.routed),
            "decisions": dict(engine.router.decisions), "wall_s": time.perf_counter() - t0,
            "counters": dict(engine.counters)}


def _victim(engine) -> int | None:
    """An instance holding a request still in prefill (no token yet) and one in decode with its KV snapshot."""
    with engine._lock:
        for inst in engine.instances:
            if not inst.up:
                continue
            mine = [r for r in engine.records.values() if r.instance == inst.index]
            prefill = any(r.delivered == 0 for r in mine)
            decode = any(r.delivered >= 1 and r.snapshot is not None and r.delivered < r.params.max_tokens - 1
                         for r in mine)
            if prefill and decode:
                return inst.index
    return None


def fault_run(engine, reqs: list[TraceRequest], kill_after: float) -> tuple[dict, dict]:
    """The kv replay with one instance killed by its PID while it holds mid-prefill and mid-decode requests."""
    fault: dict = {"killed": None, "kill_time": None, "detect_seconds": None}
    start_looking = threading.Event()
    done = threading.Event()

    def watch() -> None:
        start_looking.wait()
        while not done.is_set():
            v = _victim(engine)
            if v is not None:
                fault.update(killed=v, pid=engine.instances[v].info.pid, kill_time=time.perf_counter(),
                             in_flight=sum(r.instance == v for r in list(engine.records.values())))
                os.kill(engine.instances[v].info.pid, signal.SIGKILL)
                return
            time.sleep(0.002)

    def on_submit(k: int) -> None:
        if k + 1 >= kill_after * len(reqs):
            start_looking.set()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        res = replay(engine, reqs, on_submit)
    finally:
        done.set()
        start_looking.set()
        watcher.join(timeout=5)
    if fault["killed"] is not None:
        inst = engine.instances[fault["killed"]]
        fault["detect_seconds"] = (inst.down_at - fault["kill_time"]) if inst.down_at is not None else None
        fault["down_reason"] = inst.down_reason
    return res, fault


# ---- the command -------------------------------------------------------------------------------------------------------
def _launch(cfg: ClusterBenchConfig, cache_tokens: int):
    from grserve.cluster.llm.front_end import ClusterLLMEngine
    from grserve.config import ClusterConfig, EdgeConfig, LLMConfig, LLMServeConfig, ModelConfig

    # float32: fault_identical_outputs compares token for token across runs whose batches differ; the LLM engine is
    # not batch-invariant, and at bf16 (the default --dtype auto on a CPU with fast bf16) a batch can flip a token
    serve = LLMServeConfig(model=ModelConfig(source=cfg.model, dtype="float32"),
                           llm=LLMConfig(scheduler="fcfs", num_blocks=cfg.num_blocks,
                                         prefix_cache_tokens=cache_tokens),
                           edge=EdgeConfig(max_waiting=1 << 20, request_timeout=1e6))  # every request is served
    cc = ClusterConfig(instances=cfg.instances, routing="kv", decode_weight=cfg.decode_weight,
                       cache_weight=cfg.cache_weight, kv_block_size=cfg.block_tokens, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                       restart_instances=False)  # the fault run compares with two instances left
    return ClusterLLMEngine.launch(serve, cc).start()


def _warm_up(engine, reqs: list[TraceRequest]) -> None:
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    hs = [engine.submit(LLMRequest(list(range(5, 5 + 64 + 7 * i)), SamplingParams(max_tokens=4, temperature=0),
                                   request_id=f"warm{i}")) for i in range(3 * engine.cc.instances)]
    for h in hs:
        h.future.result(timeout=120)


def _row(name: str, r: dict) -> str:
    return (f"{name:>13}  hit rate {r['hit_rate']:.3f} (blocks {r['hit_rate_blocks']:.3f})  TTFT mean "
            f"{r['ttft_mean'] * 1e3:8.1f} ms  median {r['ttft_median'] * 1e3:8.1f} ms  "
            f"P99 {r['ttft_p99'] * 1e3:8.1f} ms  per instance {r['per_instance']}  wall {r['wall_s']:.1f} s")


def round_order(rnd: int) -> tuple[str, ...]:
    """round_robin and kv in adjacent slots, each first in turn (their ratio is taken within a round)."""
    return ("round_robin", "kv", "least_loaded") if rnd % 2 == 0 else ("least_loaded", "kv", "round_robin")


def run(cfg: ClusterBenchConfig) -> int:
    import dataclasses

    reqs = load_trace(cfg)
    prompt_tokens = sum(len(r.prompt) for r in reqs)
    unique = unique_blocks(cfg)
    cache_tokens = round(cfg.cache_fraction * unique * cfg.block_tokens) or cfg.prefix_cache_tokens
    print(f"bench cluster: {len(reqs)} requests of {cfg.trace} from #{cfg.start}, {prompt_tokens} prompt tokens, "
          f"{sum(r.max_tokens for r in reqs)} output tokens, {unique} unique prompt blocks; prefix cache "
          f"{cache_tokens} tokens per instance ({cache_tokens / (unique * cfg.block_tokens):.2f} of the slice's "
          f"unique blocks), {cfg.instances} instances of {cfg.model}", flush=True)
    engine = _launch(cfg, cache_tokens)
    for line in engine.describe():
        print(f"  {line}", flush=True)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    results: dict[str, dict] = {}
    fault: dict = {}
    setup: dict = {"unique_blocks": unique, "prefix_cache_tokens": cache_tokens, "prompt_tokens": prompt_tokens}
    try:
        _warm_up(engine, reqs)
        duration = cfg.duration_s
        if not duration:
            setup["capacity_tokens_per_s"] = measure_capacity(engine, reqs, cfg.seed)
            duration = prompt_tokens / (cfg.load * setup["capacity_tokens_per_s"])
            reqs = [dataclasses.replace(r, arrival=r.arrival * duration) for r in reqs]
        setup["duration_s"] = duration
        print(f"  prefill capacity {setup.get('capacity_tokens_per_s', float('nan')):.0f} tokens/s -> the slice "
              f"spans {duration:.1f} s (offered load {cfg.load if not cfg.duration_s else float('nan'):.2f})",
              flush=True)
        for rnd in range(cfg.rounds):
            for policy in round_order(rnd):
                engine.reset(policy)
                runs[policy].append(replay(engine, reqs))
                print(_row(f"{policy} #{rnd}", runs[policy][-1]), flush=True)
        results = {p: _mean_runs(r) for p, r in runs.items()}
        if cfg.fault:
            engine.reset("kv")
            results["kv_fault"], fault = fault_run(engine, reqs[:max(1, round(cfg.fault_fraction * len(reqs)))],
                                                   cfg.kill_after)
            print(_row("kv + fault", results["kv_fault"]), flush=True)
    finally:
        engine.stop()
    summary = {**_summary(results, fault), **setup}
    if cfg.out:
        Path(cfg.out).write_text(json.dumps({**summary, "policies": {k: {kk: vv for kk, vv in v.items()
                                                                           if kk not in ("outputs", "requests")}
                                                                       for k, v in results.items()}}, indent=1))
    print(json.dumps(summary), flush=True)
    return 0


def _mean_runs(runs: list[dict]) -> dict:
    """One policy's rounds: means of the numbers; the outputs of the first round (all rounds must agree)."""
    out = dict(runs[0])
    for key in ("hit_rate", "hit_rate_blocks", "ttft_mean", "ttft_median", "ttft_p99", "wall_s"):
        out[key] = float(np.mean([r[key] for r in runs]))
    out["rounds"] = [{k: r[k] for k in ("hit_rate", "hit_rate_blocks", "ttft_mean", "ttft_median", "ttft_p99",
                                        "per_instance", "requests")}
                     for r in runs]
    out["outputs_agree_across_rounds"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    return out


def _summary(results: dict, fault: dict) -> dict:
    rr, kv = results["round_robin"], results["kv"]
    per_round = [a["ttft_mean"] / b["ttft_mean"] for a, b in zip(rr["rounds"], kv["rounds"])]
    out = {"hit_rate_ratio_vs_rr": kv["hit_rate"] / max(rr["hit_rate"], 1e-9),
           "ttft_ratio_rr_over_kv": float(np.median(per_round)),  # adjacent slots per round; median over rounds
           "ttft_ratio_rr_over_kv_of_means": rr["ttft_mean"] / kv["ttft_mean"],
           "ttft_ratio_rr_over_kv_geomean": float(np.exp(np.mean(np.log(per_round)))),
           "ttft_median_ratio_rr_over_kv_per_round": [a["ttft_median"] / b["ttft_median"]
                                                      for a, b in zip(rr["rounds"], kv["rounds"])],
           "hit_rate_blocks_ratio_vs_rr": kv["hit_rate_blocks"] / max(rr["hit_rate_blocks"], 1e-9),
           "ttft_median_ratio_rr_over_kv": rr["ttft_median"] / kv["ttft_median"],
           "hit_rate": {p: results[p]["hit_rate"] for p in POLICIES},
           "hit_rate_blocks": {p: results[p]["hit_rate_blocks"] for p in POLICIES},
           "ttft_median_s": {p: results[p]["ttft_median"] for p in POLICIES},
           "ttft_mean_s": {p: results[p]["ttft_mean"] for p in POLICIES},
           "ttft_p99_s": {p: results[p]["ttft_p99"] for p in POLICIES},
           "requests_per_instance": {p: results[p]["per_instance"] for p in POLICIES},
           "ttft_ratio_rr_over_kv_per_round": per_round,
           "outputs_agree_across_policies": all(results[p]["outputs"] == kv["outputs"] for p in POLICIES)}
    if "kv_fault" in results:
        f = results["kv_fault"]
        same = all(kv["outputs"].get(k) == v for k, v in f["outputs"].items()) and f["lost"] == 0
        out.update(fault_lost_requests=f["lost"], fault_identical_outputs=bool(same),
                   fault_migrated=f["counters"]["migrated"], fault_recomputed=f["counters"]["recomputed"],
                   detect_seconds=fault.get("detect_seconds"), fault_killed_instance=fault.get("killed"),
                   fault_in_flight_on_victim=fault.get("in_flight"), fault_ttft_mean_s=f["ttft_mean"],
                   fault_requests=len(f["outputs"]) + f["lost"])
    return out
