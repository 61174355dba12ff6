"""Residual k-means (RQ-KMeans): embeddings → D-level semantic IDs, then collision resolution.

Level 0 clusters the embeddings into C_0 centroids; level l clusters the residuals left after levels < l into C_l
centroids. An item's SID is its nearest centroid at each level (greedy residual encoding), so the SID prefix is a
coarse-to-fine description of the item and ``decode(codes)`` = Σ_l codebook_l[code_l] approximates the embedding;
the total squared reconstruction error of the fitted items never grows with the number of levels (every
non-empty centroid ends as the mean of the points assigned to it, the mean minimises a set's sum of squares, and
nearest-centroid assignment can only lower it further — so level l+1 leaves at most the error level l left).

Everything is seeded and deterministic: float64 numpy, k-means++ initialisation from ``default_rng([seed, level])``,
fixed Lloyd iterations until the assignment stops changing, argmin ties to the lowest index, empty clusters
re-seeded with the point farthest from its centroid (lowest index on ties).

Collisions (``resolve_collisions``). Two items can land on the same SID (identical texts, e.g. the duplicated
MovieLens titles, or just close embeddings). A catalog needs SIDs one-to-one, and we keep the depth fixed (no extra
disambiguation level, so every item is exactly D tokens and the vocabulary stays Σ C_l). Instead we *reassign*:
  - in each group of items sharing a SID, the item closest to that SID's reconstruction keeps it;
  - every other item, in order of (reconstruction error, row), takes the nearest *free* code of the last level
    under its own prefix (nearest to its last-level residual), i.e. the smallest possible change of its SID;
  - if that prefix is full (all C_{D-1} codes used), it moves up one level: it tries the codes of level D-2 in
    order of distance to that level's residual, and under each the nearest free last-level code; and so on up to
    level 0. The search is depth-first in distance order, so the first free SID found is the one reached by
    changing the fewest (and deepest) levels.
It fails only when the catalog holds more items than Π C_l SIDs. ``CollisionReport`` says how many items moved and
how far up they had to go.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


def _sq_dists(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """[n, k] squared Euclidean distances (float64, clipped at 0)."""
    d = (x * x).sum(1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(1)[None, :]
    return np.maximum(d, 0.0)


def _kmeans_pp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    n = x.shape[0]
    centers = np.empty((k, x.shape[1]), dtype=np.float64)
    centers[0] = x[rng.integers(n)]
    closest = _sq_dists(x, centers[:1])[:, 0]
    for j in range(1, k):
        total = closest.sum()
        if total <= 0:  # fewer distinct points than k: take any points (duplicates get fixed as empty clusters)
            idx = int(rng.integers(n))
        else:
            idx = int(np.searchsorted(np.cumsum(closest), rng.random() * total, side="right"))
            idx = min(idx, n - 1)
        centers[j] = x[idx]
        closest = np.minimum(closest, _sq_dists(x, centers[j:j + 1])[:, 0])
    return centers


def kmeans(x: np.ndarray, k: int, seed: int | Sequence[int] = 0, max_iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd's k-means with k-means++ init. Returns (centroids [k, d] float64, labels [n] int64)."""
    x = np.asarray(x, dtype=np.float64)
    n = x.shape[0]
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= n points, got k={k}, n={n}")
    rng = np.random.default_rng(seed)
    centers = _kmeans_pp(x, k, rng)
    labels = np.full(n, -1, dtype=np.int64)
    for _ in range(max_iters):
        d = _sq_dists(x, centers)
        new = d.argmin(1)
        if np.array_equal(new, labels):
            break
        labels = new
        counts = np.bincount(labels, minlength=k)
        sums = np.zeros_like(centers)
        np.add.at(sums, labels, x)
        nonempty = counts > 0
        centers[nonempty] = sums[nonempty] / counts[nonempty, None]
        err = d[np.arange(n), labels]
        for j in np.flatnonzero(~nonempty):  # re-seed an empty cluster with the worst-served point
            far = int(err.argmax())
            centers[j] = x[far]
            err[far] = -1.0
    labels = _sq_dists(x, centers).argmin(1)
    return centers, labels


@dataclass
class RQKMeans:
    codebooks: list[np.ndarray]  # level l: [C_l, d] float64

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        return tuple(int(c.shape[0]) for c in self.codebooks)

    @property
    def depth(self) -> int:
        return len(self.codebooks)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """Greedy residual encoding → codes [n, D] int64."""
        r = np.asarray(x, dtype=np.float64).copy()
        codes = np.empty((r.shape[0], self.depth), dtype=np.int64)
        for level, cb in enumerate(self.codebooks):
            codes[:, level] = _sq_dists(r, cb).argmin(1)
            r -= cb[codes[:, level]]
        return codes

    def decode(self, codes: np.ndarray, levels: int | None = None) -> np.ndarray:
        """Σ over the first ``levels`` (default all) levels of the chosen centroids."""
        codes = np.asarray(codes, dtype=np.int64)
        levels = self.depth if levels is None else levels
        out = np.zeros((codes.shape[0], self.codebooks[0].shape[1]), dtype=np.float64)
        for level in range(levels):
            out += self.codebooks[level][codes[:, level]]
        return out

    def level_errors(self, x: np.ndarray, codes: np.ndarray) -> list[float]:
        """Mean squared reconstruction error after 1, 2, ..., D levels."""
        x = np.asarray(x, dtype=np.float64)
        return [float(((x - self.decode(codes, lv)) ** 2).sum(1).mean()) for lv in range(1, self.depth + 1)]


def fit_rqkmeans(x: np.ndarray, codebook_sizes: Sequence[int], seed: int = 0, max_iters: int = 100) -> RQKMeans:
    """Fit one k-means per level on the residuals of the previous levels."""
    r = np.asarray(x, dtype=np.float64).copy()
    books = []
    for level, k in enumerate(codebook_sizes):
        centers, labels = kmeans(r, int(k), seed=[seed, level], max_iters=max_iters)
        books.append(centers)
        r -= centers[labels]
    return RQKMeans(books)


@dataclass
class CollisionReport:
    colliding_groups: int = 0  # SIDs that more than one item landed on
    largest_group: int = 1
    reassigned: int = 0  # items whose SID was changed
    changed_from_level: dict[int, int] = field(default_factory=dict)  # highest level changed → number of items

    def to_dict(self) -> dict:
        return {"colliding_groups": self.colliding_groups, "largest_group": self.largest_group,
                "reassigned": self.reassigned,
                "changed_from_level": {str(k): v for k, v in sorted(self.changed_from_level.items())}}


def resolve_collisions(x: np.ndarray, rq: RQKMeans, codes: np.ndarray) -> tuple[np.ndarray, CollisionReport]:
    """Make SIDs unique by reassigning all but one item of each colliding group (see the module doc)."""
    x = np.asarray(x, dtype=np.float64)
    codes = np.asarray(codes, dtype=np.int64).copy()
    n, depth = codes.shape
    capacity = int(np.prod([float(c) for c in rq.codebook_sizes]))
    if n > capacity:
        raise ValueError(f"{n} items do not fit in {capacity} SIDs (codebook sizes {rq.codebook_sizes})")
    err = ((x - rq.decode(codes)) ** 2).sum(1)
    order = np.lexsort((np.arange(n), err))  # by error, then row
    taken: set[tuple[int, ...]] = set()
    movers: list[int] = []
    groups: dict[tuple[int, ...], int] = {}
    for i in order:
        sid = tuple(codes[i].tolist())
        groups[sid] = groups.get(sid, 0) + 1
        if sid in taken:
            movers.append(int(i))
        else:
            taken.add(sid)
    report = CollisionReport()
    report.colliding_groups = sum(1 for v in groups.values() if v > 1)
    report.largest_group = max(groups.values())

    def residual_at(i: int, prefix: tuple[int, ...]) -> np.ndarray:
        r = x[i].copy()
        for level, c in enumerate(prefix):
            r -= rq.codebooks[level][c]
        return r

    def nearest_free(r: np.ndarray, prefix: tuple[int, ...]) -> tuple[int, ...] | None:
        level = len(prefix)
        cb = rq.codebooks[level]
        for c in np.argsort(_sq_dists(r[None, :], cb)[0], kind="stable"):
            c = int(c)
            if level == depth - 1:
                if prefix + (c,) not in taken:
                    return (c,)
            else:
                rest = nearest_free(r - cb[c], prefix + (c,))
                if rest is not None:
                    return (c,) + rest
        return None

    for i in movers:
        old = tuple(codes[i].tolist())
        for level in range(depth - 1, -1, -1):  # change as few (and as deep) levels as possible
            suffix = nearest_free(residual_at(i, old[:level]), old[:level])
            if suffix is not None:
                new = old[:level] + suffix
                break
        else:  # unreachable: capacity was checked
            raise ValueError("no free SID left")
        taken.add(new)
        codes[i] = new
        first_changed = next(lv for lv in range(depth) if new[lv] != old[lv])
        report.changed_from_level[first_changed] = report.changed_from_level.get(first_changed, 0) + 1
        report.reassigned += 1
    return codes, report
