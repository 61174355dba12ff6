"""Several items with one SID (issue 33): refused by default, naming both items and the line — the entry, for a
one-line LC-Rec index — with the same exit code from ``catalog validate`` and ``catalog convert``; or, with
``--duplicate-sids popularity``, every item of a SID served, ranked by popularity within it, each answer naming its
own item: the answer of the catalog without the extra items, each SID expanded into its items."""

from __future__ import annotations

import json

import numpy as np
import pytest

from grserve.catalog import CatalogError, generate_catalog, load_catalog
from grserve.recommender import Recommender

BW = 32


def _index(n: int, extra: dict[str, list[str]]) -> dict[str, list[str]]:
    cat = generate_catalog(n, 3, 8, 0, 16)
    out = {str(int(i)): [f"<{'abc'[lv]}_{int(c)}>" for lv, c in enumerate(s)] for i, s in zip(cat.item_ids, cat.sids)}
    return {**out, **extra}


def test_a_refused_duplicate_names_both_items_and_the_entry_of_a_one_line_index(tmp_path, capsys):
    from grserve.cli import main

    index = _index(500, {})
    first_key = next(iter(index))
    index["9999"] = index[first_key]  # the 501st entry repeats the first one's SID
    path = tmp_path / "Beauty.index.json"
    path.write_text(json.dumps(index))
    with pytest.raises(CatalogError) as exc:
        load_catalog(path)
    msg = str(exc.value)
    assert "entry 501" in msg and "line" not in msg and f"item {first_key}" in msg and "item 9999" in msg
    codes = {main(["catalog", "validate", str(path)]), main(["catalog", "convert", str(path), "--out",
                                                              str(tmp_path / "x.grcat")])}
    err = capsys.readouterr().err.splitlines()
    assert codes == {1} and len(err) == 2 and err[0] == err[1] and "entry 501" in err[0]
    assert main(["catalog", "validate", str(path), "--duplicate-sids", "popularity"]) == 0
    assert "501 items (500 SIDs)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A catalog, the model's answer on it, and the same catalog with three more items on two answered SIDs."""
    d = tmp_path_factory.mktemp("dup")
    cat = generate_catalog(200, 3, 8, 0, 16)
    rows = [{"item_id": int(i), "sid": [int(c) for c in s]} for i, s in zip(cat.item_ids, cat.sids)]
    header = {"codebook_sizes": [8, 8, 8], "token_offset": 16}
    (d / "unique.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [header, *rows]))
    hist = [int(i) for i in cat.item_ids[40:46]]
    with Recommender(model="tiny", catalog=str(d / "unique.jsonl"), beam_width=BW) as rec:
        ref = rec.recommend([{"history_items": hist, "top_n": BW}], progress=False)[0]
    x, y = ref.items[1].item_id, ref.items[4].item_id
    sid_x, sid_y = cat.sid_of(x), cat.sid_of(y)
    extra = [{"item_id": 1000, "sid": list(sid_x)}, {"item_id": 1001, "sid": list(sid_x)},
             {"item_id": 1002, "sid": list(sid_y)}]
    (d / "dup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [header, *rows, *extra]))
    (d / "pop.json").write_text(json.dumps({"1001": 5, str(x): 2, "1002": 1}))
    groups = {sid_x: [1001, x, 1000], sid_y: [1002, y]}  # by count descending, then item id
    return d, x, hist, ref, groups


def _expanded(answer, groups, top_n, drop=()):
    out = []
    for it in answer.items:
        out += [(i, it.sid, it.score) for i in groups.get(it.sid, [it.item_id]) if i not in drop]
    return out[:top_n]


def test_every_item_of_a_sid_is_served_ranked_by_popularity(files):
    d, x, hist, ref, groups = files
    with Recommender(model="tiny", catalog=str(d / "dup.jsonl"), beam_width=BW, duplicate_sids="popularity",
                     popularity=str(d / "pop.json")) as rec:
        cat = rec.catalog
        assert cat.num_items == 203 and len(cat) == 200
        for top_n in (BW, 5):
            got = rec.recommend([{"history_items": hist, "top_n": top_n}], progress=False)[0]
            assert [(i.item_id, i.sid, i.score) for i in got.items] == _expanded(ref, groups, top_n)
        for it in got.items:
            assert cat.sid_of(it.item_id) == it.sid  # each answer names its own item
        no_1001 = rec.recommend([{"history_items": hist, "top_n": BW, "exclude_items": [1001]}], progress=False)[0]
        assert [i.item_id for i in no_1001.items] == [i for i, _, _ in _expanded(ref, groups, BW, drop={1001})]
        gone = rec.recommend([{"history_items": hist, "top_n": BW, "exclude_items": groups[cat.sid_of(x)]}],
                             progress=False)[0]
        assert cat.sid_of(x) not in {i.sid for i in gone.items}  # every item of the SID excluded: masked
        only = rec.recommend([{"history_items": hist, "top_n": 3, "include_items": [1000, 1002]}], progress=False)[0]
        assert sorted(only.item_ids) == [1000, 1002]
        same = rec.recommend([{"history_items": [1000], "top_n": BW}, {"history_items": [x], "top_n": BW}],
                             progress=False)
        assert same[0].item_ids == same[1].item_ids  # an extra item's id is its SID in a history
        assert np.allclose([i.score for i in same[0].items], [i.score for i in same[1].items], atol=1e-5)
        cold = rec.recommend([{"history_items": [], "top_n": 4}], progress=False)[0]
        assert cold.source == "popularity" and cold.item_ids[:3] == [1001, x, 1000]


def test_a_duplicate_catalog_converts_without_losing_items(files, tmp_path):
    d, *_ = files
    cat = load_catalog(d / "dup.jsonl", duplicate_sids="popularity")
    from grserve.catalog import save_catalog

    for ext in (".grcat", ".jsonl"):
        save_catalog(cat, tmp_path / f"c{ext}")
        back = load_catalog(tmp_path / f"c{ext}", duplicate_sids="popularity")
        assert sorted(back.all_items()[0].tolist()) == sorted(cat.all_items()[0].tolist())
    assert np.array_equal(back.sids, cat.sids)
