"""``grserve bench retrieval``: grserve vs HF transformers constrained beam search vs a copy-KV-per-beam baseline.

The same requests (same prompts, same weights, same catalog) go through each system, in one run on one machine.
Throughput ratios are the result; absolute times on a shared CPU are only indicative. The last output line is one
JSON object (``speedup_vs_hf``, ``kv_bytes_per_request``, ``kv_bytes_formula``, a per-beam-width ``sweep``, ...).
``mask_share`` / ``select_share``: of a beam step's wall time (levels ≥ 1, forward start to selection end), the
host thread's mask building (overlapping the forward) and the selection (masked softmax, top-k, top-BW, reorder).
The RecIF shape: ``--num-items 1500000 --codebook-size 8192 --depth 4`` (a preset's vocabulary is grown to hold the
catalog's SID tokens).

The precision is a dimension (issue 42): ``--dtype float32,bfloat16,auto`` runs the whole benchmark once per dtype, in
that order, one JSON line each; ``--quantization none,int8`` is a second dimension (every dtype with every
quantization, dtype-major). Every line names the dtype used (``auto`` resolved), why (``dtype_reason``), the
quantization and its op (``model/quantized_linear.py``), whether retrieval ran batch-invariant
(``--batch-invariant``, the default) and the machine (CPU model, ISA, fast bf16 or not). A quantization this machine
refuses gives a line with ``"refused"`` (the reason) instead of numbers, and the run goes on.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from grserve.config import DTYPES, QUANTIZATIONS
from grserve.flags import (
    Checked,
    UsageError,
    comma_list,
    config_command,
    device_name,
    flag,
    non_negative,
    positive_int,
    split_commas,
)
from grserve_bench.machine import machine_info

if TYPE_CHECKING:
    from grserve.engine.retrieval_engine import RetrievalEngine


@dataclass(frozen=True)
class RetrievalBenchConfig(Checked):
    """The knobs of ``grserve bench retrieval``."""

    model: str = flag("tiny", "preset or HF-format directory", metavar="PRESET_OR_DIR")
    device: str = flag("cpu", "where the model runs", check=device_name, metavar="cpu|cuda|cuda:N")
    dtype: str = flag("auto", "model dtype, or a comma-separated list of them (the benchmark runs once per dtype, one "
                              "JSON line each); auto: what grserve serve would pick here (model/dtype_choice.py)",
                      check=comma_list(str, allowed=DTYPES), metavar="DTYPE[,DTYPE...]")
    quantization: str = flag("none", "the projections' quantization, or a comma-separated list (each dtype runs "
                                     "with each; model/quantized_linear.py): none, int8, int8-weight-only, fp8",
                             check=comma_list(str, allowed=QUANTIZATIONS), metavar="Q[,Q...]")
    batch_invariant: bool = flag(True, "grserve runs one GEMM per request (a request's answer does not depend on its "
                                       "batch; AccelConfig.batch_invariant)")
    prompt_len: int = flag(512, "prompt tokens per request", check=positive_int)
    beam_widths: str = flag("16,64,128", "comma-separated beam widths", check=comma_list(int, each=positive_int))
    headline_bw: int | None = flag(None, "beam width reported in the JSON headline (default: the largest)",
                                   check=positive_int)
    num_items: int = flag(20_000, "generated catalog size", check=positive_int)
    codebook_size: int = flag(256, "codes per SID level", check=positive_int)
    depth: int = flag(3, "SID tokens per item", check=positive_int)
    sid_layout: str = flag("arithmetic", "SID tokens: arithmetic; onerec (tokenizer-native: per-level contiguous ids at "
                                         "the top of the vocabulary, prompts wrapped in sid_begin/sid_end like a "
                                         "OneRec chat prompt); gathered (the same ids shuffled: the LM-head gather)",
                           choices=("arithmetic", "onerec", "gathered"))
    requests: int = flag(16, "requests through grserve per beam width", check=positive_int)
    batch: int = flag(8, "requests per grserve batch (token capacity = batch × prompt)", check=positive_int)
    hf_requests: int = flag(2, "requests through HF per beam width (~6 s each at BW 128 on 2 cores)",
                            check=positive_int)
    naive_requests: int = flag(2, "requests through the copy-per-beam baseline", check=positive_int)
    top_n: int = flag(10, "items returned per request", check=positive_int)
    scoring: str = flag("renormalized", "grserve scoring convention", choices=("renormalized", "hf"))
    skip_hf: bool = flag(False, "do not run HF transformers (e.g. for GPU-scale shapes)")
    skip_naive: bool = flag(False, "do not run the copy-per-beam baseline")
    seed: int = flag(0, "seed of the weights, the catalog and the prompts", check=non_negative)
    # ---- the device fast path (issue 15; grserve_bench/retrieval_device.py) ----
    suite: str = flag("auto", "auto: the P2 case + grid on a CUDA device, the beam-width sweep on CPU; sweep; p2",
                      choices=("auto", "sweep", "p2"))
    p2_model: str = flag("qwen3-1.7b", "--suite p2: model preset or directory", metavar="PRESET_OR_DIR")
    p2_dtype: str = flag("bfloat16", "--suite p2: model dtype", choices=DTYPES)
    p2_prompt_len: int = flag(5000, "--suite p2: prompt tokens of the P2 case", check=positive_int)
    p2_batch: int = flag(8, "--suite p2: requests in the P2 batch", check=positive_int)
    p2_beam_width: int = flag(256, "--suite p2: beam width of the P2 case", check=positive_int)
    grid_ctx: str = flag("1000,5000", "--suite p2: grid prompt lengths", check=comma_list(int, each=positive_int))
    grid_batch: str = flag("1,2,4,8", "--suite p2: grid batch sizes", check=comma_list(int, each=positive_int))
    grid_bw: str = flag("128,256", "--suite p2: grid beam widths", check=comma_list(int, each=positive_int))
    warmup: int = flag(2, "--suite p2: untimed batches per cell after the capture batch", check=non_negative)
    iters: int = flag(5, "--suite p2: timed batches per cell (the median is reported)", check=positive_int)
    attention_backend: str = flag("torch", "--suite p2: kernels of the decode step", choices=("torch", "triton"))
    cuda_graphs: bool = flag(True, "--suite p2: capture the beam steps as CUDA graphs (CUDA only)")
    prompt_bucket: int = flag(256, "--suite p2: shared-KV length padded up to a multiple of this",
                              check=positive_int)
    prefill_attention: str = flag("auto", "--suite p2: the prefill's attention over packed prompts (auto: one "
                                          "FlashAttention varlen call on CUDA in bf16/fp16, else one SDPA call per "
                                          "prompt)", choices=("auto", "loop", "flash"))
    prefill_last_rows: bool = flag(True, "--suite p2: the prefill's last layer on each prompt's last row only")
    prefill_compile: bool = flag(False, "--suite p2: torch.compile the prefill's layers per token bucket "
                                        "(model/prefill_compile.py; the compile lands in the first batch of a cell)")
    eager_check: bool = flag(True, "--suite p2: per cell, one batch through the eager prefill (one SDPA call per "
                                   "prompt, the full last layer, no graphs) and the top-k agreement with it")
    hf_ctx: str | None = flag(None, "--suite p2: run HF at these grid contexts only (default: every context)",
                              check=comma_list(int, each=positive_int), metavar="CTX,...")


def precision_fields(asked: str, chosen=None, quantized=None, quantization: str = "none") -> dict:
    """What every JSON line says of its arithmetic: dtype used, why, what was asked, quantization (and its op)."""
    if chosen is None:
        from grserve.model.dtype_choice import choice

        chosen = choice(asked)
    return {"dtype": chosen.name, "dtype_reason": chosen.reason, "dtype_asked": asked,
            "quantization": quantized.choice.scheme if quantized is not None else quantization,
            "quantization_op": quantized.choice.op if quantized is not None else "",
            "quantization_reason": quantized.choice.reason if quantized is not None else ""}


def add_command(sub) -> None:
    config_command(sub, "retrieval", help="GR retrieval throughput / latency / KV memory vs HF transformers",
                   cls=RetrievalBenchConfig, run=run, description=__doc__)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_grserve(engine: RetrievalEngine, prompts, bw: int, top_n: int) -> dict:
    from grserve.engine.types import RetrievalRequest

    reqs = [RetrievalRequest(prompt_tokens=p, beam_width=bw, top_n=top_n) for p in prompts]
    t0 = time.perf_counter()
    done_at: dict[str, float] = {}
    futs = []
    for r in reqs:
        r.arrival = time.perf_counter()
        f = engine.submit(r).future
        f.add_done_callback(lambda _f, rid=r.request_id: done_at.__setitem__(rid, time.perf_counter()))
        futs.append(f)
    wait(futs)
    wall = time.perf_counter() - t0
    results = [f.result() for f in futs]
    lat = [(done_at[r.request_id] - r.arrival) * 1e3 for r in reqs]
    return {
        "req_per_s": len(reqs) / wall,
        "p50_ms": pct(lat, 50),
        "p99_ms": pct(lat, 99),
        "kv_bytes_per_request": int(statistics.mean(r.kv_bytes for r in results)),
        "candidates_visited": int(statistics.mean(r.candidates_visited for r in results)),
        "batch_size": statistics.mean(r.batch_size for r in results),
        "items": [[it.item_id for it in r.items] for r in results],
    }


def warm_every_width(bws: list[int], systems: dict[str, Callable[[int], object]]) -> dict[str, dict[int, float]]:
    """Run every system once at every beam width before anything is timed: the first call of a width pays for
    set-up the later ones do not (torch kernels and allocations, HF ``generate``'s), which would otherwise land on
    whichever width is measured first. Seconds per system and width, reported apart."""
    out: dict[str, dict[int, float]] = {name: {} for name in systems}
    for bw in bws:
        for name, fn in systems.items():
            t = time.perf_counter()
            fn(bw)
            out[name][bw] = round(time.perf_counter() - t, 3)
    return out


def step_shares(events: list[tuple[str, float, float]]) -> dict:
    """Of the beam steps (levels ≥ 1) of one traced batch: the mean step wall time (forward start to selection end)
    and the shares of the host mask build (which overlaps the forward) and of the selection."""
    spans = {name: (start, end) for name, start, end in events}
    levels = [int(name[len("select"):]) for name in spans if name.startswith("select")]
    step = sum(spans[f"select{lv}"][1] - spans[f"forward{lv}"][0] for lv in levels)
    mask = sum(spans[f"mask{lv}"][1] - spans[f"mask{lv}"][0] for lv in levels if f"mask{lv}" in spans)
    select = sum(spans[f"select{lv}"][1] - spans[f"select{lv}"][0] for lv in levels)
    if not levels or step <= 0:
        return {"step_ms": 0.0, "mask_share": 0.0, "select_share": 0.0}
    return {"step_ms": step * 1e3 / len(levels), "mask_share": mask / step, "select_share": select / step}


def run_sequential(fn, prompts) -> dict:
    lat, outs = [], []
    t0 = time.perf_counter()
    for p in prompts:
        t = time.perf_counter()
        outs.append(fn(p))
        lat.append((time.perf_counter() - t) * 1e3)
    wall = time.perf_counter() - t0
    return {"req_per_s": len(prompts) / wall, "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "outs": outs}


def _systems(cfg: RetrievalBenchConfig, engine, runner, naive, hf, prompts, catalog) -> dict[str, Callable[[int], object]]:
    """What the sweep times, one call each, as functions of the beam width (for ``warm_every_width``)."""
    batch = prompts[: cfg.batch]
    systems: dict[str, Callable[[int], object]] = {
        "grserve": lambda bw: run_grserve(engine, batch, bw, min(cfg.top_n, bw)),
        "grserve_batch": lambda bw: runner.run(batch, bw, [min(cfg.top_n, bw)] * len(batch), catalog)}
    if naive is not None:
        systems["naive"] = lambda bw: naive.run(prompts[0], bw, min(cfg.top_n, bw), catalog)
    if hf is not None:
        systems["hf"] = lambda bw: hf.run(prompts[0], bw, min(cfg.top_n, bw), catalog)
    return systems


def _sweep_row(cfg: RetrievalBenchConfig, bw: int, engine, runner, hf_runner, naive, hf, prompts, catalog,
               b_tok: int, bar) -> dict:
    """One beam width: grserve (engine, then one traced batch), the copy-per-beam baseline, HF and the
    exactness check against HF."""
    top_n = min(cfg.top_n, bw)
    row: dict = {"beam_width": bw}
    g = run_grserve(engine, prompts[: cfg.requests], bw, top_n)
    bar.update()
    t = time.perf_counter()
    traced = runner.run(prompts[: cfg.batch], bw, [top_n] * cfg.batch, catalog, trace=True)
    row["ms_per_batch"] = (time.perf_counter() - t) * 1e3
    row.update(step_shares(traced.trace))
    row["grserve"] = {k: v for k, v in g.items() if k != "items"}
    row["kv_bytes_formula"] = (cfg.prompt_len + bw * cfg.depth) * b_tok
    if naive is not None:
        n = run_sequential(lambda p: naive.run(p, bw, top_n, catalog), prompts[: cfg.naive_requests])
        row["naive"] = {k: n[k] for k in ("req_per_s", "p50_ms", "p99_ms")}
        row["naive"]["kv_bytes_per_request"] = int(max(o[1] for o in n["outs"]))
        row["speedup_vs_naive"] = g["req_per_s"] / n["req_per_s"]
        bar.update()
    if hf is not None:
        h = run_sequential(lambda p: hf.run(p, bw, top_n, catalog), prompts[: cfg.hf_requests])
        row["hf"] = {k: h[k] for k in ("req_per_s", "p50_ms", "p99_ms")}
        row["hf"]["kv_bytes_per_request"] = bw * (cfg.prompt_len + cfg.depth) * b_tok  # one cache row per beam
        row["speedup_vs_hf"] = g["req_per_s"] / h["req_per_s"]
        # exactness: grserve under HF's scoring convention returns HF's items
        same = hf_runner.run(prompts[: cfg.hf_requests], bw, [top_n] * cfg.hf_requests, catalog)
        agree = [[x.item_id for x in a] == [x.item_id for x in b] for a, b in zip(same.hits, h["outs"])]
        row["hf_agreement"] = sum(agree) / len(agree)
        bar.update()
    return row


def _print_results(console, cfg: RetrievalBenchConfig, sweep: list[dict], b_tok: int, warm_s: dict) -> None:
    """The table of requests/s, latency and KV bytes per system and beam width, then one line per width."""
    from rich.table import Table

    table = Table(title="GR retrieval: requests/s (higher is better), latency, KV bytes per request")
    for col in ("BW", "system", "req/s", "P50 ms", "P99 ms", "KV bytes/req", "speedup"):
        table.add_column(col, justify="right")
    for row in sweep:
        bw = row["beam_width"]
        g = row["grserve"]
        table.add_row(str(bw), "grserve", f"{g['req_per_s']:.2f}", f"{g['p50_ms']:.0f}", f"{g['p99_ms']:.0f}", f"{g['kv_bytes_per_request']:,}", "1.0×")
        for name, key in (("naive copy-KV", "naive"), ("HF transformers", "hf")):
            if key in row:
                o = row[key]
                sp = row[f"speedup_vs_{key}"]
                table.add_row("", name, f"{o['req_per_s']:.2f}", f"{o['p50_ms']:.0f}", f"{o['p99_ms']:.0f}", f"{o['kv_bytes_per_request']:,}", f"grserve {sp:.1f}×")
    console.print(table)
    for row in sweep:
        extra = f", HF agreement (scoring=hf) {row['hf_agreement']:.0%}" if "hf_agreement" in row else ""
        console.print(
            f"BW {row['beam_width']}: {row['ms_per_batch']:.1f} ms per batch of {cfg.batch}; KV/request "
            f"{row['grserve']['kv_bytes_per_request']:,} B = (L + BW·ND)·{b_tok} = {row['kv_bytes_formula']:,} B; "
            f"top-BW candidates visited {row['grserve']['candidates_visited']:,}{extra}; beam step "
            f"{row['step_ms']:.1f} ms: mask {row['mask_share']:.0%} (overlapping the forward), select "
            f"{row['select_share']:.0%}"
        )
    console.print("warm-up before any timing, s per system and beam width (untimed): " + "; ".join(
        f"{name} " + ", ".join(f"BW {bw} {sec:.2f}" for bw, sec in per.items()) for name, per in warm_s.items()))


def _summary(cfg: RetrievalBenchConfig, sweep: list[dict], headline: int, catalog, b_tok: int, t_cat: float,
             warm_s: dict, chosen=None, quantized=None) -> dict:
    """The final JSON line: the headline beam width's numbers, then the per-width sweep."""
    head = next(r for r in sweep if r["beam_width"] == headline)
    return {
        "benchmark": "retrieval",
        "model": cfg.model,
        "device": cfg.device,
        **precision_fields(cfg.dtype, chosen, quantized, cfg.quantization),
        "batch_invariant": cfg.batch_invariant,
        "machine": machine_info(),
        "prompt_len": cfg.prompt_len,
        "beam_width": headline,
        "sid_tokens": cfg.depth,
        "catalog_items": len(catalog),
        "speedup_vs_hf": head.get("speedup_vs_hf"),
        "speedup_vs_naive": head.get("speedup_vs_naive"),
        "req_per_s": head["grserve"]["req_per_s"],
        "p50_ms": head["grserve"]["p50_ms"],
        "p99_ms": head["grserve"]["p99_ms"],
        "ms_per_batch": head["ms_per_batch"],
        "kv_bytes_per_request": head["grserve"]["kv_bytes_per_request"],
        "kv_bytes_formula": head["kv_bytes_formula"],
        "bytes_per_token": b_tok,
        "hf_agreement": head.get("hf_agreement"),
        "codebook_size": cfg.codebook_size,
        "catalog_seconds": t_cat,
        "step_ms": head["step_ms"],
        "mask_share": head["mask_share"],
        "select_share": head["select_share"],
        "warmup_s": warm_s,
        "sweep": [
            {k: row.get(k) for k in ("beam_width", "speedup_vs_hf", "speedup_vs_naive", "ms_per_batch", "kv_bytes_formula", "hf_agreement", "step_ms", "mask_share", "select_share")}
            | {"req_per_s": row["grserve"]["req_per_s"], "kv_bytes_per_request": row["grserve"]["kv_bytes_per_request"]}
            for row in sweep
        ],
    }


def _baselines(cfg: RetrievalBenchConfig, model):
    """The HF constrained beam search and the copy-KV-per-beam baseline, each None when skipped."""
    hf = naive = None
    if not cfg.skip_hf:
        from grserve_bench.baselines import HFConstrainedBeamSearch

        hf = HFConstrainedBeamSearch(model)
    if not cfg.skip_naive:
        from grserve_bench.baselines import NaiveCopyBeamSearch

        naive = NaiveCopyBeamSearch(model)
    return hf, naive


def run(cfg: RetrievalBenchConfig) -> int:
    """Once per dtype of ``--dtype`` and quantization of ``--quantization`` (the module docstring)."""
    if cfg.suite == "p2" or (cfg.suite == "auto" and cfg.device.startswith("cuda")):
        return run_one(cfg)  # the device suite: its own --p2-dtype
    from grserve.model.quantized_linear import QuantizationRefused

    for dtype in split_commas(cfg.dtype, str):
        for quantization in split_commas(cfg.quantization, str):
            one = replace(cfg, dtype=dtype, quantization=quantization)
            try:
                rc = run_one(one)
            except QuantizationRefused as exc:  # a line that says why, and the other cells still run
                print(json.dumps({"benchmark": "retrieval", "model": cfg.model, "device": cfg.device,
                                  **precision_fields(dtype, quantization=quantization), "refused": exc.reason,
                                  "batch_invariant": cfg.batch_invariant, "machine": machine_info()}))
                continue
            if rc:
                return rc
    return 0


def run_one(cfg: RetrievalBenchConfig) -> int:
    import torch
    from rich.console import Console
    from tqdm import tqdm

    from grserve_bench.workload import bench_layout, history_prompts
    from grserve.catalog import CatalogStore, generate_catalog
    from grserve.config import AccelConfig, SchedulerConfig, SearchConfig
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.engine.retrieval import RetrievalRunner
    from grserve.model import load_model

    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {cfg.device}: no CUDA device is available here (the GPU suite needs one, "
                         "docs/gpu.md; --device cpu runs the CPU sweep)")
    if cfg.suite == "p2" or (cfg.suite == "auto" and cfg.device.startswith("cuda")):
        from grserve_bench.retrieval_device import run_suite

        return run_suite(cfg)
    console = Console(stderr=False)
    torch.manual_seed(cfg.seed)
    bws = split_commas(cfg.beam_widths, int)
    headline = cfg.headline_bw or max(bws)
    if headline not in bws:
        bws.append(headline)
    t_cat = time.perf_counter()
    catalog = generate_catalog(cfg.num_items, cfg.depth, cfg.codebook_size, cfg.seed)
    t_cat = time.perf_counter() - t_cat
    model = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed,
                       min_vocab=catalog.layout.num_tokens, quantization=cfg.quantization)
    chosen, quantized = model.dtype_choice, model.quantized
    spec = model.spec
    catalog = bench_layout(catalog, cfg.sid_layout, spec.vocab_size, cfg.seed)
    catalog.layout.check_vocab(spec.vocab_size)
    b_tok = spec.kv_bytes_per_token(torch.empty((), dtype=model.dtype).element_size())
    prompts = history_prompts(catalog, max(cfg.requests, cfg.hf_requests, cfg.naive_requests), cfg.prompt_len, cfg.seed)
    console.print(
        f"[bold]grserve bench retrieval[/]: model={cfg.model} ({spec.num_parameters() / 1e6:.1f}M params, "
        f"{chosen.label(cfg.device)}, quantization {quantized.choice.label() if quantized else 'none'}, "
        f"batch-invariant {cfg.batch_invariant}), catalog={len(catalog)} items × {cfg.depth} SID tokens ({cfg.codebook_size} codes per level, "
        f"generated in {t_cat:.1f} s), prompt={cfg.prompt_len}, "
        f"beam widths={bws}, torch threads={torch.get_num_threads()}"
    )
    sched = SchedulerConfig(token_capacity=cfg.batch * cfg.prompt_len, max_batch_requests=cfg.batch, max_inflight_batches=1)
    accel = AccelConfig(batch_invariant=cfg.batch_invariant)
    engine = RetrievalEngine(model, CatalogStore(catalog), SearchConfig(scoring=cfg.scoring), sched,
                             accel=accel).start()
    hf, naive = _baselines(cfg, model)
    runner = RetrievalRunner(model, SearchConfig(scoring=cfg.scoring), accel)  # one batch, timed alone
    hf_runner = RetrievalRunner(model, SearchConfig(scoring="hf"), accel)  # exactness check against HF

    sweep = []
    steps = len(bws) * (1 + (hf is not None) + (naive is not None))
    bar = tqdm(total=steps, desc="bench", file=sys.stderr, leave=False)
    try:
        warm_s = warm_every_width(bws, _systems(cfg, engine, runner, naive, hf, prompts, catalog))
        for bw in bws:
            sweep.append(_sweep_row(cfg, bw, engine, runner, hf_runner, naive, hf, prompts, catalog, b_tok, bar))
    finally:
        bar.close()
        engine.stop()
        runner.close()
        hf_runner.close()

    _print_results(console, cfg, sweep, b_tok, warm_s)
    print(json.dumps(_summary(cfg, sweep, headline, catalog, b_tok, t_cat, warm_s, chosen, quantized)))
    return 0
