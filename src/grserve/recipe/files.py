"""Content digests of the files a recipe reads and writes: a trained model records its catalog's, a dataset loader
checks its pinned data files against theirs."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_sha256(path: str | Path) -> str:
    """SHA-256 of a file's bytes, hex (the downloaded data files, the catalog a model was trained on)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
