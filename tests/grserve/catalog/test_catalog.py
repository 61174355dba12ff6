"""Tests for grserve.catalog: layout, trie, masks, validation, file formats, synthetic data, store."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.catalog import (Catalog, CatalogError, CatalogStore, PrefixTrie, SidLayout, generate_catalog,
                             load_catalog, save_catalog)


@st.composite
def catalogs(draw):
    depth = draw(st.integers(1, 4))
    sizes = tuple(draw(st.lists(st.integers(1, 6), min_size=depth, max_size=depth)))
    sid = st.tuples(*[st.integers(0, c - 1) for c in sizes])
    sids = draw(st.lists(sid, min_size=1, max_size=60, unique=True))
    ids = draw(st.lists(st.integers(-2**62, 2**62), min_size=len(sids), max_size=len(sids), unique=True))
    return Catalog.from_arrays(np.array(ids), np.array(sids), sizes)


def _reference(cat: Catalog):
    """dict level -> {prefix: set(child codes)}."""
    ref = [dict() for _ in range(cat.depth)]
    for sid in map(tuple, cat.sids.tolist()):
        for level in range(cat.depth):
            ref[level].setdefault(sid[:level], set()).add(sid[level])
    return ref


# --- layout -----------------------------------------------------------------------------------------------

def test_layout_ranges_and_roundtrip():
    lay = SidLayout(3, (256, 128, 64))
    assert lay.level_range(0) == (16, 272) and lay.level_range(1) == (272, 400) and lay.level_range(2) == (400, 464)
    assert lay.num_tokens == 464
    sids = np.array([[0, 0, 0], [255, 127, 63], [3, 1, 4]])
    toks = lay.sids_to_tokens(sids)
    assert toks.dtype == np.int64 and toks.tolist() == [16, 272, 400, 271, 399, 463, 19, 273, 404]
    assert np.array_equal(lay.tokens_to_sids(toks), sids)
    lay.check_vocab(464)
    with pytest.raises(ValueError):
        lay.check_vocab(463)
    with pytest.raises(ValueError, match="whole number"):
        lay.tokens_to_sids(toks[:-1])
    with pytest.raises(ValueError, match="level-1"):
        lay.tokens_to_sids(np.array([16, 16, 400]))
    for bad in [dict(depth=0, codebook_sizes=()), dict(depth=2, codebook_sizes=(4,)),
                dict(depth=1, codebook_sizes=(0,)), dict(depth=1, codebook_sizes=(4,), token_offset=-1)]:
        with pytest.raises(ValueError):
            SidLayout(**bad)


# --- trie -------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(catalogs(), st.integers(0, 2**32 - 1))
def test_trie_matches_reference(cat, seed):
    trie, ref, rng = cat.trie, _reference(cat), np.random.default_rng(seed)
    assert np.array_equal(cat.items_of_leaves(np.arange(len(cat))), cat.item_ids)
    for level in range(cat.depth):
        prefixes = sorted(ref[level])
        assert trie.num_nodes(level) == len(prefixes)
        for node, prefix in enumerate(prefixes):  # node ids are sorted prefix order
            assert trie.lookup(prefix) == node
            assert trie.children(level, node).tolist() == sorted(ref[level][prefix])
        # random steps, including absent codes and -1 nodes
        nodes = rng.integers(-1, len(prefixes), size=40)
        codes = rng.integers(0, cat.codebook_sizes[level], size=40)
        got = trie.step(level, nodes, codes)
        nxt = sorted({p[: level + 1] for p in map(tuple, cat.sids.tolist())})
        for n, c, g in zip(nodes, codes, got):
            want = -1 if n < 0 or c not in ref[level][prefixes[n]] else nxt.index(prefixes[n] + (int(c),))
            assert g == want
        counts = trie.num_children(level, nodes)
        assert counts.tolist() == [0 if n < 0 else len(ref[level][prefixes[n]]) for n in nodes]
    for row, sid in enumerate(map(tuple, cat.sids.tolist())):
        assert trie.lookup(sid) == row and cat.item_of_sid(sid) == cat.item_ids[row]


def test_trie_rejects_unsorted():
    with pytest.raises(ValueError):
        PrefixTrie(np.array([[1, 0], [0, 1]]), (2, 2))
    with pytest.raises(ValueError):
        PrefixTrie(np.array([[0, 1], [0, 1]]), (2, 2))


# --- masks ------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(catalogs(), st.integers(0, 2**32 - 1), st.integers(1, 50))
def test_fill_equals_dense_and_undo_restores(cat, seed, beams):
    rng = np.random.default_rng(seed)
    mask = cat.mask
    assert torch.equal(mask.first_level, mask.dense(0, np.zeros(1, np.int64))[0])
    for level in range(cat.depth):
        nodes = rng.integers(-1, cat.trie.num_nodes(level), size=beams)
        if level == 0:
            nodes = np.where(nodes < 0, -1, 0)
        out = torch.full((beams, cat.codebook_sizes[level]), float("-inf"))
        dense = mask.dense(level, nodes)
        handle = mask.fill(level, nodes, out)
        assert torch.equal(out, dense)
        assert torch.isneginf(out[torch.from_numpy(nodes < 0)]).all()
        for row in range(beams):  # dense itself against the reference
            want = set() if nodes[row] < 0 else set(cat.trie.children(level, nodes[row]).tolist())
            assert set(torch.nonzero(dense[row] == 0).flatten().tolist()) == want
        mask.undo(handle, out)
        assert torch.isneginf(out).all()
        # non-contiguous buffer takes the other path
        big = torch.full((cat.codebook_sizes[level], beams), float("-inf"))
        handle = mask.fill(level, nodes, big.t())
        assert torch.equal(big.t(), dense)
        mask.undo(handle, big.t())
        assert torch.isneginf(big).all()


def test_first_level_mask():
    cat = Catalog.from_arrays([1, 2, 3], [[0, 1], [2, 0], [2, 1]], (4, 2))
    assert cat.mask.first_level.tolist() == [0.0, float("-inf"), 0.0, float("-inf")]


# --- catalog lookups -------------------------------------------------------------------------------------

def test_catalog_lookups():
    cat = Catalog.from_arrays([30, 10, 20], [[2, 0, 1], [0, 1, 1], [0, 1, 0]], (4, 4, 4))
    assert cat.item_ids.tolist() == [20, 10, 30] and cat.sids.dtype == np.int32
    assert cat.sids.tolist() == [[0, 1, 0], [0, 1, 1], [2, 0, 1]] and len(cat) == 3 and cat.depth == 3
    assert cat.sid_of(30) == (2, 0, 1) and cat.item_of_sid((0, 1, 1)) == 10
    assert cat.sids_of_items([10, 30]).tolist() == [[0, 1, 1], [2, 0, 1]]
    with pytest.raises(KeyError):
        cat.sid_of(99)
    with pytest.raises(KeyError):
        cat.item_of_sid((3, 3, 3))
    with pytest.raises(KeyError, match=r"\[99, 98\]"):
        cat.sids_of_items([10, 99, 98])
    assert cat.contains_sids([[2, 0, 1], [2, 0, 0], [0, 1, 0], [3, 3, 3]]).tolist() == [True, False, True, False]
    assert cat.codebook_sizes == (4, 4, 4) and cat.layout == SidLayout(3, (4, 4, 4))


# --- validation and files --------------------------------------------------------------------------------

def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


JSONL_CASES = [
    # (lines, expected message fragment)
    (['{"item_id": 1, "sid": [3, 1, 4]}', '', '{"item_id": 2, "sid": [3, 1, 4]}'],
     "line 3: duplicate SID (3, 1, 4) of item 2 (also item 1 on line 1;"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '{"item_id": 1, "sid": [3, 1, 5]}'], "line 2: duplicate item_id 1"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '{"item_id": 2, "sid": [3, 1, 300]}'], "line 2: code 300"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '{"item_id": 2, "sid": [3, -1, 4]}'], "line 2: code -1"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '', '{"item_id": 2, "sid": [3, 1]}'], "line 3: SID (3, 1) has depth 2"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '{"item_id": 2, "sid": [3, 1, 5]'], "line 2: bad JSON"),
    (['{"item_id": 1, "sid": [3, 1, 4]}', '{"item_id": 2}'], "line 2: expected an object"),
    (['{"item_id": 1, "sid": [3, 1, "x"]}'], "line 1: expected an integer"),
]


@pytest.mark.parametrize("lines,fragment", JSONL_CASES)
def test_jsonl_errors_name_line(tmp_path, lines, fragment):
    p = _write(tmp_path, "c.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(CatalogError) as e:
        load_catalog(p, codebook_sizes=(256, 256, 256))
    assert fragment in str(e.value) and "c.jsonl" in str(e.value)


CSV_CASES = [
    ("item_id,sid\n1,3-1-4\n2,3-1-4\n", "line 3: duplicate SID (3, 1, 4) of item 2 (also item 1 on line 2;"),
    ("item_id,sid\n1,3-1-4\n\n1,3-1-5\n", "line 4: duplicate item_id 1 (also on line 2)"),
    ("item_id,c1,c2,c3\n1,3,1,4\n2,3,999,4\n", "line 3: code 999 at level 1"),
    ("item_id,c1,c2,c3\n1,3,1,4\n2,3,1\n", "line 3: SID (3, 1) has depth 2"),
    ("item_id,sid\n1,3-1-4\n2,3-1\n", "line 3: SID (3, 1) has depth 2"),
    ("item_id,sid\n1,3-1-4\n2,3-x-4\n", "line 3: bad integer"),
    ("id,sid\n1,3-1-4\n", "line 1: header"),
]


@pytest.mark.parametrize("text,fragment", CSV_CASES)
def test_csv_errors_name_line(tmp_path, text, fragment):
    p = _write(tmp_path, "c.csv", text)
    with pytest.raises(CatalogError) as e:
        load_catalog(p, codebook_sizes=(256, 256, 256))
    assert fragment in str(e.value)


def test_from_arrays_errors():
    with pytest.raises(CatalogError, match="line 2: duplicate item_id 5"):
        Catalog.from_arrays([5, 5], [[0, 0], [0, 1]])
    with pytest.raises(CatalogError, match="line 9: duplicate SID"):
        Catalog.from_arrays([1, 2], [[0, 1], [0, 1]], lines=[4, 9])
    with pytest.raises(CatalogError, match="empty"):
        Catalog.from_arrays([], np.zeros((0, 3), np.int64))
    with pytest.raises(CatalogError, match="levels"):
        Catalog.from_arrays([1], [[0, 1]], (4, 4, 4))


def test_text_formats_and_inferred_sizes(tmp_path):
    jl = _write(tmp_path, "a.jsonl", '{"item_id": 7, "sid": [2, 0, 5]}\n\n{"item_id": -3, "sid": [0, 4, 1]}\n')
    cv = _write(tmp_path, "a.csv", "item_id,c1,c2,c3\n7,2,0,5\n-3,0,4,1\n")
    for p in (jl, cv):
        cat = load_catalog(p)
        assert cat.codebook_sizes == (3, 5, 6) and cat.item_ids.tolist() == [-3, 7]
    cat = generate_catalog(300, seed=3)
    for name in ("r.jsonl", "r.csv"):
        save_catalog(cat, tmp_path / name)
        back = load_catalog(tmp_path / name, codebook_sizes=cat.codebook_sizes, token_offset=16)
        assert np.array_equal(back.sids, cat.sids) and np.array_equal(back.item_ids, cat.item_ids)


def test_binary_roundtrip(tmp_path):
    cat = generate_catalog(5000, seed=1, token_offset=20)
    save_catalog(cat, tmp_path / "c.grcat")
    back = load_catalog(tmp_path / "c.grcat", token_offset=20)
    assert np.array_equal(back.sids, cat.sids) and np.array_equal(back.item_ids, cat.item_ids)
    assert back.sids.dtype == np.int32 and back.item_ids.dtype == np.int64 and back.layout == cat.layout


def test_binary_rejects_bad_files(tmp_path):
    cat = generate_catalog(100, seed=2)
    good = tmp_path / "g.grcat"
    save_catalog(cat, good)
    data = good.read_bytes()
    cases = {"bad magic": b"GRCAT9" + data[6:], "too short": b"GRC", "truncated header": data[:14],
             "size": data[:-3], "size2": data + b"\0", "bad header": data[:10] + b"#" + data[11:],
             "garbage": bytes(range(256)) * 4}
    for name, blob in cases.items():
        p = tmp_path / "x.grcat"
        p.write_bytes(blob)
        with pytest.raises(CatalogError):
            load_catalog(p)
    with pytest.raises(CatalogError, match="differ"):
        load_catalog(good, codebook_sizes=(8, 8, 8))
    with pytest.raises(CatalogError, match="extension"):
        load_catalog(tmp_path / "c.txt")


# --- synthetic --------------------------------------------------------------------------------------------

def test_generate_catalog_shape():
    a, b = generate_catalog(20000, seed=0), generate_catalog(20000, seed=0)
    assert np.array_equal(a.sids, b.sids) and np.array_equal(a.item_ids, b.item_ids)
    assert not np.array_equal(generate_catalog(20000, seed=1).sids, a.sids)
    assert len(a) == 20000 and len(np.unique(a.sids, axis=0)) == 20000
    assert sorted(a.item_ids.tolist()) == list(range(20000))
    assert 150 <= a.trie.num_nodes(1) <= 256  # level-1 distinct codes in the hundreds
    assert len(a) / a.trie.num_nodes(2) < 4  # few valid c3 per (c1, c2)
    c1_counts = np.bincount(a.sids[:, 0], minlength=256)
    assert c1_counts.max() > 4 * np.median(c1_counts)  # skewed
    small = generate_catalog(64, depth=2, codebook_size=8, seed=5)
    assert len(small) == 64 and small.depth == 2
    with pytest.raises(ValueError):
        generate_catalog(65, depth=2, codebook_size=8)


# --- store ------------------------------------------------------------------------------------------------

def test_store_replace_and_snapshots(tmp_path):
    store = CatalogStore(vocab_size=16 + 3 * 256)
    with pytest.raises(RuntimeError):
        store.current()
    old = generate_catalog(1000, seed=0)
    assert store.replace(old) == 1 and store.current() is old and old.version == 1
    snap = store.current()
    new = generate_catalog(2000, seed=1)
    assert store.replace(new) == 2 and store.current() is new and new.version == 2
    # the old snapshot is untouched and fully usable
    assert snap.version == 1 and len(snap) == 1000
    out = torch.full((4, 256), float("-inf"))
    h = snap.mask.fill(1, np.array([0, 1, -1, 2]), out)
    snap.mask.undo(h, out)
    assert snap.sid_of(int(snap.item_ids[0])) == tuple(snap.sids[0].tolist())
    with pytest.raises(ValueError):
        store.replace(generate_catalog(100, seed=0, token_offset=17))
    assert store.version == 2 and store.current() is new
    save_catalog(new, tmp_path / "n.grcat")
    assert store.load(tmp_path / "n.grcat") == 3 and len(store.current()) == 2000
    # a restarted cluster instance catches up to the front end's version; it never goes back
    assert store.replace(old, version=7) == 7 and old.version == 7 and store.replace(new) == 8
    with pytest.raises(ValueError, match="not newer"):
        store.replace(old, version=8)
    assert store.version == 8 and store.current() is new


# --- declared layouts (codebook sizes / token offset carried by the file) ---------------------------------

def test_text_formats_declare_their_layout(tmp_path):
    """A file that declares its codebook sizes loads with them even when its codes do not reach the top of each
    codebook (inference would shrink the layout and shift every SID token of the later levels)."""
    jl = _write(tmp_path, "d.jsonl", '{"codebook_sizes": [8, 8, 8], "token_offset": 16}\n'
                                     '{"item_id": 7, "sid": [2, 0, 5]}\n{"item_id": -3, "sid": [0, 4, 1]}\n')
    cv = _write(tmp_path, "d.csv", "# written by a tool\n# codebook_sizes=8,8,8\n# token_offset=16\n"
                                   "item_id,c1,c2,c3\n7,2,0,5\n-3,0,4,1\n")
    for p in (jl, cv):
        cat = load_catalog(p)
        assert cat.codebook_sizes == (8, 8, 8) and cat.layout.token_offset == 16
        assert load_catalog(p, token_offset=16).layout == cat.layout  # agreeing caller values are fine
        with pytest.raises(CatalogError, match="differ"):
            load_catalog(p, codebook_sizes=(3, 5, 6))
        with pytest.raises(CatalogError, match="token_offset 16 differs"):
            load_catalog(p, token_offset=20)
    bad = _write(tmp_path, "e.csv", "# codebook_sizes=8,8,8\nitem_id,sid\n1,0-0-0\n2,0-9-0\n")
    with pytest.raises(CatalogError, match="line 4: code 9 at level 1"):  # line numbers count the comments
        load_catalog(bad)
    with pytest.raises(CatalogError, match="line 1"):
        load_catalog(_write(tmp_path, "f.jsonl", '{"codebook_sizes": "8,8"}\n{"item_id": 1, "sid": [0]}\n'))
    with pytest.raises(CatalogError, match="levels"):
        load_catalog(_write(tmp_path, "g.jsonl", '{"codebook_sizes": [8, 8]}\n{"item_id": 1, "sid": [0, 0, 0]}\n'))


@pytest.mark.parametrize("name", ["s.jsonl", "s.csv", "s.grcat"])
def test_save_declares_layout_so_a_roundtrip_keeps_it(tmp_path, name):
    cat = Catalog.from_arrays([1, 2], [[0, 1], [2, 0]], (16, 16), token_offset=20)  # codes far below 16
    save_catalog(cat, tmp_path / name)
    back = load_catalog(tmp_path / name)
    assert back.layout == cat.layout and np.array_equal(back.sids, cat.sids)
