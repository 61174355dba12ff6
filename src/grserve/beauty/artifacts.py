"""The cached Amazon Beauty artifacts ``grserve bench quality --dataset beauty`` evaluates (``ensure_beauty``).

    ``<cache>/catalog.jsonl``  the dataset's ready SIDs as a catalog (arithmetic layout, token offset 16)
    ``<cache>/model/``         the GR decoder trained on the leave-one-out split (``grserve.recipe.train``) with
                               the recipe ``BEAUTY_RECIPE``, in HF format, with its tokenizer (``recipe.tokenizer``)

Each is rebuilt only when missing or stale: the catalog when its content would differ (another index or data
folder), the model when the catalog's SHA-256 or the training settings differ from its ``train_meta.json``.
``<cache>`` is ``--cache-dir``, else ``$GRSERVE_CACHE_DIR/beauty``, else ``.grserve-cache/beauty``.

Training writes ``<cache>/train-checkpoint.pt`` after every epoch; ``--resume`` continues an interrupted run from
it (same recipe and data only), with the weights an uninterrupted run gives.

``python -m grserve.beauty.artifacts [--rebuild] [--resume] [--budget-s S]`` builds (or reuses) them.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from grserve.beauty.data import INDEXES, load_sid_dataset
from grserve.flags import Checked, HelpFormatter, add_flags, flag, from_args, positive
from grserve.movielens.artifacts import Artifacts, model_is_current
from grserve.recipe.config import TrainConfig

# The recipe (docs/offline-eval.md has the experiments behind it). Prompt = the 20 most recent items, as the
# published protocol cuts histories; training windows are 21 items (20 of history + the target).
BEAUTY_RECIPE = TrainConfig(
    hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_items=20, window_items=21, window_stride=10, length_buckets=True,
    epochs=18, batch_size=128, lr=3e-3, warmup_steps=200, min_lr_ratio=0.02, weight_decay=0.1,
    dropout=0.2, loss="catalog", ema_decay=0.999, keep="last", threads=1)
CHECKPOINT = "train-checkpoint.pt"  # in the cache: the training state after the last finished epoch (--resume)
VALID_USERS = 4000  # validation users whose NLL picks the best epoch (every k-th user, k = users // VALID_USERS)


def default_cache_dir() -> Path:
    return Path(os.environ.get("GRSERVE_CACHE_DIR") or ".grserve-cache") / "beauty"


@dataclass(frozen=True)
class BeautyArtifactsConfig(Checked):
    """Where the Beauty artifacts live and how to (re)build them."""

    data_dir: str | None = flag(None, "a folder with inter.json and index_<name>.json (default: the bundled "
                                      "Amazon Beauty)", metavar="DIR")
    index: str = flag("rqkmeans", "which SID index of the data folder (index_<name>.json; the recipe was chosen "
                                  "on rqkmeans)", choices=INDEXES)
    cache_dir: str | None = flag(None, "artifact directory (default: $GRSERVE_CACHE_DIR/beauty or "
                                       ".grserve-cache/beauty)", metavar="DIR")
    rebuild: bool = flag(False, "rewrite the catalog and retrain the model even if cached")
    resume: bool = flag(False, "continue an interrupted training from its last epoch's checkpoint "
                               "(<cache>/train-checkpoint.pt, written after every epoch; used only if it is of the "
                               "same recipe and data)")
    budget_s: float | None = flag(None, "a wall-clock limit on training, in seconds, if it has to train (default: "
                                        "none, it trains the recipe's epochs)", check=positive, metavar="S")

    @property
    def root(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()


def _write_catalog_if_changed(ds, path: Path, log: Callable[[str], None]) -> None:
    from grserve.catalog import Catalog, save_catalog

    catalog = Catalog.from_arrays(ds.item_ids, ds.sids, codebook_sizes=ds.codebook_sizes, token_offset=16,
                                  source=ds.source)
    tmp = path.with_name("new-" + path.name)
    save_catalog(catalog, tmp)
    if path.is_file() and path.read_bytes() == tmp.read_bytes():
        tmp.unlink()
        log(f"reusing catalog {path}")
        return
    os.replace(tmp, path)
    log(f"wrote catalog {path}: {len(catalog):,} items, codebooks {list(catalog.codebook_sizes)}")


def ensure_beauty(cfg: BeautyArtifactsConfig = BeautyArtifactsConfig(), *, recipe: TrainConfig = BEAUTY_RECIPE,
                  log: Callable[[str], None] = print, progress: bool = True) -> Artifacts:
    """Write the catalog if it changed, train the model if it is missing or stale; reuse the rest."""
    art = Artifacts(cfg.root)
    art.root.mkdir(parents=True, exist_ok=True)
    ds = load_sid_dataset(cfg.data_dir, cfg.index)
    _write_catalog_if_changed(ds, art.catalog, log)
    train_cfg = recipe if cfg.budget_s is None else replace(recipe, time_budget_s=cfg.budget_s)
    complete = train_cfg.time_budget_s is None  # a model a budget cut short is stale for a full run
    if not cfg.rebuild and model_is_current(art, train_cfg.settings(), complete=complete):
        log(f"reusing model {art.model}")
        return art
    train_model(ds, art, train_cfg, index=cfg.index, log=log, progress=progress,
                checkpoint=art.root / CHECKPOINT, resume=cfg.resume)
    return art


def train_model(ds, art: Artifacts, train_cfg: TrainConfig, *, index: str, log: Callable[[str], None],
                progress: bool, checkpoint: Path | None = None, resume: bool = False) -> None:
    """Train on the leave-one-out training histories; the best epoch by the validation users' NLL is kept."""
    from grserve.catalog import load_catalog
    from grserve.recipe.tokenizer import save_sid_tokenizer
    from grserve.recipe.train import save_trained, train_gr

    split = ds.split()
    catalog = load_catalog(art.catalog)
    step = max(1, len(split.users) // VALID_USERS)
    valid = ([split.train[i] for i in range(0, len(split.users), step)], split.valid[::step])
    cap = "" if train_cfg.time_budget_s is None else f", at most {train_cfg.time_budget_s:.0f} s"
    log(f"training the GR model on {len(split.users):,} users' histories ({train_cfg.epochs} epochs{cap}; "
        f"keeping the {train_cfg.keep} epoch; validation NLL on {len(valid[1]):,} items) ...")
    result = train_gr(split.train, catalog, train_cfg, valid=valid, progress=progress, log=log,
                      checkpoint=checkpoint, resume=resume)
    save_trained(result, art.model, catalog_path=art.catalog,
                 extra={"dataset": ds.source, "index": index,
                        "split": "leave-one-out (last = test, second-to-last = valid)"})
    save_sid_tokenizer(catalog, art.model)
    log(f"saved model to {art.model} ({result.steps} steps, {result.seconds:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    """``python -m grserve.beauty.artifacts``: build (or reuse) the Beauty catalog and model."""
    p = argparse.ArgumentParser(prog="python -m grserve.beauty.artifacts", formatter_class=HelpFormatter,
                                description="Build (or reuse) the Amazon Beauty SID catalog and GR model.")
    add_flags(p, BeautyArtifactsConfig)
    art = ensure_beauty(from_args(BeautyArtifactsConfig, p.parse_args(argv)))
    print(f"catalog: {art.catalog}\nmodel:   {art.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
