"""``grserve bench serve``: SLO attainment and effective throughput, FCFS vs chunked prefill vs Apt-Serve.

Two modes, one engine (same schedulers, same block pool):
- default: the real model (``--model``, default the MHA preset ``tiny-mha``) on CPU; the clock advances by each
  iteration's measured time and jumps idle gaps (``grserve_bench.simulator.TimedExecutor``). SLOs are multiples of the
  measured single-request latencies (TTFT: prefill of the mean prompt; TBT: one decode step); the pool holds
  ``--mem-requests`` mean-size requests' KV, so memory binds as on a GPU.
- ``--simulate``: the discrete-event simulator with the OPT-13B / A100-40GB cost model (Table 3 SLOs,
  1,754 blocks ≈ 14k tokens of KV; ``--cost-model``); ``--simulate --paper-tables``: the paper's Tables 4 and 5
  in shape next to its numbers, then effective throughput at 90 % / 60 % of FCFS, chunked and Apt-Serve on the
  three datasets (``grserve_bench.aptserve_repro``); ``--simulate --ladder``: the reconstruction, piece by piece.

Rates sweep multiples of the single-request service rate; effective throughput = the highest rate with ≥ 90 %
attainment. Also measures decode throughput at batch 32 vs HF transformers ``generate`` (target P7).
Prints a rich table, writes ``attainment_vs_rate.png`` and ``serve.json`` to ``--out-dir``, and ends with one
JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from grserve_bench.llm_workloads import DATASETS, attainment, effective_throughput, make_trace
from grserve.config import LLM_SCHEDULERS, LLMConfig
from grserve.flags import (
    Checked,
    comma_list,
    config_command,
    device_name,
    flag,
    non_negative,
    positive,
    positive_int,
    split_commas,
)

SYSTEMS = ("fcfs", "chunked", "aptserve")  # the default comparison; --systems can add "aptserve-kv"
TABLE3 = {"sharegpt": (1.0, 1.0), "humaneval": (0.5, 0.5), "longbench": (4.0, 1.0)}


@dataclass(frozen=True)
class ServeBenchConfig(Checked):
    """The knobs of ``grserve bench serve``."""

    quick: bool = flag(False, "few requests, few rates, short decode benchmark (7-20 min on a loaded 2-core "
                                "machine, the simulator included)")
    simulate: bool = flag(False, "discrete-event simulator, OPT-13B on an A100")
    paper_tables: bool = flag(False, "with --simulate: the paper's Tables 4 and 5 in shape, then effective "
                                     "throughput at 90%% / 60%% attainment of fcfs, chunked, aptserve on the three "
                                     "datasets")
    ladder: bool = flag(False, "with --simulate: the reconstruction of the paper's setting, piece by piece "
                               "(ShareGPT effective throughput after each piece)")
    cost_model: str = flag("physical", "simulator iteration time: physical (A100 roofline with overlap), roofline "
                                       "(its slopes, anchored at 120 ms for a 50-request decode), linear (the "
                                       "same anchor, per-request heavy)", choices=("physical", "roofline", "linear"))
    sim_effective: bool = flag(True, "real mode: also report the simulator's effective throughput at 90%% per "
                                     "dataset (--no-sim-effective: skip it)")
    dataset: str = flag("sharegpt", "workload lengths", choices=DATASETS)
    systems: str = flag(",".join(SYSTEMS), "comma list of fcfs, chunked, aptserve, aptserve-kv (Apt-Serve "
                                           "scheduling, KV cache only: the paper's ablation); fcfs and aptserve are "
                                           "needed for the ratios", check=comma_list(allowed=LLM_SCHEDULERS))
    model: str = flag("tiny-mha", "preset or HF dir (real mode)", metavar="PRESET_OR_DIR")
    num_requests: int | None = flag(None, "requests per rate (default: 40 real / 500 sim; 24 / 200 with --quick)",
                                    check=positive_int)
    rates: str | None = flag(None, "comma-separated req/s (default: auto sweep)",
                             check=comma_list(float, each=positive))
    stop_below: float = flag(0.5, "a system whose attainment fell below this is not run at higher grid rates",
                             check=non_negative)
    refine: int = flag(3, "bisection steps on each system's 90%% crossing after the grid (0 = grid only)",
                       check=non_negative)
    cv: float = flag(1.0, "arrival CV (1 = Poisson, >1 Gamma bursts)", check=positive)
    scale: float = flag(0.25, "length scale of the workload (real mode)", check=positive)
    mem_requests: float = flag(4.0, "pool size in mean-request KV footprints", check=positive)
    ttft_mult: float = flag(10.0, "TTFT SLO = mult × single-request prefill", check=positive)
    tbt_mult: float = flag(10.0, "TBT SLO = mult × single-request decode step", check=positive)
    block_size: int = flag(LLMConfig().block_size, "tokens per block", check=positive_int)
    decode_bench: bool = flag(True, "the batch-32 decode vs HF benchmark (--no-decode-bench: skip it)")
    decode_only: bool = flag(False, "only the batch-32 decode vs HF benchmark (P7)")
    device: str = flag("cpu", "where the batch-32 decode benchmark runs (grserve and HF on the same device; the "
                              "rest of this benchmark is CPU only)", check=device_name, metavar="cpu|cuda|cuda:N")
    prefix_only: bool = flag(False, "only the prefix-cache benchmark: requests sharing a system prompt, with vs "
                                    "without the prompt-prefix KV cache (same engine, same requests, tokens checked "
                                    "identical)")
    decode_repeats: int | None = flag(None, "decode benchmark: best of N (default: 1 with --quick, else 2)",
                                      check=positive_int)
    threads: int = flag(1, "torch intra-op threads (0 = torch default). 1 by default: the per-iteration GEMMs are "
                           "tiny and two OpenMP threads on a shared 2-core machine stall on a busy core",
                        check=non_negative)
    timer: str = flag("thread", "real mode: an iteration's time is the engine thread's CPU time (thread: what it "
                                "takes on an idle core, robust on a shared machine; needs --threads 1, else wall) "
                                "or the wall time (wall)", choices=("thread", "wall"))
    seed: int = flag(0, "seed of the traces and the weights", check=non_negative)
    out_dir: str = flag("bench-results", "where the PNG and the JSON are written", metavar="DIR")


def add_command(sub) -> None:
    config_command(sub, "serve", help="LLM serving: SLO attainment and effective throughput, FCFS vs chunked vs "
                                      "Apt-Serve",
                   cls=ServeBenchConfig, run=run, description=__doc__)


def _refine(run_one, system: str, pts: list, steps: int, progress, level: float = 0.9) -> list:
    """Bisect ``steps`` times between the last grid rate at ≥ ``level`` attainment and the next one below it
    (the bracket ``effective_throughput`` interpolates in); returns the points with the new ones, sorted."""
    pts = sorted(pts, key=lambda x: x[0])
    for i in range(len(pts) - 1):
        if pts[i][1]["attainment"] >= level > pts[i + 1][1]["attainment"]:
            lo, hi = pts[i][0], pts[i + 1][0]
            break
    else:
        progress.update(steps)
        return pts
    for _ in range(steps):
        mid = round((lo + hi) / 2, 6)
        res = run_one(system, mid)
        pts.append((mid, res))
        lo, hi = (mid, hi) if res["attainment"] >= level else (lo, mid)
        progress.update(1)
    return sorted(pts, key=lambda x: x[0])


def _sweep(run_one, rates, systems, progress, stop_below: float = 0.0) -> dict[str, list[dict | None]]:
    """Each system at each rate (ascending); a system whose attainment fell below ``stop_below`` is not run at
    the higher rates (None there): past its wall it only costs time, and the crossings lie below."""
    out: dict[str, list[dict | None]] = {s: [] for s in systems}
    for rate in sorted(rates):
        for s in systems:
            last = next((x for x in reversed(out[s]) if x is not None), None)
            if last is not None and last["attainment"] < stop_below:
                out[s].append(None)
            else:
                out[s].append(run_one(s, rate))
            progress.update(1)
    return out


def decode_vs_hf(quick: bool = False, *, new_tokens: int | None = None, batch: int = 32, prompt_len: int = 128,
                 repeats: int = 1, device: str = "cpu") -> dict:
    """P7: decode throughput of the grserve engine vs HF transformers ``generate``, same weights, same run.

    Shape ``tiny`` (32k vocab), batch 32, prompt 128, 128 new tokens (32 with ``quick``), greedy, fp32,
    end to end (prefill included) for both: tok/s = batch · new / wall time. Weights: the seeded ``tiny``
    preset, loaded into ``Qwen3ForCausalLM`` with ``load_state_dict`` (so both produce the same tokens; checked).
    Best of ``repeats`` alternating runs (the machine is shared).
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.model import load_model
    from grserve.scheduler.fcfs import FCFSScheduler

    new = new_tokens or (32 if quick else 128)
    batch, plen = batch, prompt_len
    model = load_model("tiny", seed=0)  # seeded on the CPU (the same weights on every device), then moved
    model = model.to(device) if device != "cpu" else model
    spec = model.spec
    prompts = torch.randint(3, spec.vocab_size, (batch, plen), generator=torch.Generator().manual_seed(0))
    plists = [p.tolist() for p in prompts]
    blocks = batch * 2 * -(-(plen + new) // 16) + 16
    eng = build_model_engine(model, FCFSScheduler(max_num_batched_tokens=batch * plen), num_blocks=blocks,
                             block_size=16)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    cfg = Qwen3Config(**{k: v for k, v in spec.to_hf_config().items() if k not in ("architectures", "model_type",
                                                                                   "torch_dtype", "dtype")})
    hf = Qwen3ForCausalLM(cfg).float().eval()
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"weights do not map onto HF: missing {missing}, unexpected {unexpected}")
    hf.tie_weights()
    hf, prompts = hf.to(device), prompts.to(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    eng.generate(plists[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    with torch.no_grad():
        hf.generate(prompts[:2], max_new_tokens=4, do_sample=False)
    ours_t, hf_t = [], []
    ours_out = hf_out = None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        ours_out = eng.generate(plists, params)
        ours_t.append(time.perf_counter() - t0)
        with torch.no_grad():
            t0 = time.perf_counter()
            out = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)
            sync()
            hf_t.append(time.perf_counter() - t0)
        hf_out = out[:, plen:].tolist()
    ours, theirs = batch * new / min(ours_t), batch * new / min(hf_t)
    return {"ours_tok_s": ours, "hf_tok_s": theirs, "speedup": ours / theirs, "batch": batch, "prompt": plen,
            "new_tokens": new, "threads": torch.get_num_threads(), "same_tokens": ours_out == hf_out,
            "ours_s": ours_t, "hf_s": hf_t, "hf_attn": cfg._attn_implementation, "device": device}


def _prefix_prompts(requests: int, system_len: int, user_len: int):
    import torch

    from grserve.model import load_model

    model = load_model("tiny", seed=0)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, model.spec.vocab_size, (system_len,), generator=g).tolist()
    return model, [system + torch.randint(3, model.spec.vocab_size, (user_len,), generator=g).tolist()
                   for _ in range(requests)]


def _blocks_in_use(eng, block_size: int) -> int:
    """Pool blocks held (tables + shared cache), plus a copying store's cached tokens in K+V blocks."""
    used = eng.pool.num_used
    tree = getattr(eng.prefix_cache, "tree", None)
    return used + (2 * -(-tree.size // block_size) if tree is not None else 0)


def prefix_vs_none(*, requests: int = 32, system_len: int = 512, user_len: int = 32, new_tokens: int = 8,
                   batch: int = 8, repeats: int = 2) -> dict:
    """Prefix cache: ``requests`` prompts = one shared ``system_len``-token system prompt + ``user_len`` own tokens,
    ``new_tokens`` greedy each, in waves of ``batch`` (FCFS, tiny, fp32), without a prefix cache ("none"), with
    the copying store ("copy") and with shared blocks ("prefix", the default mode). Reports prefill tokens
    computed, wall time (best of ``repeats``), mean TTFT and the peak blocks in use of each."""
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.scheduler.fcfs import FCFSScheduler

    model, prompts = _prefix_prompts(requests, system_len, user_len)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    blocks = 2 * batch * -(-(system_len + user_len + new_tokens) // 16) + 16
    cap = 4 * (system_len + user_len)
    out: dict = {"requests": requests, "system_len": system_len, "user_len": user_len, "new_tokens": new_tokens,
                 "batch": batch}
    tokens = {}
    for name, cap_, mode in (("none", 0, "copy"), ("copy", cap, "copy"), ("prefix", cap, "share")):
        best = None
        for _ in range(max(1, repeats)):
            eng = build_model_engine(model, FCFSScheduler(), num_blocks=blocks + (cap // 8 if mode == "share" else 0),
                                     block_size=16, prefix_cache_tokens=cap_, prefix_cache_mode=mode)
            eng.keep_finished = True
            peak = [0]
            eng.on_iteration = lambda plan, dt, e=eng, pk=peak: pk.__setitem__(0, max(pk[0], _blocks_in_use(e, 16)))
            got, t0 = [], time.perf_counter()
            for i in range(0, requests, batch):
                got += eng.generate(prompts[i:i + batch], params)
            wall = time.perf_counter() - t0
            ttft = sum(s.token_times[0] - s.arrival for s in eng.finished) / len(eng.finished)
            if best is None or wall < best["wall_s"]:
                best = {"wall_s": wall, "mean_ttft_s": ttft, "prefill_tokens": eng.stats["prefill_tokens"],
                        "prefix_hit_tokens": eng.stats["prefix_hit_tokens"], "peak_blocks": peak[0]}
            tokens[name] = got
        out[name] = best
    out["same_tokens"] = tokens["none"] == tokens["prefix"] == tokens["copy"]
    out["speedup"] = out["none"]["wall_s"] / out["prefix"]["wall_s"]
    out["ttft_speedup"] = out["none"]["mean_ttft_s"] / out["prefix"]["mean_ttft_s"]
    out["ttft_speedup_copy"] = out["none"]["mean_ttft_s"] / out["copy"]["mean_ttft_s"]
    return out


def shared_vs_copied_blocks(*, requests: int = 32, system_len: int = 512, user_len: int = 32,
                            new_tokens: int = 8) -> dict:
    """Blocks in use when ``requests`` requests sharing a ``system_len``-token prompt run *together* (after one
    request has cached the prompt): the copying store gives each its own blocks for the whole prompt (and keeps
    its cached copy), sharing attaches the same blocks to all. Peak blocks over the run, tokens checked equal."""
    from grserve.engine.llm import build_model_engine
    from grserve.engine.sampling import SamplingParams
    from grserve.scheduler.fcfs import FCFSScheduler

    model, prompts = _prefix_prompts(requests + 1, system_len, user_len)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    per_req = 2 * -(-(system_len + user_len + new_tokens) // 16)
    out: dict = {"requests": requests, "system_len": system_len, "user_len": user_len, "new_tokens": new_tokens}
    tokens = {}
    for mode in ("copy", "share"):
        eng = build_model_engine(model, FCFSScheduler(max_num_batched_tokens=1 << 20), block_size=16,
                                 num_blocks=(requests + 2) * per_req, prefix_cache_tokens=2 * (system_len + user_len),
                                 prefix_cache_mode=mode)
        eng.keep_finished = True
        eng.generate(prompts[:1], params)  # caches the system prompt
        peak = [0]
        eng.on_iteration = lambda plan, dt, e=eng: peak.__setitem__(0, max(peak[0], _blocks_in_use(e, 16)))
        n0 = len(eng.finished)
        tokens[mode] = eng.generate(prompts[1:], params)
        done = eng.finished[n0:]
        out[mode] = {"peak_blocks": peak[0], "prefix_hit_tokens": eng.stats["prefix_hit_tokens"],
                     "mean_ttft_s": sum(s.token_times[0] - s.arrival for s in done) / len(done)}
    out["same_tokens"] = tokens["copy"] == tokens["share"]
    out["block_ratio"] = out["share"]["peak_blocks"] / out["copy"]["peak_blocks"]
    return out


def _print_prefix_only() -> int:
    """``--prefix-only``: the prefix-cache benchmark and the shared-vs-copied blocks count."""
    r = prefix_vs_none()
    print(f"prefix cache: {r['requests']} requests = {r['system_len']}-token shared system prompt + "
          f"{r['user_len']} own tokens, {r['new_tokens']} new, waves of {r['batch']}: prefill tokens "
          f"{r['none']['prefill_tokens']} -> {r['prefix']['prefill_tokens']}, wall {r['none']['wall_s']:.2f} -> "
          f"{r['prefix']['wall_s']:.2f} s ({r['speedup']:.2f}x), mean TTFT {r['none']['mean_ttft_s']*1e3:.0f} -> "
          f"{r['prefix']['mean_ttft_s']*1e3:.0f} ms shared ({r['ttft_speedup']:.2f}x), "
          f"{r['copy']['mean_ttft_s']*1e3:.0f} ms copied ({r['ttft_speedup_copy']:.2f}x); "
          f"same tokens: {r['same_tokens']}", file=sys.stderr)
    b = shared_vs_copied_blocks()
    r["blocks"] = b
    print(f"blocks in use, {b['requests']} concurrent requests sharing a {b['system_len']}-token prompt: "
          f"copy {b['copy']['peak_blocks']}, share {b['share']['peak_blocks']} ({b['block_ratio']:.3f} of the "
          f"copy's); same tokens: {b['same_tokens']}", file=sys.stderr)
    print(json.dumps(r), flush=True)
    return 0


def _print_decode_only(cfg: ServeBenchConfig) -> int:
    """``--decode-only``: the batch-32 decode vs HF benchmark (P7)."""
    dec = decode_vs_hf(cfg.quick, repeats=cfg.decode_repeats or (1 if cfg.quick else 2), device=cfg.device)
    print(f"decode batch {dec['batch']} (tiny, 32k vocab, prompt {dec['prompt']}, {dec['new_tokens']} new, "
          f"{dec['threads']} thread(s)): grserve {dec['ours_tok_s']:.0f} tok/s, HF generate "
          f"{dec['hf_tok_s']:.0f} tok/s -> {dec['speedup']:.2f}x; same tokens: {dec['same_tokens']}",
          file=sys.stderr)
    print(json.dumps(dec), flush=True)
    return 0


@dataclass
class _Setup:
    """What a sweep runs under: the SLOs, the pool, the scheduler's rho, the model (real mode) or cost model
    (simulate), the single-request latency and what the summary reports of it (``info``)."""

    n_req: int
    info: dict
    ttft_slo: float
    tbt_slo: float
    num_blocks: int
    hidden_planes: int
    rho: float
    single: float
    model: object = None
    cost: object = None


def _simulated_setup(cfg: ServeBenchConfig, mean_p: float, mean_o: float) -> dict:
    """``--simulate``: OPT-13B on an A100 (the cost model), Table 3's SLOs."""
    from grserve_bench.aptserve_repro import kv_blocks_opt13b_a100
    from grserve_bench.simulator import CostModel

    cost = CostModel.preset(cfg.cost_model)
    ttft_slo, tbt_slo = TABLE3[cfg.dataset]
    single = cost.iteration_time([_Item(0, int(mean_p), "kv")]) + mean_o * cost.iteration_time(
        [_Item(int(mean_p + mean_o / 2), 1, "kv")])
    return dict(ttft_slo=ttft_slo, tbt_slo=tbt_slo, num_blocks=kv_blocks_opt13b_a100(), hidden_planes=1,
                rho=cost.rho_h, single=single, model=None, cost=cost)


def _real_setup(cfg: ServeBenchConfig, timer: str, mean_p: float, mean_o: float, info: dict) -> dict:
    """Real mode: load the model, calibrate rho, time one request alone (engine, FCFS, as the sweep times it);
    the SLOs are multiples of its prefill and decode-step latencies, the pool holds ``--mem-requests`` of it."""
    from grserve.engine.llm import LLMEngine, build_model_engine, calibrate_rho
    from grserve.engine.sampling import SamplingParams
    from grserve.model import load_model
    from grserve.scheduler.llm_factory import make_llm_scheduler
    from grserve_bench.simulator import TimedExecutor, VirtualClock

    model = load_model(cfg.model, seed=cfg.seed)
    spec = model.spec
    rho = calibrate_rho(model, timer=time.thread_time if timer == "thread" else time.perf_counter)
    hidden_planes = -(-spec.hidden_size // spec.kv_size)
    # single-request latencies (engine, FCFS, one request alone), timed as the sweep is
    cal = build_model_engine(model, make_llm_scheduler("fcfs"), num_blocks=4096, block_size=cfg.block_size)
    eng = LLMEngine(cal.scheduler, cal.pool, TimedExecutor(cal.executor, timer), clock=VirtualClock())
    eng.generate([[5] * 16], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    ts = []
    for _ in range(3):
        eng.keep_finished = True
        eng.generate([[5] * int(mean_p)], SamplingParams(max_tokens=int(mean_o), temperature=0.0,
                                                         ignore_eos=True))
        s = eng.finished[-1]
        ts.append((s.token_times[0] - s.arrival, (s.token_times[-1] - s.token_times[0]) / max(1, len(
            s.token_times) - 1)))
    prefill_lat = min(t[0] for t in ts)
    step_lat = min(t[1] for t in ts)
    per_tok_kv = 2 * cfg.block_size
    num_blocks = int(cfg.mem_requests * (mean_p + mean_o) / cfg.block_size * 2) + per_tok_kv
    info.update(single_prefill_s=prefill_lat, single_step_s=step_lat, model=cfg.model, timer=timer)
    return dict(ttft_slo=cfg.ttft_mult * prefill_lat, tbt_slo=cfg.tbt_mult * step_lat, num_blocks=num_blocks,
                hidden_planes=hidden_planes, rho=rho, single=prefill_lat + mean_o * step_lat, model=model, cost=None)


def _setup(cfg: ServeBenchConfig, timer: str) -> _Setup:
    """The workload's mean lengths (a probe trace), then the simulated or the real setting."""
    n_req = cfg.num_requests or ((24 if cfg.quick else 40) if not cfg.simulate else (200 if cfg.quick else 500))
    probe = make_trace(cfg.dataset, n_req, 1.0, cv=cfg.cv, seed=cfg.seed,
                       scale=1.0 if cfg.simulate else cfg.scale)
    mean_p = sum(r.prompt_len for r in probe) / n_req
    mean_o = sum(r.output_len for r in probe) / n_req
    info: dict = {"mode": "simulate" if cfg.simulate else "real", "dataset": cfg.dataset, "cv": cfg.cv,
                  "num_requests": n_req, "mean_prompt": mean_p, "mean_output": mean_o}
    got = _simulated_setup(cfg, mean_p, mean_o) if cfg.simulate else _real_setup(cfg, timer, mean_p, mean_o, info)
    return _Setup(n_req=n_req, info=info, **got)


def _rates(cfg: ServeBenchConfig, single: float) -> list[float]:
    """``--rates``, else multiples of the single-request service rate (real) or the simulator's fixed grid."""
    mu = 1.0 / single  # single-request service rate
    if cfg.rates:
        return split_commas(cfg.rates, float)
    mults = [2, 4, 6, 8] if cfg.quick else [1, 2, 3, 4, 6, 8, 10, 12]  # x single-request service rate
    return [round(mu * m, 3) for m in mults] if not cfg.simulate else \
        ([0.5, 1, 2, 3, 4, 6] if cfg.quick else [0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])


def _make_run_one(cfg: ServeBenchConfig, st: _Setup, timer: str):
    """``run_one(system, rate)``: one trace at ``rate`` through a fresh engine with ``system``'s scheduler;
    returns its attainment (with the rate, hidden-cache schedules and preemptions)."""
    from grserve.engine.llm import LLMEngine, build_model_engine
    from grserve.kvcache.blocks import BlockPool
    from grserve.scheduler.llm_factory import make_llm_scheduler
    from grserve_bench.simulator import SimulatedExecutor, TimedExecutor, VirtualClock, run_trace

    def run_one(system: str, rate: float) -> dict:
        trace = make_trace(cfg.dataset, st.n_req, rate, cv=cfg.cv, seed=cfg.seed,
                           scale=1.0 if cfg.simulate else cfg.scale)
        clock = VirtualClock()
        pool = BlockPool(st.num_blocks, cfg.block_size, kv_planes=2, hidden_planes=st.hidden_planes)
        pol = make_llm_scheduler(system, ttft_slo=st.ttft_slo, tbt_slo=st.tbt_slo, rho=st.rho,
                                 token_budget=512 if cfg.simulate else 128,
                                 max_num_batched_tokens=2048 if cfg.simulate else 512,
                                 watermark=0.01 if cfg.simulate else 0.0)
        if cfg.simulate:
            eng = LLMEngine(pol, pool, SimulatedExecutor(st.cost), clock=clock)
        else:
            real = build_model_engine(st.model, pol, num_blocks=st.num_blocks, block_size=cfg.block_size)
            eng = LLMEngine(pol, real.pool, TimedExecutor(real.executor, timer), clock=clock)
        res = run_trace(eng, trace, clock)
        a = attainment(res.requests, st.ttft_slo, st.tbt_slo)
        a.update(rate=rate, hidden_scheduled=res.stats["hidden_scheduled"], preemptions=res.stats["preemptions"])
        return a

    return run_one


def _sweep_and_refine(cfg: ServeBenchConfig, run_one, rates: list[float], systems: list[str]):
    """The grid sweep, then each system's own points: the grid, then bisection of its 90 % crossing; returns
    the sweep, the points and each system's effective throughput."""
    from tqdm import tqdm

    total = len(rates) * len(systems)
    with tqdm(total=total, desc="rate sweep", file=sys.stderr) as bar:
        sweep = _sweep(run_one, rates, systems, bar, cfg.stop_below)
    # each system's own points: the grid, then bisection of its 90 % crossing (a coarse grid's linear
    # interpolation can misplace a cliff by most of a grid step)
    points = {s: sorted(((r, x) for r, x in zip(rates, sweep[s]) if x is not None), key=lambda x: x[0])
              for s in systems}
    if cfg.refine > 0:
        with tqdm(total=cfg.refine * len(systems), desc="refine crossing", file=sys.stderr) as bar:
            for s in systems:
                points[s] = _refine(run_one, s, points[s], cfg.refine, bar)
    eff = {s: effective_throughput([r for r, _ in points[s]], [x["attainment"] for _, x in points[s]])
           for s in systems}
    return sweep, points, eff


def _print_table(console, cfg: ServeBenchConfig, st: _Setup, systems, rates, sweep, points, eff) -> None:
    from rich.table import Table

    table = Table(title=f"SLO attainment ({st.info['mode']}, {cfg.dataset}, CV {cfg.cv}; TTFT {st.ttft_slo:.3g}s, "
                        f"P99 TBT {st.tbt_slo:.3g}s)")
    table.add_column("rate (req/s)", justify="right")
    for s in systems:
        table.add_column(s, justify="right")
    for i, r in enumerate(rates):
        table.add_row(f"{r:.3g}", *["—" if sweep[s][i] is None else
                                    f"{sweep[s][i]['attainment']:.0%} (ttft {sweep[s][i]['ttft_attainment']:.0%})"
                                    for s in systems])
    if cfg.refine > 0:
        table.add_row("refined points", *[", ".join(f"{r:.3g}: {x['attainment']:.0%}" for r, x in points[s]
                                                   if r not in rates) for s in systems])
    table.add_row("effective @90%", *[f"{eff[s]:.3g}" for s in systems])
    console.print(table)


def _plot(cfg: ServeBenchConfig, mode: str, systems, points, out_dir: Path) -> Path:
    """Attainment vs rate, one line per system; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in systems:
        ax.plot([r for r, _ in points[s]], [x["attainment"] * 100 for _, x in points[s]], marker="o", label=s)
    ax.axhline(90, ls="--", c="grey")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{cfg.dataset} ({mode})")
    ax.legend()
    fig.tight_layout()
    png = out_dir / f"attainment_vs_rate_{mode}_{cfg.dataset}.png"
    fig.savefig(png, dpi=120)
    return png


def _simulated_effective(cfg: ServeBenchConfig, console, out_dir: Path) -> dict:
    """Real mode's paper-scale counterpart: the simulator's effective throughput at 90 % per dataset (seconds)."""
    from tqdm import tqdm

    from grserve_bench import aptserve_repro as repro

    with tqdm(desc="simulated effective throughput", file=sys.stderr) as bar:
        sim = repro.effective_table(repro.Runner(lambda: bar.update(1), cache_dir=out_dir / "sim-cache"),
                                    repro.Setting(cost=cfg.cost_model), levels=(0.9,), steps=2)
    out = {ds: {x: v[0.9] for x, v in row.items()} for ds, row in sim.items()}
    console.print(f"simulated (OPT-13B/A100, {cfg.cost_model}) effective throughput @90%: {out}")
    return out


def run(cfg: ServeBenchConfig) -> int:
    import torch

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    if cfg.prefix_only:
        return _print_prefix_only()
    if cfg.decode_only:
        return _print_decode_only(cfg)
    if cfg.simulate and (cfg.paper_tables or cfg.ladder):
        return _run_paper(cfg)
    from rich.console import Console

    systems = split_commas(cfg.systems)
    timer = cfg.timer if torch.get_num_threads() == 1 else "wall"  # thread CPU time misses other OpenMP threads
    console = Console(stderr=False)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    st = _setup(cfg, timer)
    info = st.info
    rates = _rates(cfg, st.single)
    info.update(ttft_slo=st.ttft_slo, tbt_slo=st.tbt_slo, num_blocks=st.num_blocks, rho=st.rho, rates=rates)
    rates = sorted(rates)
    sweep, points, eff = _sweep_and_refine(cfg, _make_run_one(cfg, st, timer), rates, systems)
    _print_table(console, cfg, st, systems, rates, sweep, points, eff)
    png = _plot(cfg, info["mode"], systems, points, out_dir)

    dec = None
    if cfg.decode_bench:
        dec = decode_vs_hf(cfg.quick, repeats=cfg.decode_repeats or (1 if cfg.quick else 2), device=cfg.device)
        console.print(f"decode batch 32 (tiny, 32k vocab, {dec['new_tokens']} new, {dec['threads']} thread(s)): "
                      f"grserve {dec['ours_tok_s']:.0f} tok/s, HF generate {dec['hf_tok_s']:.0f} tok/s -> "
                      f"{dec['speedup']:.2f}x; same tokens: {dec['same_tokens']}")
    ratios = {f"{a.replace('-', '_')}_vs_{b}": (eff[a] / eff[b] if eff[b] else None)
              for a in ("aptserve", "aptserve-kv") for b in ("fcfs", "chunked") if a in eff and b in eff}
    summary = {"effective_throughput": eff, **ratios, "decode_speedup_vs_hf": dec["speedup"] if dec else None,
               "png": str(png), **{k: v for k, v in info.items() if k != "rates"}}
    if not cfg.simulate and cfg.sim_effective:  # the paper-scale counterpart, at 90 % (the simulator, seconds)
        summary["simulated_effective_throughput"] = _simulated_effective(cfg, console, out_dir)
    (out_dir / f"serve_{info['mode']}_{cfg.dataset}.json").write_text(json.dumps(
        {"summary": summary, "sweep": sweep, "points": {k: [[r, x] for r, x in v] for k, v in points.items()},
         "decode": dec}, indent=2))
    print(json.dumps(summary), flush=True)
    return 0


def _pct(x) -> str:
    return "—" if x is None else f"{x:.1f}"


def _run_paper(cfg: ServeBenchConfig) -> int:
    """``--simulate --paper-tables`` / ``--ladder``: the paper-scale reproduction (grserve_bench/aptserve_repro.py)."""
    import dataclasses

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    from grserve_bench import aptserve_repro as R

    console = Console()
    s = R.Setting(cost=cfg.cost_model, seed=cfg.seed, num_requests=cfg.num_requests or 500)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary: dict = {"mode": "simulate", "setting": dataclasses.asdict(s)}
    t0 = time.perf_counter()
    with tqdm(desc="simulations", file=sys.stderr) as bar:
        runner = R.Runner(lambda: bar.update(1), cache_dir=out_dir / "sim-cache")
        if cfg.ladder:  # each piece on top of the previous ones, then alternatives to the final setting (90 %)
            systems = ("fcfs", "aptserve")
            rows, st = [], R.BEFORE
            for label, change in R.LADDER + R.ALTERNATIVES:
                cur = (st := st.replace(**change)) if (label, change) in R.LADDER else st.replace(**change)
                rows.append({"piece": label, "setting": dataclasses.asdict(cur),
                             "eff": {x: runner.crossings(cur, "sharegpt", x, levels=(0.9,))[0.9] for x in systems}})
            t = Table(title="ShareGPT, Poisson: effective throughput (req/s) at 90% after each piece")
            t.add_column("piece")
            for x in systems:
                t.add_column(x, justify="right")
            t.add_column("aptserve / fcfs", justify="right")
            for row in rows:
                e = row["eff"]
                t.add_row(row["piece"], *[f"{e[x]:.2f}" for x in systems],
                          f"{e['aptserve'] / e['fcfs']:.2f}x" if e["fcfs"] else "—")
            console.print(t)
            summary["ladder"] = [{"piece": r["piece"], "eff_90": r["eff"]} for r in rows]
        if cfg.paper_tables:
            abl = R.ablation_tables(runner, s)
            t = Table(title=f"Tables 4 and 5 in shape: SLO attainment (%), ours (paper) — cost model {s.cost}")
            for c in ("dataset", "rate", "CV", "T5 FCFS (hybrid)", "T5/T4 adaptive (hybrid)", "T4 KV-only",
                      "vLLM FCFS (KV)"):
                t.add_column(c, justify="right")
            for r in abl:
                o, p = r["ours"], r["paper"]
                t.add_row(r["dataset"], f"{r['rate']:g}", f"{r['cv']:g}",
                          *[f"{o[x]:.1f} ({_pct(p.get(x))})" for x in ("fcfs-hybrid", "aptserve", "aptserve-kv")],
                          f"{o['fcfs']:.1f}")
            console.print(t)
            eff = R.effective_table(runner, s)
            t = Table(title="Effective throughput (req/s) at 90% / 60% attainment; Apt-Serve's gain (paper's)")
            for c in ("dataset", "fcfs", "chunked", "aptserve", "apt/fcfs @90", "apt/chunked @90", "apt/fcfs @60",
                      "apt/chunked @60"):
                t.add_column(c, justify="right")
            gains: dict = {}
            for ds, row in eff.items():
                g = {}
                for lv in (0.9, 0.6):
                    for b in ("fcfs", "chunked"):
                        g[f"{b}_{int(lv * 100)}"] = row["aptserve"][lv] / row[b][lv] if row[b][lv] else None
                gains[ds] = g
                pg = R.PAPER_GAIN[ds]
                t.add_row(ds, *[f"{row[x][0.9]:.2f} / {row[x][0.6]:.2f}" for x in ("fcfs", "chunked", "aptserve")],
                          *[f"{_pct(g[k]) if g[k] is None else format(g[k], '.2f')}x ({pg[lv][i]}x)"
                            for k, lv, i in (("fcfs_90", 0.9, 0), ("chunked_90", 0.9, 1), ("fcfs_60", 0.6, 0),
                                             ("chunked_60", 0.6, 1))])
            console.print(t)
            summary.update(table45=[{**r, "ours": {k: round(v, 1) for k, v in r["ours"].items()}} for r in abl],
                           effective_throughput={ds: {x: {"90": v[0.9], "60": v[0.6]} for x, v in row.items()}
                                                 for ds, row in eff.items()},
                           aptserve_gain=gains)
    summary["wall_s"] = time.perf_counter() - t0
    summary["simulations"] = len(runner.cache)
    (out_dir / "paper_tables.json").write_text(json.dumps(summary, indent=2, default=str))
    print(json.dumps(summary, default=str), flush=True)
    return 0


class _Item:
    def __init__(self, start: int, num_new: int, kind: str):
        self.start, self.num_new, self.kind = start, num_new, kind
