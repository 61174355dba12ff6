"""Recall@K / NDCG@K and the baselines of ``grserve bench quality`` on hand-made cases."""

import math

import numpy as np
import pytest

from grserve_bench.quality import (
    ndcg_at_k, popularity_ranking, random_unseen, recall_at_k, report_json, top_k_unseen,
)


def test_recall_and_ndcg_by_hand():
    ranked = [[5, 3, 9], [1, 2, 3], [7], []]
    targets = [3, 4, 7, 1]
    assert recall_at_k(ranked, targets, 3) == pytest.approx(2 / 4)
    assert recall_at_k(ranked, targets, 1) == pytest.approx(1 / 4)  # only user 3 has it first
    assert ndcg_at_k(ranked, targets, 3) == pytest.approx((1 / math.log2(3) + 1.0) / 4)
    assert ndcg_at_k(ranked, targets, 1) == pytest.approx(1 / 4)
    assert recall_at_k([], [], 10) == 0.0 and ndcg_at_k([], [], 10) == 0.0
    with pytest.raises(ValueError):
        recall_at_k([[1]], [1, 2], 10)


def test_only_the_first_k_count():
    assert recall_at_k([[1, 2, 3, 4]], [4], 3) == 0.0
    assert ndcg_at_k([[1, 2, 3, 4]], [4], 4) == pytest.approx(1 / math.log2(5))


def test_popularity_ranking_ties_by_item_id_and_skips_seen():
    ranking = popularity_ranking({10: 3, 11: 5, 12: 3, 13: 0}, np.array([13, 12, 11, 10, 14]))
    assert ranking.tolist() == [11, 10, 12, 13, 14]
    assert top_k_unseen(ranking, {11, 12}, 2) == [10, 13]
    assert top_k_unseen(ranking, set(), 10) == [11, 10, 12, 13, 14]


def test_random_baseline_excludes_seen_and_is_seeded():
    items = np.arange(1, 21)
    a = random_unseen(items, {1, 2, 3}, 10, np.random.default_rng(0))
    b = random_unseen(items, {1, 2, 3}, 10, np.random.default_rng(0))
    assert a == b and len(set(a)) == 10 and not set(a) & {1, 2, 3}
    assert sorted(random_unseen(items, set(range(1, 18)), 10, np.random.default_rng(0))) == [18, 19, 20]


def test_report_json_has_the_required_keys():
    r = {"k": 10, "users": 3, "split": "test", "beam_width": 50, "invalid_rate_masked": 0.0,
         "invalid_rate_unmasked": 0.25, "invalid_rate_unmasked_beam": 0.5,
         "metrics": {n: {"recall": 0.1, "ndcg": 0.05} for n in ("served", "served_seen_excluded", "popularity",
                                                                 "random")}}
    j = report_json(r)
    for key in ("recall@10", "recall@10_popularity", "invalid_rate_masked", "invalid_rate_unmasked"):
        assert key in j
