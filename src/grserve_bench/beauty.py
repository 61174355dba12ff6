"""``grserve bench quality --dataset beauty``: the Beauty GR model against the published table, and HF's speed.

Protocol (the published one, ``grserve/datasets/amazon_beauty/README.md``): leave-one-out, the prompt is the
user's 20 most recent items before the target (training history for the validation item; training history +
validation item for the test item), full-catalog beam search (beam width 100), Hit Rate and NDCG at 5/10/20 over
**all** users. Every user goes through the offline API (``grserve.recommender.Recommender``: the served engine,
batched by token capacity) as a ``{"history_items": [...], "top_n": 20}`` request. On the same users:

- popularity: the 20 most frequent items of the interactions before the evaluated one (for test: training
  histories + validation items; for validation: training histories), one list for everybody;
- the published SASRec and TIGER rows (tiger-cf README, RQ-VAE index), printed next to ours.

Speed and agreement against HF transformers (item 4 of the issue): on ``--hf-users`` test users spread over the
whole set (every k-th), ``generate(num_beams=BW, prefix_allowed_tokens_fn=<catalog trie>)`` of the same model
loaded as ``Qwen3ForCausalLM`` (``bench.baselines.HFConstrainedBeamSearch``, one user at a time) gives users/s; the
same users through grserve with ``--scoring hf`` (HF's scoring: log-softmax over the whole vocabulary, then the
mask) must return the same top-20 items (``hf_top20_agreement`` = the fraction of users whose 20 items are
identical, in order). Both run single-threaded (grserve one batch at a time), back to back, on the same users;
grserve's rate on those users is reported next to its rate over the whole run (``eval_users_per_s``), with the
arithmetic ceiling of the ratio on those users (``hf_sample_position_ratio``: HF's beam search puts every prompt
through the model once per beam, grserve once; with Beauty's short histories, 32 tokens on average, that is ~11x,
and ~22x at full 80-token prompts).

The last line is one JSON object: ``hr@5`` … ``ndcg@20`` (test), ``hr@10_popularity``, ``users``,
``train_seconds``, ``params``, ``eval_users_per_s``, ``hf_users_per_s``, ``hf_top20_agreement``, and the
validation metrics, settings and the speed-up.

``--dtype float32,bfloat16`` (the precision as a dimension, as ``grserve_bench.quality``'s): the evaluation runs once
per dtype, one table and JSON line each (``dtype``, ``dtype_reason``, ``quantization``, ``machine``); each line after
the first compares the last split's lists with the first dtype's as ``grserve check precision`` does
(``top1_vs_reference``, ``overlap@20_vs_reference`` and its minimum, ``max_score_delta_vs_reference``,
``invalid_items``, ``recall_within_stderr``: HR@10 within one standard error of the reference's). The HF comparison
runs once, at the first dtype.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grserve.flags import Checked, flag, non_negative, split_commas
from grserve_bench.machine import machine_info

KS = (5, 10, 20)
PUBLISHED = {  # tiger-cf README (RQ-VAE index), this exact data and protocol
    "SASRec (published)": {"ndcg@5": 0.02087, "ndcg@10": 0.02718, "ndcg@20": 0.03447,
                           "hr@5": 0.03197, "hr@10": 0.05165, "hr@20": 0.08071},
    "TIGER (published, enc-dec ~5M)": {"ndcg@5": 0.02524, "ndcg@10": 0.03191, "ndcg@20": 0.03940,
                                       "hr@5": 0.03756, "hr@10": 0.05822, "hr@20": 0.08800},
}


@dataclass(frozen=True)
class BeautyBenchConfig(Checked):
    """The Beauty evaluation's own knobs (``--dataset beauty``)."""

    hf_users: int = flag(100, "test users (every k-th) run through HF generate for users/s and top-20 agreement "
                              "(0: skip)", check=non_negative)
    scoring: str = flag("renormalized", "scoring of the evaluated search (the HF comparison always uses hf)",
                        choices=("renormalized", "hf"))
    max_batch_requests: int = flag(16, "users per engine batch (the server's --max-batch-requests; 16: on one CPU "
                                       "core batches of 1,600 beams ran faster per user than 64 users' 6,400)",
                                   check=non_negative)


def metrics(ranked: list[list[int]], targets: np.ndarray) -> dict[str, float]:
    """HR@K and NDCG@K (one relevant item per user) for K in 5, 10, 20."""
    ranks = np.full(len(targets), -1)
    for u, (r, t) in enumerate(zip(ranked, targets, strict=True)):
        hit = [i for i, item in enumerate(r[:max(KS)]) if item == int(t)]
        ranks[u] = hit[0] if hit else -1
    out = {}
    for k in KS:
        inside = (ranks >= 0) & (ranks < k)
        out[f"hr@{k}"] = float(inside.mean()) if len(ranks) else 0.0
        gains = np.where(inside, 1.0 / np.log2(np.maximum(ranks, 0) + 2), 0.0)
        out[f"ndcg@{k}"] = float(gains.mean()) if len(ranks) else 0.0
    return out


def prompts_and_targets(split, name: str, max_items: int) -> tuple[list[list[int]], np.ndarray, list]:
    """Per user: the ``max_items`` most recent items before the target, the target, and the items counted for
    popularity (everything before the evaluated items)."""
    if name == "valid":
        hist = [np.asarray(h) for h in split.train]
        targets = split.valid
    else:
        hist = [split.test_history(i) for i in range(len(split.users))]
        targets = split.test
    return [h[-max_items:].tolist() for h in hist], np.asarray(targets), hist


def popularity(histories: list, k: int = max(KS)) -> list[int]:
    """The ``k`` most frequent items (ties: smaller id first)."""
    counts = Counter(int(i) for h in histories for i in h)
    return [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def evaluate_split(rec, split, name: str, max_items: int, progress: bool, max_users: int | None) -> dict:
    prompts, targets, hist = prompts_and_targets(split, name, max_items)
    n = len(prompts) if max_users is None else min(max_users, len(prompts))
    t0 = time.perf_counter()
    out = rec.recommend([{"history_items": p, "top_n": max(KS)} for p in prompts[:n]], progress=progress)
    seconds = time.perf_counter() - t0
    pop = popularity(hist)
    return {"split": name, "users": n, "seconds": seconds, "users_per_s": n / seconds,
            "served": metrics([r.item_ids for r in out], targets[:n]),
            "popularity": metrics([pop] * n, targets[:n]),
            "recs": out, "targets": [int(t) for t in targets[:n]]}  # for the precision comparison


def hf_comparison(model_dir: Path, catalog_path: Path, split, max_items: int, n_users: int, beam_width: int,
                  progress: bool, max_batch_requests: int = 64, dtype: str = "float32") -> dict:
    """HF generate vs grserve (``--scoring hf``) on every k-th test user: users/s of each and top-20 agreement."""
    from tqdm import tqdm

    from grserve_bench.baselines import HFConstrainedBeamSearch
    from grserve.recommender import Recommender

    prompts, _, _ = prompts_and_targets(split, "test", max_items)
    pick = np.linspace(0, len(prompts) - 1, num=min(n_users, len(prompts))).round().astype(int)
    # one batch at a time: grserve on one thread, as HF generate runs (the evaluation above runs the server's two
    # batches in flight)
    with Recommender(model=str(model_dir), catalog=str(catalog_path), beam_width=beam_width, scoring="hf",
                     max_batch_requests=max_batch_requests, max_inflight_batches=1, dtype=dtype) as rec:
        t0 = time.perf_counter()
        ours = rec.recommend([{"history_items": prompts[i], "top_n": max(KS)} for i in pick], progress=False)
        ours_s = time.perf_counter() - t0
        catalog = rec.catalog
        hf = HFConstrainedBeamSearch(rec.engine.model)
        theirs = []
        t0 = time.perf_counter()
        for i in tqdm(pick, desc="HF generate", unit="user", disable=not progress):
            tokens = catalog.layout.sids_to_tokens(catalog.sids_of_items(prompts[i]))
            theirs.append([h.item_id for h in hf.run(tokens, beam_width, max(KS), catalog)])
        hf_s = time.perf_counter() - t0
    same = [a.item_ids == b for a, b in zip(ours, theirs)]
    # the arithmetic ceiling of the speed-up on these users, in token positions through the model: HF's beam
    # search runs each prompt once per beam, then depth steps of BW beams; grserve runs it once, then depth - 1
    lens = np.array([len(prompts[i]) * catalog.depth for i in pick])
    hf_positions = (beam_width * (lens + catalog.depth)).sum()
    ours_positions = (lens + beam_width * (catalog.depth - 1)).sum()
    return {"users": len(pick), "hf_users_per_s": len(pick) / hf_s, "grserve_users_per_s": len(pick) / ours_s,
            "mean_prompt_tokens": float(lens.mean()), "position_ratio": float(hf_positions / ours_positions),
            "top20_agreement": float(np.mean(same)), "disagreeing_users": [int(pick[j]) for j, s in enumerate(same)
                                                                          if not s][:10]}


def print_table(results: list[dict], hf: dict | None, meta: dict, console) -> None:
    from rich.table import Table

    t = Table(title=f"Amazon Beauty, leave-one-out, full catalog ({meta['items']:,} items), beam width "
                    f"{meta['beam_width']}, {meta['scoring']} scoring", title_justify="left")
    t.add_column("model")
    t.add_column("split")
    t.add_column("users", justify="right")
    for k in KS:
        t.add_column(f"H@{k}", justify="right")
    for k in KS:
        t.add_column(f"N@{k}", justify="right")
    rows = []
    for r in results:
        rows.append((f"grserve GR ({meta['params']:,} params)", r["split"], r["users"], r["served"]))
        rows.append(("popularity", r["split"], r["users"], r["popularity"]))
    rows += [(name, "test", 22363, m) for name, m in PUBLISHED.items()]
    for name, split, users, m in rows:
        t.add_row(name, split, f"{users:,}", *[f"{m[f'hr@{k}']:.4f}" for k in KS],
                  *[f"{m[f'ndcg@{k}']:.4f}" for k in KS])
    console.print(t)
    for r in results:
        console.print(f"{r['split']}: {r['users']:,} users in {r['seconds']:.1f} s = {r['users_per_s']:.1f} users/s")
    if hf:
        console.print(f"HF generate (num_beams={meta['beam_width']}, prefix_allowed_tokens_fn) on {hf['users']} test "
                      f"users: {hf['hf_users_per_s']:.2f} users/s; grserve --scoring hf on the same users: "
                      f"{hf['grserve_users_per_s']:.1f} users/s ({hf['grserve_users_per_s'] / hf['hf_users_per_s']:.0f}"
                      f"x); identical top-20: {hf['top20_agreement']:.1%}; mean prompt {hf['mean_prompt_tokens']:.0f} "
                      f"tokens: HF runs {hf['position_ratio']:.1f}x grserve's token positions")


def report_json(results: list[dict], hf: dict | None, meta: dict) -> dict:
    by = {r["split"]: r for r in results}
    test = by.get("test")
    out: dict = {}
    if test:
        out.update({k: round(v, 4) for k, v in test["served"].items()})
        out["hr@10_popularity"] = round(test["popularity"]["hr@10"], 4)
        out["ndcg@10_popularity"] = round(test["popularity"]["ndcg@10"], 4)
        out["users"] = test["users"]
        out["eval_users_per_s"] = round(test["users_per_s"], 1)
    out["train_seconds"] = meta["train_seconds"]
    out["machine"] = machine_info()["cpu"]
    out["params"] = meta["params"]
    out["hf_users_per_s"] = round(hf["hf_users_per_s"], 3) if hf else None
    out["hf_top20_agreement"] = round(hf["top20_agreement"], 4) if hf else None
    if hf:
        out["hf_sample_users"] = hf["users"]
        out["speedup_vs_hf"] = round(hf["grserve_users_per_s"] / hf["hf_users_per_s"], 1)
        out["hf_sample_prompt_tokens"] = round(hf["mean_prompt_tokens"], 1)
        out["hf_sample_position_ratio"] = round(hf["position_ratio"], 1)  # the speed-up if both ran at one rate
    if "valid" in by:
        out.update({f"valid_{k}": round(v, 4) for k, v in by["valid"]["served"].items() if k in ("hr@10", "ndcg@10")})
    out["max_batch_requests"] = meta.get("max_batch_requests")
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)  # other jobs on the machine at the end of the run
    out.update({"beam_width": meta["beam_width"], "scoring": meta["scoring"], "dataset": "amazon-beauty",
                "index": meta["index"]})
    return out


def run(cfg, bench: BeautyBenchConfig, artifacts) -> int:
    """Build or reuse the artifacts (or take ``cfg.model``), evaluate valid and test, compare with HF, report."""
    import torch
    from rich.console import Console

    from grserve.beauty.artifacts import ensure_beauty
    from grserve.beauty.data import load_sid_dataset
    from grserve.recommender import Recommender
    from grserve_bench.precision import OVERLAP_N
    from grserve_bench.retrieval import precision_fields

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    console = Console()
    if not console.is_terminal:
        console = Console(width=170)  # the table whole in a log file
    if cfg.model is None:
        art = ensure_beauty(artifacts, log=console.print, progress=cfg.progress)
        model_dir, catalog_path = art.model, art.catalog
    else:
        model_dir, catalog_path = Path(cfg.model), Path(cfg.catalog)
    meta_file = model_dir / "train_meta.json"
    train = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    max_items = int(train.get("config", {}).get("max_items", 20))
    split = load_sid_dataset(artifacts.data_dir, artifacts.index).split()
    beam_width = cfg.beam_width or 100
    splits = ("valid", "test") if cfg.split == "test" else ("valid",)
    first = None
    for dtype in split_commas(cfg.dtype, str):
        with Recommender(model=str(model_dir), catalog=str(catalog_path), beam_width=beam_width,
                         scoring=bench.scoring, max_batch_requests=bench.max_batch_requests or 64, dtype=dtype) as rec:
            chosen = rec.dtype_choice
            params = rec.engine.model.spec.num_parameters()
            results = [evaluate_split(rec, split, s, max_items, cfg.progress, cfg.max_users) for s in splits]
            items, catalog_ids = len(rec.catalog), {int(i) for i in rec.catalog.item_ids}
        hf = (hf_comparison(model_dir, catalog_path, split, max_items, bench.hf_users, beam_width, cfg.progress,
                            bench.max_batch_requests or 64, dtype=dtype)
              if bench.hf_users and "test" in splits and first is None else None)
        meta = {"beam_width": beam_width, "scoring": bench.scoring, "params": params, "items": items,
                "max_batch_requests": bench.max_batch_requests or 64,
                "train_seconds": train.get("seconds"), "index": train.get("index", artifacts.index)}
        console.print(f"dtype {chosen.label()}")
        print_table(results, hf, meta, console)
        line = {**report_json(results, hf, meta), **precision_fields(dtype, chosen)}
        if first is None:
            first = (results[-1], chosen.name)
        else:
            line.update(precision_reference=first[1], **precision_against(first[0], results[-1], catalog_ids,
                                                                          min(OVERLAP_N, beam_width)))
        print(json.dumps(line), flush=True)
    return 0 if not math.isnan(results[-1]["served"]["hr@10"]) else 1


def precision_against(reference: dict, test: dict, catalog_ids: set[int], n: int) -> dict:
    """One split's results at a dtype against the reference dtype's (``grserve check precision``'s comparison;
    HR@10 with its standard error, the one target of every user)."""
    from grserve.precision_check import compare

    c = compare(reference["recs"], test["recs"], catalog_ids, n, [[t] for t in reference["targets"]], recall_k=10)
    return {"top1_vs_reference": round(c.top1, 4), f"overlap@{n}_vs_reference": round(c.overlap_mean, 4),
            f"overlap@{n}_min_vs_reference": round(c.overlap_min, 4),
            "max_score_delta_vs_reference": round(c.max_score_delta, 5), "invalid_items": c.invalid,
            "hr@10_reference": round(c.recall_reference, 4), "hr@10_stderr_reference": round(c.recall_stderr, 4),
            "recall_within_stderr": c.recall_within_stderr, "ndcg_within_stderr": c.ndcg_within_stderr}
