"""``grserve bench retrieval --device cuda`` (``--suite p2``): the device fast path on the P2 case and a grid.

P2 (issue 15): ``qwen3-1.7b`` shape with seeded random weights (bf16), 8 requests × 5000-token prompts in one
batch, BW 256, 3 SID tokens. Grid: context × batch × beam width (default 1000/5000 × 1/2/4/8 × 128/256).

Per cell: the first batch is the bucket's warm-up + CUDA-graph capture (reported apart, ``capture_ms``), then
``--warmup`` untimed and ``--iters`` timed batches (each ends in the host copy of its results, so it is synchronous);
the median ms per batch and req/s = batch / median. HF transformers ``generate(num_beams=BW,
prefix_allowed_tokens_fn=…)`` runs the same requests one at a time on the same device (per context × BW; a cell
where HF runs out of memory is reported as such); top-1 agreement is grserve with HF's scoring convention vs HF;
the invalid-item rate counts returned SIDs that are not catalog items. Runs on CPU too with small shapes (the
flags), e.g. ``--suite p2 --p2-model tiny --p2-prompt-len 64 --p2-batch 2 --p2-beam-width 16``.
The last line is one JSON object: ``device``, ``ms_per_batch_p2``, ``speedup_vs_hf_gpu`` (HF on the same device).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from grserve.flags import split_commas


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def _time_cell(runner, catalog, prompts, bw: int, warmup: int, iters: int, top_n: int) -> dict:
    batch = len(prompts)
    t = time.perf_counter()
    runner.run(prompts, bw, [top_n] * batch, catalog)  # bucket warm-up (+ capture on CUDA)
    first_ms = (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        runner.run(prompts, bw, [top_n] * batch, catalog)
    times, out = [], None
    for _ in range(iters):
        t = time.perf_counter()
        out = runner.run(prompts, bw, [top_n] * batch, catalog)
        times.append((time.perf_counter() - t) * 1e3)
    med = statistics.median(times)
    traced = runner.run(prompts, bw, [top_n] * batch, catalog, trace=True).trace  # synchronised events
    phase = {name: (end - start) * 1e3 for name, start, end in traced}
    return {"ms_per_batch": med, "req_per_s": batch / (med / 1e3), "first_batch_ms": first_ms,
            "prefill_ms": phase.get("prefill"), "decode_ms": sum(v for k, v in phase.items() if k != "prefill"),
            "min_ms": min(times), "invalid_items": _invalid(catalog, [[h.sid for h in hs] for hs in out.hits])}


def _invalid(catalog, sid_lists) -> float | None:
    sids = [s for lst in sid_lists for s in lst]
    if not sids:
        return None
    return float(1.0 - catalog.contains_sids(np.asarray(sids, dtype=np.int64)).mean())


def _hf_cell(hf, hf_runner, catalog, prompts, bw: int, top_n: int) -> dict:
    """HF generate one request at a time; grserve (hf scoring) on the same requests for the top-1 agreement."""
    import torch

    try:
        t = time.perf_counter()
        outs = [hf.sequences(p, bw, top_n, catalog) for p in prompts]
        sec = (time.perf_counter() - t) / len(prompts)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"hf_oom": True}
    ours = hf_runner.run(prompts, bw, [top_n] * len(prompts), catalog).hits
    agree = [bool(o) and bool(h) and o[0].sid == h[0][0] for o, h in zip(ours, outs)]
    return {"hf_req_per_s": 1.0 / sec, "hf_ms_per_request": sec * 1e3, "hf_top1_agreement": float(np.mean(agree)),
            "hf_invalid_items": _invalid(catalog, [[s for s, _ in o] for o in outs])}


# NVIDIA recsys-examples' published SID-GR cells (H100, docs/gpu.md): ms per batch at (ctx, batch, BW)
NVIDIA_SID_GR_MS = {(1000, 1, 256): 17.6, (1000, 8, 256): 93.2, (5000, 1, 256): 42.3, (5000, 8, 256): 307.9}


def _agreement(runner, eager, catalog, prompts, bw: int, top_n: int) -> dict:
    """One batch through both runners: the mean top-n overlap, top-1 agreement and the largest score difference
    on common items (bf16: near-ties may reorder; fp32: the tests pin equality)."""
    fast = runner.run(prompts, bw, [top_n] * len(prompts), catalog).hits
    ref = eager.run(prompts, bw, [top_n] * len(prompts), catalog).hits
    overlap, top1, dmax = [], [], 0.0
    for a, b in zip(fast, ref):
        sa, sb = {h.sid: h.score for h in a}, {h.sid: h.score for h in b}
        overlap.append(len(sa.keys() & sb.keys()) / max(1, len(sb)))
        top1.append(bool(a) and bool(b) and a[0].sid == b[0].sid)
        dmax = max([dmax] + [abs(sa[k] - sb[k]) for k in sa.keys() & sb.keys()])
    return {"eager_topk_overlap": float(np.mean(overlap)), "eager_top1_agreement": float(np.mean(top1)),
            "eager_max_abs_dscore": dmax}


def run_suite(cfg) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from grserve_bench.workload import bench_layout, history_prompts
    from grserve.catalog import generate_catalog
    from grserve.config import AccelConfig, SearchConfig
    from grserve.engine.device_runner import DeviceRetrievalRunner
    from grserve.model import load_model

    console = Console()
    torch.manual_seed(cfg.seed)
    catalog = generate_catalog(cfg.num_items, cfg.depth, cfg.codebook_size, cfg.seed)
    model = load_model(cfg.p2_model, dtype=cfg.p2_dtype, device=cfg.device, seed=cfg.seed,
                       min_vocab=catalog.layout.num_tokens)
    catalog = bench_layout(catalog, cfg.sid_layout, model.spec.vocab_size, cfg.seed)
    catalog.layout.check_vocab(model.spec.vocab_size)
    accel = AccelConfig(fast_path="on", attention_backend=cfg.attention_backend, cuda_graphs=cfg.cuda_graphs,
                        prompt_bucket=cfg.prompt_bucket, prefill_attention=cfg.prefill_attention,
                        prefill_last_rows=cfg.prefill_last_rows, prefill_compile=cfg.prefill_compile)
    runner = DeviceRetrievalRunner(model, SearchConfig(), accel)
    # the eager path the agreement is measured against: one SDPA call per prompt, the full last layer, no graphs
    eager_accel = AccelConfig(fast_path="on", attention_backend=cfg.attention_backend, cuda_graphs=False,
                              prompt_bucket=cfg.prompt_bucket, prefill_attention="loop", prefill_last_rows=False)
    eager = DeviceRetrievalRunner(model, SearchConfig(), eager_accel) if cfg.eager_check else None
    hf_runner = DeviceRetrievalRunner(model, SearchConfig(scoring="hf"), accel)
    p2 = (cfg.p2_prompt_len, cfg.p2_batch, cfg.p2_beam_width)
    grid = [(c, b, w) for c in split_commas(cfg.grid_ctx, int) for b in split_commas(cfg.grid_batch, int)
            for w in split_commas(cfg.grid_bw, int)]
    cells = [p2] + [g for g in grid if g != p2]
    console.print(f"[bold]grserve bench retrieval --suite p2[/]: {cfg.p2_model} ({cfg.p2_dtype}) on "
                  f"{_device_name(cfg.device)}, backend {cfg.attention_backend}, graphs {runner.use_graphs}, "
                  f"catalog {len(catalog)} × {cfg.depth} SID tokens ({cfg.sid_layout}), cells {len(cells)}")
    rows = []
    for ctx, batch, bw in cells:
        prompts = history_prompts(catalog, batch, ctx, cfg.seed + ctx)
        captures, capture_s = runner.captures, runner.capture_s
        row = {"ctx": ctx, "batch": batch, "beam_width": bw} | _time_cell(runner, catalog, prompts, bw,
                                                                            cfg.warmup, cfg.iters, min(cfg.top_n, bw))
        row["capture_ms"] = (runner.capture_s - capture_s) * 1e3
        row["graphs_captured"] = runner.captures - captures
        if (ctx, batch, bw) in NVIDIA_SID_GR_MS:
            row["nvidia_ms"] = NVIDIA_SID_GR_MS[(ctx, batch, bw)]
            row["nvidia_ms_over_ours"] = row["nvidia_ms"] / row["ms_per_batch"]  # > 1: faster than the cell
        if eager is not None:
            row |= _agreement(runner, eager, catalog, prompts, bw, min(cfg.top_n, bw))
            eager.close()  # its bucket's KV: not kept across cells
        rows.append(row)
        vs = f", NVIDIA {row['nvidia_ms']} ms" if "nvidia_ms" in row else ""
        agree = (f", top-{min(cfg.top_n, bw)} overlap with the eager prefill {row['eager_topk_overlap']:.0%} "
                 f"(top-1 {row['eager_top1_agreement']:.0%})") if eager is not None else ""
        console.print(f"ctx {ctx} × batch {batch}, BW {bw}: {row['ms_per_batch']:.1f} ms/batch{vs}, "
                      f"{row['req_per_s']:.1f} req/s (prefill {row['prefill_ms']:.0f} + decode "
                      f"{row['decode_ms']:.0f} ms traced; first batch {row['first_batch_ms']:.0f} ms, capture "
                      f"{row['capture_ms']:.0f} ms){agree}")
    summary_runner = {"use_graphs": runner.use_graphs,
                      "compile_failed": runner.compiled.failed if runner.compiled is not None else None}
    runner.close()
    if eager is not None:
        eager.close()  # free the grid's buckets (KV, graphs) before HF, which needs BW copies of the prompt KV
    if cfg.device.startswith("cuda"):
        torch.cuda.empty_cache()
    hf_by = _hf_runs(cfg, model, catalog, hf_runner, {(c, w) for c, _, w in cells}, console)
    for row in rows:
        h = hf_by.get((row["ctx"], row["beam_width"]), {})
        row.update(h)
        if "hf_req_per_s" in h:
            row["speedup_vs_hf"] = row["req_per_s"] / h["hf_req_per_s"]
    _print_table(console, Table, rows)
    print(json.dumps(_summary(cfg, rows, summary_runner["use_graphs"], model, summary_runner["compile_failed"])))
    return 0


def _hf_runs(cfg, model, catalog, hf_runner, pairs, console) -> dict:
    """HF per (context, BW): it decodes one request at a time, so the batch size does not change its req/s."""
    if cfg.skip_hf:
        return {}
    from grserve_bench.baselines import HFConstrainedBeamSearch
    from grserve_bench.workload import history_prompts

    hf = HFConstrainedBeamSearch(model)
    out = {}
    only = set(split_commas(cfg.hf_ctx, int)) if cfg.hf_ctx else None
    for ctx, bw in sorted(pairs):
        if only is not None and ctx not in only:
            continue
        prompts = history_prompts(catalog, cfg.hf_requests, ctx, cfg.seed + 7 * ctx)
        out[(ctx, bw)] = _hf_cell(hf, hf_runner, catalog, prompts, bw, min(cfg.top_n, bw))
        console.print(f"HF ctx {ctx}, BW {bw}: {out[(ctx, bw)]}")
    return out


def _print_table(console, Table, rows) -> None:
    table = Table(title="GR retrieval on the device fast path (median after warm-up; capture apart)")
    for col in ("ctx", "batch", "BW", "ms/batch", "req/s", "capture ms", "HF req/s", "speedup", "top-1 = HF"):
        table.add_column(col, justify="right")
    fmt = lambda v, f: "—" if v is None else format(v, f)
    for r in rows:
        hf = "OOM" if r.get("hf_oom") else fmt(r.get("hf_req_per_s"), ".2f")
        table.add_row(str(r["ctx"]), str(r["batch"]), str(r["beam_width"]), f"{r['ms_per_batch']:.1f}",
                      f"{r['req_per_s']:.1f}", f"{r['capture_ms']:.0f}", hf, fmt(r.get("speedup_vs_hf"), ".1f"),
                      fmt(r.get("hf_top1_agreement"), ".0%"))
    console.print(table)


def _summary(cfg, rows, use_graphs: bool, model, compile_failed: str | None = None) -> dict:
    from grserve.attention import varlen

    p2 = rows[0]
    with_hf = [r for r in rows if "speedup_vs_hf" in r]
    # HF at P2 (BW 256 × 5000 tokens: ~147 GB of HF KV for qwen3-1.7b) does not fit one GPU; then the speedup is
    # reported at the largest cell where HF ran, and that cell is named
    ref = p2 if "speedup_vs_hf" in p2 else max(with_hf, key=lambda r: (r["ctx"] * r["beam_width"], r["batch"]),
                                               default=None)
    return {
        "benchmark": "retrieval", "suite": "p2", "device": _device_name(cfg.device), "model": cfg.p2_model,
        "dtype": cfg.p2_dtype, "quantization": "none", "attention_backend": cfg.attention_backend, "cuda_graphs": use_graphs,
        "sid_layout": cfg.sid_layout, "catalog_items": cfg.num_items, "codebook_size": cfg.codebook_size,
        "prefill": {"attention": varlen.resolve(cfg.prefill_attention, model.device, model.dtype),
                    "flash_failed": varlen.flash_failure(), "last_rows": cfg.prefill_last_rows,
                    "compile": cfg.prefill_compile, "compile_failed": compile_failed},
        "ms_per_batch_p2": p2["ms_per_batch"], "req_per_s_p2": p2["req_per_s"],
        "first_batch_ms_p2": p2["first_batch_ms"], "capture_ms_p2": p2["capture_ms"],
        "prefill_ms_p2": p2["prefill_ms"], "decode_ms_p2": p2["decode_ms"],
        "p2": {"ctx": p2["ctx"], "batch": p2["batch"], "beam_width": p2["beam_width"], "hf_oom": p2.get("hf_oom")},
        "speedup_vs_hf_gpu": None if ref is None else ref["speedup_vs_hf"],
        "speedup_vs_hf_gpu_cell": None if ref is None else [ref["ctx"], ref["batch"], ref["beam_width"]],
        "hf_top1_agreement": statistics.mean(r["hf_top1_agreement"] for r in with_hf) if with_hf else None,
        "invalid_item_rate": max((r["invalid_items"] or 0.0) for r in rows),
        "hf_invalid_item_rate": max(((r.get("hf_invalid_items") or 0.0) for r in with_hf), default=None),
        "eager_topk_overlap_min": min((r["eager_topk_overlap"] for r in rows if "eager_topk_overlap" in r),
                                      default=None),
        "grid": [{k: r.get(k) for k in ("ctx", "batch", "beam_width", "ms_per_batch", "req_per_s", "prefill_ms",
                                        "decode_ms", "capture_ms", "nvidia_ms", "nvidia_ms_over_ours",
                                        "eager_topk_overlap", "eager_top1_agreement", "eager_max_abs_dscore",
                                        "hf_req_per_s", "speedup_vs_hf", "hf_top1_agreement", "hf_oom")}
                 for r in rows],
    }
