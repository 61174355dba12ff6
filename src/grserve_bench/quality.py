"""``grserve bench quality``: how good are the served MovieLens recommendations?

For every user of the leave-one-out split (``grserve.movielens.split``) the prompt is the user's most recent
``max_items`` items before the test item (training history + the validation item) laid out as SID tokens — the
same prompt a ``/v1/recommend`` request with those ``history_items`` gets. It runs through the exact served path,
``RetrievalRunner`` (packed prefill, staged beam decode, catalog item mask), with beam width ``--beam-width``;
the top ``--k`` items are scored against the one held-out item:

    Recall@K = 1 if the held-out item is in the top K           NDCG@K = 1 / log2(rank + 2) if it is (rank 0-based)

averaged over users. On the same users:
  - popularity: the K most-interacted items (counted on everything but the test items), minus the user's history;
  - random: K items drawn uniformly (seeded) from the items the user has not seen;
  - served, seen excluded: the same served search with the user's history as ``exclude_items`` (masked inside
    the beam search, as ``/v1/recommend`` does: no beam is spent on a seen item, so K unseen items come back
    whenever the catalog has them); the JSON's ``recall@10`` is the plain served result;
  - invalid-item rate: the fraction of returned top-K SIDs that are not catalog items. Masked = the served path
    (must be 0). Unmasked = the same beam search over each level's token range with no item mask
    (``unconstrained_beam_search``, built here from the model and the existing KV contexts), i.e. what the model
    would return without the catalog constraint.

The last output line is one JSON object: ``recall@10``, ``ndcg@10``, ``recall@10_popularity``,
``recall@10_random``, ``invalid_rate_masked``, ``invalid_rate_unmasked`` and the settings (keys use the actual K).

The precision is a dimension (issue 42): ``--dtype float32,bfloat16`` evaluates the same users once per dtype, in
that order, one table and one JSON line each; every line names the dtype used (``auto`` resolved), why, the
quantization (``"none"``) and the machine, and every line after the first compares its served lists with the first
dtype's (``precision_reference``): ``top1_vs_reference``, ``overlap@N_vs_reference`` (N = min(20, beam width)) and
whether its Recall@K lies within one standard error of the reference's (``recall_within_stderr``), as
``grserve check precision`` reports them (``--dataset beauty`` likewise).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from grserve.config import DTYPES
from grserve.flags import (
    Checked,
    ConfigError,
    add_flags,
    comma_list,
    command_parser,
    flag,
    from_args,
    non_negative,
    positive_int,
    split_commas,
)
from grserve.movielens.artifacts import ArtifactsConfig
from grserve_bench.precision import OVERLAP_N, hits_at_k, precision_comparison
from grserve_bench.machine import machine_info


# ----------------------------------------------------------------------------------------------------------
# metrics (leave-one-out: one relevant item per user)
# ----------------------------------------------------------------------------------------------------------
def _rank(ranked: Sequence[int], target: int, k: int) -> int | None:
    for r, item in enumerate(list(ranked)[:k]):
        if item == target:
            return r
    return None


def recall_at_k(ranked_lists: Sequence[Sequence[int]], targets: Sequence[int], k: int) -> float:
    """Mean over users of [target in top k]. An empty user list counts 0; no users → 0."""
    if not len(targets):
        return 0.0
    return float(np.mean([_rank(r, int(t), k) is not None for r, t in zip(ranked_lists, targets, strict=True)]))


def ndcg_at_k(ranked_lists: Sequence[Sequence[int]], targets: Sequence[int], k: int) -> float:
    """Mean over users of 1/log2(rank+2) (rank 0-based) if the target is in the top k, else 0 (ideal DCG = 1)."""
    if not len(targets):
        return 0.0
    gains = []
    for r, t in zip(ranked_lists, targets, strict=True):
        rank = _rank(r, int(t), k)
        gains.append(0.0 if rank is None else 1.0 / math.log2(rank + 2))
    return float(np.mean(gains))


# ----------------------------------------------------------------------------------------------------------
# baselines
# ----------------------------------------------------------------------------------------------------------
def popularity_ranking(counts: dict[int, int] | np.ndarray, item_ids: np.ndarray) -> np.ndarray:
    """Item ids by interaction count descending, ties by item id ascending."""
    item_ids = np.asarray(item_ids, dtype=np.int64)
    c = np.array([counts.get(int(i), 0) for i in item_ids]) if isinstance(counts, dict) else np.asarray(counts)
    return item_ids[np.lexsort((item_ids, -c))]


def top_k_unseen(ranking: np.ndarray, seen: set[int], k: int) -> list[int]:
    out = []
    for item in ranking:
        if int(item) not in seen:
            out.append(int(item))
            if len(out) == k:
                break
    return out


def random_unseen(item_ids: np.ndarray, seen: set[int], k: int, rng: np.random.Generator) -> list[int]:
    pool = np.array([i for i in item_ids if int(i) not in seen], dtype=np.int64)
    return [int(i) for i in rng.choice(pool, size=min(k, len(pool)), replace=False)]


# ----------------------------------------------------------------------------------------------------------
# the unmasked search
# ----------------------------------------------------------------------------------------------------------
def unconstrained_beam_search(model, prompt: np.ndarray, layout, beam_width: int, top_n: int) -> np.ndarray:
    """Beam search over each level's token range with no catalog mask → SIDs [≤top_n, depth], best first.

    Same scoring as the served default (log-softmax over the level's token range, summed over levels); every
    beam keeps a private KV copy (``BatchedBeamsKVContext``) — slow but simple, and independent of the engine.
    """
    import torch

    with torch.inference_mode():
        return _unconstrained_beam_search(model, prompt, layout, beam_width, top_n)


def _unconstrained_beam_search(model, prompt: np.ndarray, layout, beam_width: int, top_n: int) -> np.ndarray:
    import torch

    from grserve.attention.context import SequenceKVContext
    from grserve_bench.baselines import BatchedBeamsKVContext

    dev = model.device
    seq = SequenceKVContext(model.spec.num_hidden_layers)
    n = int(prompt.shape[0])
    hidden = model(torch.as_tensor(prompt, dtype=torch.int64, device=dev), torch.arange(n, device=dev), seq)
    logp = torch.log_softmax(model.logits(hidden[-1:], layout.level_range(0)).float(), dim=-1)[0]
    k = min(beam_width, logp.shape[0])
    scores, codes0 = torch.topk(logp, k)
    codes = codes0[:, None]
    ctx = BatchedBeamsKVContext.from_sequence(seq, k)
    for level in range(1, layout.depth):
        start_prev = layout.level_range(level - 1)[0]
        tokens = codes[:, -1] + start_prev
        h = model(tokens, torch.full_like(tokens, n + level - 1), ctx)
        logp = torch.log_softmax(model.logits(h, layout.level_range(level)).float(), dim=-1)  # [beams, C]
        cand = (scores[:, None] + logp).reshape(-1)
        width = min(beam_width, cand.shape[0])
        scores, flat = torch.topk(cand, width)
        parents, new = flat // logp.shape[1], flat % logp.shape[1]
        codes = torch.cat([codes[parents], new[:, None]], dim=1)
        if level < layout.depth - 1:
            ctx.reorder(parents)
    return codes[:top_n].cpu().numpy()


# ----------------------------------------------------------------------------------------------------------
# the benchmark
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QualityBenchConfig(Checked):
    """``grserve bench quality``: which model, and how it is evaluated."""

    dataset: str = flag("movielens", "movielens: MovieLens-100k (this module); beauty: Amazon Beauty against the "
                                     "published table (grserve_bench.beauty)", choices=("movielens", "beauty"))
    model: str | None = flag(None, "evaluate this model directory instead of the cached one (needs --catalog)",
                             metavar="DIR")
    catalog: str | None = flag(None, "the catalog --model was trained with", metavar="FILE")
    beam_width: int | None = flag(None, "served beam width (default: 50 movielens, 100 beauty)", check=positive_int)
    k: int = flag(10, "cut-off K of Recall@K / NDCG@K", check=positive_int)
    batch: int = flag(32, "users per RetrievalRunner batch", check=positive_int)
    split: str = flag("test", "valid: predict the validation item from the training history",
                      choices=("test", "valid"))
    max_users: int | None = flag(None, "evaluate only the first N users", check=non_negative)
    seed: int = flag(0, "seed of the random baseline", check=non_negative)
    threads: int = flag(1, "torch intra-op threads (0: torch's default); 1 avoids OpenMP spin-waiting on a busy "
                           "CPU", check=non_negative)
    progress: bool = flag(True, "progress bars")
    dtype: str = flag("float32", "model dtype, or a comma-separated list (e.g. float32,bfloat16): the evaluation runs "
                                 "once per dtype, one JSON line each, the later ones compared with the first "
                                 "(top-1, overlap@20, Recall@K within one standard error); auto: what grserve "
                                 "serve would pick here", check=comma_list(str, allowed=DTYPES))
    artifacts: ArtifactsConfig = field(default_factory=ArtifactsConfig)

    def check(self) -> None:
        if (self.model is None) != (self.catalog is None):
            raise ConfigError("catalog" if self.catalog is None else "model", "--model and --catalog go together")
        if self.beam_width is not None and self.beam_width < self.k:
            raise ConfigError("beam_width", f"{self.beam_width} must be >= --k {self.k}")


def add_command(sub) -> None:
    """``grserve bench quality``."""
    p = command_parser(sub, "quality", help="Recall@10 / NDCG@10 of the served MovieLens model vs baselines",
                       description="Recall@K / NDCG@K of the served MovieLens-100k GR model on the leave-one-out "
                                   "test items, next to popularity and random baselines, and the invalid-item rate "
                                   "with and without the item mask. Builds (once) and reuses the cached catalog and "
                                   "model.")
    add_flags(p, QualityBenchConfig, title="evaluation")
    add_flags(p, ArtifactsConfig, title="artifacts (MovieLens data, catalog, model)")
    from grserve.beauty.artifacts import BeautyArtifactsConfig
    from grserve_bench.beauty import BeautyBenchConfig

    add_flags(p, BeautyBenchConfig, title="--dataset beauty (its cache: $GRSERVE_CACHE_DIR/beauty or "
                                          ".grserve-cache/beauty)")
    add_flags(p, BeautyArtifactsConfig)
    p.set_defaults(handler=_main)


def _main(ns) -> int:
    cfg = from_args(QualityBenchConfig, ns, artifacts=from_args(ArtifactsConfig, ns))
    if cfg.dataset == "beauty":
        from grserve.beauty.artifacts import BeautyArtifactsConfig
        from grserve_bench import beauty

        return beauty.run(cfg, from_args(beauty.BeautyBenchConfig, ns), from_args(BeautyArtifactsConfig, ns))
    return run(cfg)


def evaluate(model, catalog, split, *, max_items: int, beam_width: int = 50, k: int = 10, batch: int = 32,
             split_name: str = "test", max_users: int | None = None, seed: int = 0, progress: bool = True) -> dict:
    """Every number of the report, as a dict (see the module doc)."""
    from tqdm import tqdm

    from grserve.config import SearchConfig
    from grserve.engine.retrieval import RetrievalRunner
    from grserve.recipe.train import history_tokens

    n_users = len(split.users) if max_users is None else min(max_users, len(split.users))
    if split_name == "test":
        histories = [split.test_history(i) for i in range(n_users)]
        targets = split.test[:n_users]
        exclude = split.test  # popularity counts must not see the evaluated items
    else:
        histories = [split.train[i] for i in range(n_users)]
        targets = split.valid[:n_users]
        exclude = None
    prompts = [history_tokens(h, catalog, max_items) for h in histories]
    seen = [set(int(x) for x in h) for h in histories]

    runner = RetrievalRunner(model, SearchConfig(beam_width=beam_width, max_beam_width=max(512, beam_width)))
    served, excluded, ranked, invalid_masked, returned_masked = [], [], [], 0, 0
    t0 = time.perf_counter()
    try:
        for a in tqdm(range(0, n_users, batch), desc="served beam search", unit="batch", disable=not progress):
            top = [beam_width] * len(prompts[a:a + batch])
            out = runner.run(prompts[a:a + batch], beam_width, top, catalog)
            seen_ids = [np.fromiter(s, dtype=np.int64) for s in seen[a:a + batch]]
            unseen = runner.run(prompts[a:a + batch], beam_width, top, catalog, exclude=seen_ids)
            excluded.extend([h.item_id for h in hits[:k]] for hits in unseen.hits)
            for hits in out.hits:
                items = [h.item_id for h in hits]
                served.append(items[:k])
                ranked.append(items[:OVERLAP_N])
                sids = np.array([h.sid for h in hits[:k]], dtype=np.int64).reshape(-1, catalog.depth)
                invalid_masked += int((~catalog.contains_sids(sids)).sum()) if len(sids) else 0
                returned_masked += len(sids)
    finally:
        runner.close()
    served_s = time.perf_counter() - t0

    invalid_unmasked, returned_unmasked, invalid_beam, returned_beam = 0, 0, 0, 0
    for p in tqdm(prompts, desc="unmasked beam search", unit="user", disable=not progress):
        sids = unconstrained_beam_search(model, p, catalog.layout, beam_width, beam_width)
        bad = ~catalog.contains_sids(sids)
        invalid_unmasked += int(bad[:k].sum())
        returned_unmasked += min(k, len(sids))
        invalid_beam += int(bad.sum())
        returned_beam += len(sids)

    # baselines on the same users
    all_items = np.sort(catalog.item_ids)
    counts: dict[int, int] = {}
    for i in range(len(split.users)):
        for it in split.test_history(i) if exclude is not None else split.train[i]:
            counts[int(it)] = counts.get(int(it), 0) + 1
    pop_rank = popularity_ranking(counts, all_items)
    pop = [top_k_unseen(pop_rank, s, k) for s in seen]
    rng = np.random.default_rng(seed)
    rnd = [random_unseen(all_items, s, k, rng) for s in seen]
    rows = {
        "served": served, "served_seen_excluded": excluded, "popularity": pop, "random": rnd,
    }
    res = {name: {"recall": recall_at_k(r, targets, k), "ndcg": ndcg_at_k(r, targets, k)} for name, r in rows.items()}
    return {
        "k": k, "users": n_users, "split": split_name, "beam_width": beam_width, "max_items": max_items,
        "metrics": res,
        "invalid_rate_masked": invalid_masked / max(returned_masked, 1),
        "invalid_rate_unmasked": invalid_unmasked / max(returned_unmasked, 1),
        "invalid_rate_unmasked_beam": invalid_beam / max(returned_beam, 1),  # over all BW final beams
        "returned_masked": returned_masked, "returned_unmasked": returned_unmasked,
        "served_seconds": served_s,
        "coverage": len({i for r in served for i in r}) / len(all_items),
        "ranked": ranked,  # each user's top OVERLAP_N served items (the precision comparison)
        "targets": [int(t) for t in targets],
    }


def report_json(r: dict) -> dict:
    k, m = r["k"], r["metrics"]
    return {
        "machine": machine_info()["cpu"],
        f"recall@{k}": round(m["served"]["recall"], 4),
        f"ndcg@{k}": round(m["served"]["ndcg"], 4),
        f"recall@{k}_popularity": round(m["popularity"]["recall"], 4),
        f"ndcg@{k}_popularity": round(m["popularity"]["ndcg"], 4),
        f"recall@{k}_random": round(m["random"]["recall"], 4),
        f"recall@{k}_seen_excluded": round(m["served_seen_excluded"]["recall"], 4),
        f"ndcg@{k}_seen_excluded": round(m["served_seen_excluded"]["ndcg"], 4),
        "invalid_rate_masked": round(r["invalid_rate_masked"], 4),
        "invalid_rate_unmasked": round(r["invalid_rate_unmasked"], 4),
        f"invalid_rate_unmasked@{r['beam_width']}": round(r["invalid_rate_unmasked_beam"], 4),
        "users": r["users"], "split": r["split"], "beam_width": r["beam_width"],
    }


def print_report(r: dict, console) -> None:
    from rich.table import Table

    k, m = r["k"], r["metrics"]
    t = Table(title=f"MovieLens-100k leave-one-out ({r['split']} item), {r['users']} users, K={k}",
              title_justify="left")
    t.add_column("recommender")
    t.add_column(f"Recall@{k}", justify="right")
    t.add_column(f"NDCG@{k}", justify="right")
    t.add_column("invalid items", justify="right")
    t.add_row(f"grserve served (beam {r['beam_width']}, item mask)", f"{m['served']['recall']:.4f}",
              f"{m['served']['ndcg']:.4f}", f"{r['invalid_rate_masked']:.2%}")
    t.add_row("grserve served, history excluded (exclude_items)", f"{m['served_seen_excluded']['recall']:.4f}",
              f"{m['served_seen_excluded']['ndcg']:.4f}", "0.00%")
    t.add_row("same model, no item mask", "", "",
              f"{r['invalid_rate_unmasked']:.2%} (all {r['beam_width']} beams: {r['invalid_rate_unmasked_beam']:.2%})")
    t.add_row("popularity (unseen items)", f"{m['popularity']['recall']:.4f}", f"{m['popularity']['ndcg']:.4f}", "0.00%")
    t.add_row("random (unseen items)", f"{m['random']['recall']:.4f}", f"{m['random']['ndcg']:.4f}", "0.00%")
    console.print(t)
    pop = m["popularity"]["recall"]
    lift = f"{m['served']['recall'] / pop:.2f}× popularity" if pop > 0 else "popularity recall is 0"
    console.print(f"served Recall@{k} = {lift}; item coverage of the served top-{k}: {r['coverage']:.1%}; "
                  f"served beam search {r['served_seconds']:.1f} s for {r['users']} users")


def run(cfg: QualityBenchConfig) -> int:
    """Build or reuse the artifacts (or take ``cfg.model``), evaluate, print the table and the JSON line."""
    import torch
    from rich.console import Console

    from grserve.catalog import load_catalog
    from grserve.model import load_model
    from grserve.movielens.artifacts import ensure_artifacts
    from grserve.movielens.data import load_movielens
    from grserve.movielens.split import leave_one_out

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    console = Console(stderr=False)
    if cfg.model is None:
        art = ensure_artifacts(cfg.artifacts, log=console.print, progress=cfg.progress)
        model_dir, catalog_path = art.model, art.catalog
    else:
        model_dir, catalog_path = Path(cfg.model), Path(cfg.catalog)
    meta_path = Path(model_dir) / "train_meta.json"
    max_items = 50
    if meta_path.is_file():
        max_items = int(json.loads(meta_path.read_text()).get("config", {}).get("max_items", max_items))

    split = leave_one_out(load_movielens(cfg.artifacts.root, cfg.artifacts.widedeep_wheel, log=console.print).ratings)
    catalog = load_catalog(catalog_path)
    from grserve_bench.retrieval import precision_fields

    first = None
    for dtype in split_commas(cfg.dtype, str):
        model = load_model(model_dir, dtype=dtype)
        chosen = model.dtype_choice  # auto resolved, and why
        console.print(f"model {model_dir} ({model.spec.num_parameters():,} parameters, "
                      f"{model.dtype_choice.label()}), catalog {catalog_path} ({len(catalog)} items, codebooks "
                      f"{list(catalog.codebook_sizes)}), prompt = last {max_items} items")
        r = evaluate(model, catalog, split, max_items=max_items, beam_width=cfg.beam_width or 50, k=cfg.k,
                     batch=cfg.batch, split_name=cfg.split, max_users=cfg.max_users, seed=cfg.seed,
                     progress=cfg.progress)
        del model
        line = {**report_json(r), **precision_fields(dtype, chosen)}
        if first is None:
            first = (r, chosen.name)
        else:
            ref = first[0]
            line.update(precision_reference=first[1], **precision_comparison(
                ref["ranked"], r["ranked"], hits_at_k(ref["ranked"], ref["targets"], cfg.k),
                hits_at_k(r["ranked"], r["targets"], cfg.k), n=min(OVERLAP_N, cfg.beam_width or 50)))
        print_report(r, console)
        print(json.dumps(line), flush=True)
    return 0

