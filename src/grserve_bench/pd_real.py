"""Part 'real' of ``grserve bench pd`` (bench/pd.py): PD disaggregation with role flips on a real local Ray.

Three instances of a small preset (``--real-model``, 1 torch thread each) behind ``ClusterLLMEngine`` with ``--pd``
(one instance starts in the prefill pool, two in the decode pool; the split threshold is the break-even of the
cost model measured at start-up). Then:

1. **Warm-up and SLOs.** Two long prompts alone (split, queue empty) give the uncontended TTFT of a long prompt
   ``t_ttft``; one short prompt with a long output alone gives the single-stream token interval ``t_tok``. The
   SLOs are multiples of these measured per-request costs: TTFT SLO = ``--real-ttft-slo-x`` · ``t_ttft`` (default
   2: a long prompt that waits behind about one other long prompt breaks it), TPOT SLO = ``--real-tpot-slo-x`` ·
   ``t_tok`` (default 1.5: a decode instance whose batch slows each token by half breaks it). Nothing else steers
   the flips: they come from ``pd_policy.decide_flip`` on the signals of the run.
2. **Long-prompt phase.** ``--real-long-prompts`` requests of ``--real-prompt-tokens`` uncached tokens (short
   outputs) arrive every ``--real-prompt-gap-x`` · ``t_ttft`` seconds: faster than one prefill instance finishes
   them, so its queue grows and the predicted TTFT breaks the SLO → D→P.
3. **Long-output phase.** ``--real-long-outputs`` requests of short prompts (below the split threshold: they run
   whole on decode-role instances) and ``--real-output-tokens`` outputs, all at once: the decode pool's token
   interval grows past the TPOT SLO and the prefill pool idles → P→D.
4. The same requests (same arrival offsets) on the same instances **without PD** (KV-aware router only, prefix
   caches emptied), and on one engine in this process (the reference of ``pd_identical_outputs``, greedy).

Keys: ``pd_identical_outputs``, ``nopd_identical_outputs``, ``flips_p_to_d``, ``flips_d_to_p``,
``pd_lost_requests``, ``kv_bytes_moved``, ``kv_bytes_expected`` (Σ over the requests handed to another instance
of 2 · layers · prompt tokens · kv_heads · head_dim · dtype bytes), ``pd_splits``, ``pd_handoffs``, ``pd_stayed``
(split, but decoded where they prefilled: that instance flipped to decode meanwhile), ``pd_whole``, ``pd_split_min_tokens``, the cost
model, the SLOs and what they were derived from, the flip log, and per phase mean TTFT / TPOT with and without PD.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from grserve.flags import Checked, at_least, flag, positive, positive_int


@dataclass(frozen=True)
class PartConfig(Checked):
    real_model: str = flag("tiny", "part real: model preset or HF dir", metavar="PRESET_OR_DIR")
    real_long_prompts: int = flag(14, "part real: requests in the long-prompt phase", check=positive_int)
    real_prompt_tokens: int = flag(1536, "part real: prompt tokens of a long-prompt request", check=positive_int)
    real_prompt_output: int = flag(8, "part real: output tokens of a long-prompt request", check=positive_int)
    real_prompt_gap_x: float = flag(0.5, "part real: long prompts arrive every this × the uncontended long-prompt "
                                         "TTFT", check=positive)
    real_long_outputs: int = flag(12, "part real: requests in the long-output phase", check=positive_int)
    real_output_tokens: int = flag(192, "part real: output tokens of a long-output request", check=positive_int)
    real_short_prompt: int = flag(8, "part real: prompt tokens of a long-output request (below the split "
                                     "threshold)", check=positive_int)
    real_ttft_slo_x: float = flag(2.0, "part real: TTFT SLO = this × the measured uncontended long-prompt TTFT",
                                  check=positive)
    real_tpot_slo_x: float = flag(1.5, "part real: TPOT SLO = this × the measured single-stream token interval",
                                  check=positive)
    real_min_dwell_s: float = flag(1.0, "part real: --min-dwell-s of the role flips", check=at_least(0.0))
    real_nopd: bool = flag(True, "part real: also run the requests without PD on the same instances")
    real_seed: int = flag(0, "part real: seed of the prompts", check=at_least(0))


def _launch(cfg: PartConfig):
    from grserve.cluster.llm.front_end import ClusterLLMEngine
    from grserve.config import ClusterConfig, LLMConfig, LLMServeConfig, ModelConfig, PDConfig, SLOConfig

    need = cfg.real_prompt_tokens + cfg.real_output_tokens + 64
    # float32: pd_identical_outputs compares token for token with one engine whose batches differ; the LLM engine is
    # not batch-invariant, and at bf16 (the default --dtype auto on a CPU with fast bf16) a batch can flip a token
    serve = LLMServeConfig(model=ModelConfig(source=cfg.real_model, dtype="float32"),
                           llm=LLMConfig(scheduler="fcfs", num_blocks=4096, prefix_cache_tokens=65536),
                           slo=SLOConfig(ttft_slo_s=3600.0, tpot_slo_s=3600.0),  # set after the warm-up
                           pd=PDConfig(pd=True, prefill_instances=1, split_min_tokens=0,
                                       min_dwell_s=cfg.real_min_dwell_s, min_per_role=1))
    cc = ClusterConfig(instances=3, routing="kv", heartbeat_timeout_s=5.0, instance_threads=1)
    eng = ClusterLLMEngine.launch(serve, cc).start()
    if eng.max_model_len < need:
        raise ValueError(f"model length {eng.max_model_len} < {need}")
    return serve, eng


def _requests(cfg: PartConfig, vocab: int) -> tuple[list[tuple[float, list[int], object]], list[int]]:
    """(arrival offset in units of t_ttft for phase 1, or -1 for phase 2; prompt; params); phase sizes."""
    from grserve.engine.sampling import SamplingParams

    rng = np.random.default_rng(cfg.real_seed)
    a = SamplingParams(max_tokens=cfg.real_prompt_output, temperature=0, ignore_eos=True)
    b = SamplingParams(max_tokens=cfg.real_output_tokens, temperature=0, ignore_eos=True)
    reqs = [(k * cfg.real_prompt_gap_x, rng.integers(3, vocab, cfg.real_prompt_tokens).tolist(), a)
            for k in range(cfg.real_long_prompts)]
    reqs += [(-1.0, rng.integers(3, vocab, cfg.real_short_prompt).tolist(), b) for _ in range(cfg.real_long_outputs)]
    return reqs, [cfg.real_long_prompts, cfg.real_long_outputs]


def _run_one(eng, prompt, params, rid: str) -> dict:
    from grserve.engine.types import LLMRequest

    h = eng.submit(LLMRequest(prompt, params, request_id=rid))
    h.future.result(timeout=300)
    rec = eng.finished[-1]
    return {"ttft": rec.first_token_at - rec.submitted_at}


def _warm_up(eng, cfg: PartConfig, vocab: int) -> dict:
    """The per-request costs the SLOs are multiples of (each request alone on the cluster)."""
    from grserve.engine.sampling import SamplingParams
    from grserve.engine.types import LLMRequest

    rng = np.random.default_rng(cfg.real_seed + 99)
    eng.keep_finished = True
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ttfts = [_run_one(eng, rng.integers(3, vocab, cfg.real_prompt_tokens).tolist(), sp, f"warm-p{k}")["ttft"]
             for k in range(3)]
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    h = eng.submit(LLMRequest(rng.integers(3, vocab, cfg.real_short_prompt).tolist(), sp, request_id="warm-d"))
    t_end = [0.0]
    h.future.add_done_callback(lambda _f: t_end.__setitem__(0, time.perf_counter()))
    h.future.result(timeout=300)
    rec = eng.finished[-1]
    tok = (t_end[0] - rec.first_token_at) / (sp.max_tokens - 1)
    return {"t_ttft_long_s": float(np.median(ttfts[1:])), "t_token_s": tok, "ttft_samples_s": ttfts}


def _replay(eng, reqs, t_ttft: float, tag: str) -> dict:
    """Phase 1 on its arrival schedule, then (after it drained) phase 2 at once. Per request: output ids, TTFT,
    TPOT, split or not, error."""
    from grserve.engine.types import LLMRequest

    eng.keep_finished = True
    eng.finished = []
    out: dict[str, dict] = {}
    lock = threading.Lock()

    def submit(k: int, prompt, params) -> object:
        rid = f"{tag}-{k}"
        h = eng.submit(LLMRequest(prompt, params, request_id=rid))
        split = eng.pd is not None and eng.pd.phase(rid) == "prefill"
        with lock:
            out[rid] = {"rid": rid, "k": k, "split": split, "n_prompt": len(prompt)}

        def done(f, rid=rid):
            with lock:
                out[rid]["end"] = time.perf_counter()
        h.future.add_done_callback(done)
        return h

    def wait(hs) -> None:
        for h in hs:
            try:
                h.future.result(timeout=300)
            except Exception as exc:  # noqa: BLE001 - counted as lost
                out[h.request_id]["error"] = repr(exc)

    t0, m0 = time.perf_counter(), time.monotonic()
    phase1 = [(k, r) for k, r in enumerate(reqs) if r[0] >= 0]
    phase2 = [(k, r) for k, r in enumerate(reqs) if r[0] < 0]
    hs = []
    for k, (at, prompt, params) in phase1:
        delay = t0 + at * t_ttft - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        hs.append(submit(k, prompt, params))
    wait(hs)
    t1, m1 = time.perf_counter(), time.monotonic()
    hs = [submit(k, prompt, params) for k, (_, prompt, params) in phase2]
    wait(hs)
    t2 = time.perf_counter()
    for rec in eng.finished:
        o = out.get(rec.request_id)
        if o is None:
            continue
        o["ids"] = list(rec.stream.output_ids)
        o["ttft"] = rec.first_token_at - rec.submitted_at if rec.first_token_at else None
        n = len(o["ids"])
        if n > 1 and "end" in o and rec.first_token_at:
            o["tpot"] = (o["end"] - rec.first_token_at) / (n - 1)
    rows = [out[f"{tag}-{k}"] for k in range(len(reqs))]
    return {"rows": rows, "phase_s": [t1 - t0, t2 - t1], "phase_start": [m0, m1]}


def _phase_stats(rows: list[dict], sizes: list[int], prefix: str) -> dict:
    p1, p2 = rows[:sizes[0]], rows[sizes[0]:]

    def mean(vals):
        vals = [v for v in vals if v is not None]
        return float(np.mean(vals)) if vals else None

    return {f"{prefix}_long_prompt_ttft_mean_s": mean(r.get("ttft") for r in p1),
            f"{prefix}_long_prompt_ttft_p90_s": float(np.percentile([r["ttft"] for r in p1 if r.get("ttft")], 90))
            if any(r.get("ttft") for r in p1) else None,
            f"{prefix}_long_output_tpot_mean_s": mean(r.get("tpot") for r in p2),
            f"{prefix}_long_output_ttft_mean_s": mean(r.get("ttft") for r in p2)}


def run_part(cfg: PartConfig) -> dict:
    """Run this part; return its keys for the JSON line."""
    import torch

    from grserve.config import SLOConfig

    t_start = time.perf_counter()
    serve, eng = _launch(cfg)
    pd = eng.pd
    for line in eng.describe():
        print(f"  {line}", flush=True)
    vocab = eng.instances[0].info.vocab_size
    reqs, sizes = _requests(cfg, vocab)
    res: dict = {}
    try:
        warm = _warm_up(eng, cfg, vocab)
        slo = SLOConfig(ttft_slo_s=cfg.real_ttft_slo_x * warm["t_ttft_long_s"],
                        tpot_slo_s=cfg.real_tpot_slo_x * warm["t_token_s"])
        pd.slo = slo
        print(f"  warm-up: long-prompt TTFT {warm['t_ttft_long_s'] * 1e3:.0f} ms, token interval "
              f"{warm['t_token_s'] * 1e3:.1f} ms -> SLO TTFT {slo.ttft_slo_s * 1e3:.0f} ms, TPOT "
              f"{slo.tpot_slo_s * 1e3:.1f} ms", flush=True)
        time.sleep(cfg.real_min_dwell_s)
        flips0 = dict(pd.pools.flips)
        bytes0, tokens0 = pd.counters["kv_bytes_moved"], pd.counters["kv_tokens_moved"]
        splits0, handoffs0, whole0 = pd.counters["splits"], pd.counters["handoffs"], pd.counters["whole"]
        stayed0 = pd.counters["stayed"]
        run = _replay(eng, reqs, warm["t_ttft_long_s"], "pd")
        run["moved"] = {m[0] for m in pd.moves}
        flips = {k: pd.pools.flips[k] - flips0[k] for k in flips0}
        m0, m1 = run["phase_start"]
        flip_log = [{"phase": "long_prompt" if e["t"] < m1 else "long_output",
                     "t_in_phase_s": round(e["t"] - (m0 if e["t"] < m1 else m1), 3),
                     **{k: e[k] for k in ("instance", "from", "to", "cause")}} for e in pd.monitor.log if e["t"] >= m0]
        print(f"  PD run: phases {run['phase_s'][0]:.1f} s + {run['phase_s'][1]:.1f} s, flips {flips}, "
              f"pools now {[pd.pools.pool(i) for i in range(3)]}", flush=True)
        for e in flip_log:
            print(f"    flip {e}", flush=True)
        nopd = None
        if cfg.real_nopd:
            eng.pd = None
            eng.reset()
            nopd = _replay(eng, reqs, warm["t_ttft_long_s"], "nopd")
            eng.pd = pd
            print(f"  no-PD run: phases {nopd['phase_s'][0]:.1f} s + {nopd['phase_s'][1]:.1f} s", flush=True)
        spec_info = eng.instances[0].info
        res = {"kv_bytes_moved": pd.counters["kv_bytes_moved"] - bytes0,
               "kv_tokens_moved": pd.counters["kv_tokens_moved"] - tokens0,
               "pd_splits": pd.counters["splits"] - splits0, "pd_handoffs": pd.counters["handoffs"] - handoffs0,
               "pd_whole": pd.counters["whole"] - whole0, "pd_stayed": pd.counters["stayed"] - stayed0,
               "instances_pids": [i.info.pid for i in eng.instances], "device": spec_info.device}
        by_phase = {f"{ph}_{d}": sum(1 for e in flip_log if e["phase"] == ph and (e["to"] in ("D", "P->D"))
                                     == (d == "p_to_d")) for ph in ("long_prompt", "long_output")
                    for d in ("p_to_d", "d_to_p")}
        res.update({"flips_p_to_d": flips["p_to_d"], "flips_d_to_p": flips["d_to_p"], "flip_log": flip_log,
                    "flips_by_phase": by_phase,
                    "cost_model": {"prefill_tokens_per_s": pd.cost.prefill_tokens_per_s,
                                   "kv_bytes_per_token": pd.cost.kv_bytes_per_token,
                                   "transfer_bytes_per_s": pd.cost.transfer_bytes_per_s,
                                   "transfer_overhead_s": pd.cost.transfer_overhead_s},
                    "pd_split_min_tokens": pd.threshold, "slo_ttft_s": slo.ttft_slo_s, "slo_tpot_s": slo.tpot_slo_s,
                    "warm_up": warm, "pd_phase_s": run["phase_s"],
                    "ttft_predictor": {"coef": list(pd.ttft.coef),
                                       "prefill_s_long": pd.ttft.prefill_s(cfg.real_prompt_tokens)}})
    finally:
        eng.stop()
    res.update(_compare(cfg, serve, reqs, sizes, run, nopd, torch))
    res["real_wall_s"] = time.perf_counter() - t_start
    return res


def _compare(cfg: PartConfig, serve, reqs, sizes, run: dict, nopd: dict | None, torch) -> dict:
    """Outputs vs one engine in this process; lost requests; KV bytes expected from the model's shape."""
    from grserve.engine.async_llm import AsyncLLMEngine
    from grserve.model.loader import resolve_dtype
    from grserve.model.thread_choice import torch_threads

    one = AsyncLLMEngine.build(serve)
    core, spec = one.core, one.model.spec
    ref = []
    with torch_threads(1):
        for group in (reqs[:sizes[0]], reqs[sizes[0]:]):
            ref += core.generate([p for _, p, _ in group], group[0][2])
    dtype_bytes = resolve_dtype(serve.model.dtype).itemsize  # --dtype auto resolved as the instances did
    rows = run["rows"]
    expected = sum(2 * spec.num_hidden_layers * r["n_prompt"] * spec.num_key_value_heads * spec.head_dim
                   * dtype_bytes for r in rows if r["rid"] in run["moved"])
    out = {"pd_identical_outputs": all(r.get("ids") == ref[k] for k, r in enumerate(rows)),
           "pd_lost_requests": sum(1 for r in rows if "error" in r or "ids" not in r),
           "kv_bytes_expected": expected, "requests": len(rows)}
    out.update(_phase_stats(rows, sizes, "pd"))
    if nopd is not None:
        out["nopd_identical_outputs"] = all(r.get("ids") == ref[k] for k, r in enumerate(nopd["rows"]))
        out["nopd_lost_requests"] = sum(1 for r in nopd["rows"] if "error" in r or "ids" not in r)
        out.update(_phase_stats(nopd["rows"], sizes, "nopd"))
        out["nopd_phase_s"] = nopd["phase_s"]
    return out
