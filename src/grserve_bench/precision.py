"""The precision dimension of ``grserve bench quality`` (MovieLens and Beauty alike): one dtype's served lists against
the reference dtype's -- top-1 agreement, overlap of the top N, whether the hit rate lies within one standard error."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

OVERLAP_N = 20  # overlap@N of the precision comparison (at most the beam width)


def precision_comparison(reference: Sequence[Sequence[int]], test: Sequence[Sequence[int]],
                         ref_hits: Sequence[float], test_hits: Sequence[float], n: int = OVERLAP_N) -> dict:
    """One dtype's served lists against the reference dtype's, per user (same users, same order): top-1 agreement,
    mean / min overlap of the top ``n``, and whether the hit rate (Recall@K, one target per user: ``*_hits`` are
    0/1 per user) lies within one standard error of the reference's."""
    top1 = [bool(a) and bool(b) and a[0] == b[0] for a, b in zip(reference, test, strict=True)]
    overlap = [len(set(a[:n]) & set(b[:n])) / max(len(a[:n]), 1) for a, b in zip(reference, test, strict=True)]
    ref, got = np.asarray(ref_hits, dtype=float), np.asarray(test_hits, dtype=float)
    stderr = float(np.sqrt(ref.mean() * (1 - ref.mean()) / len(ref))) if len(ref) else 0.0
    return {"top1_vs_reference": round(float(np.mean(top1)), 4) if top1 else 1.0,
            f"overlap@{n}_vs_reference": round(float(np.mean(overlap)), 4) if overlap else 1.0,
            f"overlap@{n}_min_vs_reference": round(float(np.min(overlap)), 4) if overlap else 1.0,
            "recall_stderr_reference": round(stderr, 4),
            "recall_within_stderr": bool(abs(got.mean() - ref.mean()) <= stderr + 1e-12) if len(ref) else True}


def hits_at_k(ranked: Sequence[Sequence[int]], targets: Sequence[int], k: int) -> list[float]:
    return [float(int(t) in list(r)[:k]) for r, t in zip(ranked, targets, strict=True)]
