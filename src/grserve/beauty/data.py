"""A dataset with ready semantic IDs, in the tiger-cf / LC-Rec folder layout, and its leave-one-out split.

A folder holds ``inter.json`` (``{"<user id>": [item id, ...]}``, each user's items in time order) and one
``index_<name>.json`` per SID index (``{"<item id>": [c_0, ..., c_{D-1}]}``). Amazon Beauty ships inside the
package (``grserve/datasets/amazon_beauty``, copied from tiger-cf; its README and licence are there); its files
are checked against pinned SHA-256s. Another folder of the same layout is read unchecked.

The split is the protocol of the published table: per user, the last item is the test target, the second-to-last
the validation target, the rest the training history (``movielens.split.Split``, the same type the MovieLens
recipe uses). Users are in ascending id order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grserve.recipe.files import file_sha256
from grserve.movielens.split import Split

BEAUTY_DIR = Path(__file__).resolve().parent.parent / "datasets" / "amazon_beauty"
BEAUTY_SHA256 = {
    "inter.json": "dfb8d33f8a2cf6eec9585d6365c319df58334e97eda6a68f881842d91ad41b85",
    "index_rqkmeans.json": "f6a7a5fbc51f57d017a7b815c490e7b0c322bb61160d2c3cb911769eaeff8028",
    "index_rqvae.json": "e75dc66ad83801a34978cfa089370a5c1c68b3adba69b218772d0c8b20a1b14f",
}
INDEXES = ("rqvae", "rqkmeans")


class DatasetError(ValueError):
    """A dataset folder is missing a file, fails its checksum, or does not hold what the layout says."""


@dataclass
class SidDataset:
    """Users' item sequences and each item's SID."""

    users: np.ndarray  # int64 [U], ascending
    sequences: list[np.ndarray]  # item ids, oldest first
    item_ids: np.ndarray  # int64 [N], ascending
    sids: np.ndarray  # int64 [N, depth]
    codebook_sizes: tuple[int, ...]
    source: str

    def split(self) -> Split:
        """Leave-one-out (last = test, second-to-last = valid); users with fewer than 3 items are dropped."""
        keep = [i for i, s in enumerate(self.sequences) if len(s) >= 3]
        return Split(users=self.users[keep],
                     train=[self.sequences[i][:-2] for i in keep],
                     valid=np.array([self.sequences[i][-2] for i in keep], dtype=np.int64),
                     test=np.array([self.sequences[i][-1] for i in keep], dtype=np.int64))


def _read_json(path: Path, pinned: str | None) -> dict:
    if not path.is_file():
        raise DatasetError(f"{path}: file not found")
    if pinned is not None and file_sha256(path) != pinned:
        raise DatasetError(f"{path}: SHA-256 does not match the pinned {pinned} (a changed copy of the data)")
    obj = json.loads(path.read_text())
    if not isinstance(obj, dict) or not obj:
        raise DatasetError(f"{path}: expected a non-empty JSON object")
    return obj


def _int_key(key: str, path: Path) -> int:
    try:
        return int(key)
    except ValueError:
        raise DatasetError(f"{path}: key {key[:40]!r} is not an integer id") from None


def load_sid_dataset(data_dir: str | Path | None = None, index: str = "rqkmeans") -> SidDataset:
    """Read ``inter.json`` and ``index_<index>.json`` of ``data_dir`` (default: the bundled Amazon Beauty)."""
    data_dir = Path(data_dir) if data_dir is not None else BEAUTY_DIR
    pinned = BEAUTY_SHA256 if data_dir.resolve() == BEAUTY_DIR else {}
    inter_path, index_path = data_dir / "inter.json", data_dir / f"index_{index}.json"
    inter = _read_json(inter_path, pinned.get("inter.json"))
    idx = _read_json(index_path, pinned.get(index_path.name))
    users = sorted(inter, key=lambda k: _int_key(k, inter_path))
    sequences = [np.asarray(inter[u], dtype=np.int64) for u in users]
    item_ids = np.array(sorted(_int_key(k, index_path) for k in idx), dtype=np.int64)
    sids = np.asarray([idx[str(i)] for i in item_ids], dtype=np.int64)
    if sids.ndim != 2:
        raise DatasetError(f"{index_path}: every SID must have the same number of codes")
    known = set(item_ids.tolist())
    for u, seq in zip(users, sequences):
        missing = [int(i) for i in seq if int(i) not in known]
        if missing:
            raise DatasetError(f"{inter_path}: user {u} has item {missing[0]}, which {index_path.name} lacks")
    sizes = tuple(int(2 ** np.ceil(np.log2(m + 1))) for m in sids.max(axis=0))  # 0..255 -> 256
    return SidDataset(users=np.array([int(u) for u in users], dtype=np.int64), sequences=sequences,
                      item_ids=item_ids, sids=sids, codebook_sizes=sizes, source=str(data_dir))
