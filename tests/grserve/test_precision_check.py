"""``grserve check precision`` (issue 42, the recall gate): the comparison's numbers on hand-made runs, and the
command end to end (bfloat16 against float32 on the tiny preset; targets give recall; the gate sets the exit code)."""

from __future__ import annotations

import json

import pytest

from grserve.cli import main
from grserve.precision_check import PrecisionCheck, compare, split_targets
from grserve.recommender import Recommendation, RecommendedItem


def _rec(*items: tuple[int, float]) -> Recommendation:
    return Recommendation("r", [RecommendedItem(i, (0, 0, 0), s) for i, s in items])


def test_the_comparison_counts_what_it_says():
    ref = [_rec((1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0)), _rec((5, -1.0), (6, -2.0), (7, -3.0), (8, -4.0))]
    got = [_rec((1, -1.5), (2, -2.0), (3, -3.0), (9, -3.5)), _rec((6, -2.25), (5, -1.0), (99, -3.0), (8, -4.0))]
    out = compare(ref, got, catalog_ids={1, 2, 3, 4, 5, 6, 7, 8, 9}, top_n=4, targets=[[4], [], ], recall_k=4)
    assert out.requests == 2 and out.top1 == 0.5
    assert (out.overlap_mean, out.overlap_min) == (0.75, 0.75)
    assert out.max_score_delta == 0.5 and out.invalid == 1  # item 99 is not in the catalog
    assert (out.targets, out.recall_reference, out.recall_test) == (1, 1.0, 0.0)
    assert not out.passes(PrecisionCheck())  # an invalid item never passes
    ok = compare(ref, ref, {1, 2, 3, 4, 5, 6, 7, 8}, 4)
    assert ok.passes(PrecisionCheck(min_top1=1.0, min_overlap=1.0)) and ok.max_score_delta == 0.0


def test_targets_are_held_out_of_the_request():
    assert split_targets({"history_items": [1], "target": 5}) == ({"history_items": [1]}, [5])
    assert split_targets({"history_items": [1], "targets": [5, 6]}) == ({"history_items": [1]}, [5, 6])
    assert split_targets([1, 2]) == ([1, 2], [])


def test_the_command_compares_bf16_with_fp32(tmp_path, capsys):
    from grserve.catalog import generate_catalog

    cat = generate_catalog(300, 3, 256, seed=3)
    ids = [int(i) for i in cat.item_ids]
    path = tmp_path / "users.jsonl"
    path.write_text("".join(json.dumps({"history_items": ids[k:k + 6], "target": ids[k + 6]}) + "\n"
                            for k in range(0, 60, 10)))
    common = ["check", "precision", "--num-items", "300", "--seed", "3", "--beam-width", "8", "--top-n", "8",
              "--recall-k", "8", "--input", str(path), "--json-only", "--no-warmup"]
    code = main([*common, "--dtype", "bfloat16", "--min-overlap", "0"])
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and record["passes"] and record["requests"] == 6 and record["targets"] == 6
    assert record["invalid"] == 0 and record["dtype"] == "bfloat16" and "cpu" in record["machine"]
    assert 0.0 <= record["overlap_min"] <= record["overlap_mean"] <= 1.0
    assert record["recall_reference"] is not None and record["recall_test"] is not None
    assert main([*common, "--dtype", "bfloat16", "--min-top1", "1.0", "--min-overlap", "1.0"]) == \
        (0 if record["top1"] == 1.0 and record["overlap_mean"] == 1.0 else 1)  # the gate is the exit code
    capsys.readouterr()
    assert main([*common, "--dtype", "float32"]) == 2
    assert "the reference is float32" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--min-overlap", "1.5"], "a fraction"),
                                            (["--top-n", "50"], "more than --beam-width")])
def test_bad_flags_are_usage_errors(flags, message, capsys):
    assert main(["check", "precision", "--dtype", "bfloat16", "--beam-width", "8", *flags]) == 2
    assert message in capsys.readouterr().err
