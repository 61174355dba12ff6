"""Tokenizer-native SID layouts: formats, resolution against the model's tokenizer, inference from added tokens, and
beam search over arbitrary per-level token-id sets (= HF generate with the catalog trie in token space)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from grserve.catalog import CatalogError, SidLayout, load_catalog, save_catalog
from grserve.catalog.sid_text import SidText, SidTokenError, bind_catalog, infer_sid_text, resolve_layout
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.retrieval import RetrievalRunner
from grserve.search.level_heads import LevelHeads


def _catalog_of(d, tokenizer=None):
    from grserve.engine.tokenizer import HFTokenizer

    cat, note = bind_catalog(load_catalog(d.catalog), tokenizer or HFTokenizer(d.path))
    return cat, note


# ---- the layout ------------------------------------------------------------------------------------------------
def test_tokenizer_layout_maps_codes_to_arbitrary_ids_and_back():
    tables = (np.array([40, 7, 13]), np.array([5, 6, 7, 8]), np.array([90, -1, 91]))
    lay = SidLayout(3, (3, 4, 3), level_tokens=tables, sid_begin=2, sid_end=3)
    assert not lay.is_arithmetic
    assert isinstance(lay.head_rows(0), np.ndarray) and lay.head_rows(0).tolist() == [40, 7, 13]
    assert lay.head_rows(1) == (5, 9)  # contiguous ascending ids: a slice of the LM head
    assert lay.head_rows(2).tolist() == [90, 90, 91]  # a code without a token gathers a valid row (masked anyway)
    sids = np.array([[0, 3, 2], [2, 0, 0]])
    toks = lay.sids_to_tokens(sids)
    assert toks.tolist() == [40, 8, 91, 13, 5, 90]
    assert np.array_equal(lay.tokens_to_sids(toks), sids)
    assert lay.items_to_tokens(sids).tolist() == [2, 40, 8, 91, 3, 2, 13, 5, 90, 3]
    with pytest.raises(ValueError, match="level-1"):
        lay.tokens_to_sids(np.array([40, 40, 91]))
    with pytest.raises(ValueError, match="no token"):
        lay.sids_to_tokens(np.array([[0, 0, 1]]))
    assert lay.num_tokens == 92
    lay.check_vocab(92)
    with pytest.raises(ValueError, match="largest token id is 91"):
        lay.check_vocab(91)
    with pytest.raises(ValueError, match="not a contiguous"):
        lay.level_range(0)
    same = SidLayout(3, (3, 4, 3), level_tokens=tuple(t.copy() for t in tables), sid_begin=2, sid_end=3)
    assert lay == same and lay != SidLayout(3, (3, 4, 3))
    for bad in [(np.array([1, 2]),) * 3, (np.array([1, 2, -2]), tables[1], tables[2]),
                (np.array([-1, -1, -1]), tables[1], tables[2])]:
        with pytest.raises(ValueError):
            SidLayout(3, (3, 4, 3), level_tokens=bad)


def test_level_heads_slice_for_contiguous_gather_otherwise(tiny_model):
    model = tiny_model(seed=0)
    lay = SidLayout(2, (4, 3), level_tokens=(np.array([100, 7, 55, 9]), np.array([20, 21, 22])))
    heads = LevelHeads(lay, "cpu")
    assert isinstance(heads.rows[0], torch.Tensor) and heads.rows[1] == (20, 23)
    h = torch.randn(5, model.spec.hidden_size)
    full = model.logits(h)
    torch.testing.assert_close(model.logits(h, heads.rows[0]), full[:, [100, 7, 55, 9]])
    torch.testing.assert_close(model.logits(h, heads.rows[1]), full[:, 20:23])
    out = torch.empty(4, dtype=torch.int64)
    assert heads.to_tokens(0, torch.tensor([3, 0, 2, 1]), out).tolist() == [9, 100, 55, 7]
    assert heads.to_tokens(1, torch.tensor([2, 0, 1, 1]), out).tolist() == [22, 20, 21, 21]


# ---- formats ---------------------------------------------------------------------------------------------------
def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_jsonl_sid_tokens_become_codes_with_the_templates_they_follow(tmp_path):
    rows = [{"item_id": 7, "sid_tokens": ["<a_47>", "<b_3>", "x"]}, {"item_id": 8, "sid_tokens": ["<a_2>", "<b_3>", "y"]}]
    p = _write(tmp_path, "c.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    cat = load_catalog(p)
    assert cat.text.templates == ("<a_{}>", "<b_{}>", None) and cat.text.vocab[2] == ("x", "y")
    assert cat.sid_of(7) == (47, 3, 0) and cat.sid_of(8) == (2, 3, 1)
    assert cat.codebook_sizes == (48, 4, 2) and cat.declared
    assert cat.text.item_text(cat.sid_of(7)) == "<a_47><b_3>x"


def test_lcrec_index_json_loads_as_is(tmp_path):
    index = {"0": ["<a_1>", "<b_5>", "<c_0>"], "3": ["<a_1>", "<b_2>", "<c_9>"], "12": ["<a_0>", "<b_5>", "<c_0>"]}
    p = _write(tmp_path, "Beauty.index.json", json.dumps(index))
    cat = load_catalog(p)
    assert len(cat) == 3 and cat.sid_of(3) == (1, 2, 9) and cat.text.templates == ("<a_{}>", "<b_{}>", "<c_{}>")
    for name in ("back.jsonl", "back.grcat", "back.json"):  # the SID text survives every format that carries it
        save_catalog(cat, tmp_path / name)
        back = load_catalog(tmp_path / name)
        assert back.text == cat.text and np.array_equal(back.sids, cat.sids) and back.layout == cat.layout
    with pytest.raises(CatalogError, match="cannot carry"):
        save_catalog(cat, tmp_path / "x.csv")


def test_header_templates_with_codes(tmp_path):
    head = {"codebook_sizes": [8, 8], "sid_token_templates": ["<s_a_{}>", "<s_b_{}>"], "sid_begin": "<|sid_begin|>",
            "sid_end": "<|sid_end|>"}
    p = _write(tmp_path, "c.jsonl", json.dumps(head) + '\n{"item_id": 1, "sid": [3, 4]}\n')
    cat = load_catalog(p)
    assert cat.text == SidText.from_templates(["<s_a_{}>", "<s_b_{}>"], "<|sid_begin|>", "<|sid_end|>")
    assert cat.text.item_text((3, 4)) == "<|sid_begin|><s_a_3><s_b_4><|sid_end|>"
    save_catalog(cat, tmp_path / "c.grcat")
    assert load_catalog(tmp_path / "c.grcat").text == cat.text


@pytest.mark.parametrize("name,text,fragment", [
    ("c.jsonl", '{"item_id": 1, "sid": [1, 2]}\n{"item_id": 2, "sid_tokens": ["<a_1>", "<b_2>"]}\n',
     "line 2: items give 'sid' and 'sid_tokens'"),
    ("c.jsonl", '{"item_id": 1, "sid_tokens": ["<a_1>", 5]}\n', "line 1: 'sid_tokens' must be a list"),
    ("c.jsonl", '{"item_id": 1, "sid_tokens": ["<a_1>"], "sid": [1]}\n', "either 'sid' or 'sid_tokens'"),
    ("c.jsonl", '{"sid_token_templates": ["<a_>"]}\n{"item_id": 1, "sid": [1]}\n', "exactly one '{}'"),
    ("c.jsonl", '{"sid_token_templates": ["<a_{}>"]}\n{"item_id": 1, "sid": [1, 2]}\n', "depth 2"),
    ("c.jsonl", '{"sid_begin": "<b>"}\n{"item_id": 1, "sid": [1, 2]}\n', "need 'sid_token_templates'"),
    ("c.json", '{"x": ["<a_1>"]}', "entry 1: the key is not an integer item id"),
    ("c.json", '{"1": ["<a_1>", "<b_1>"], "2": ["<a_2>"]}', "entry 2: the SID in sid_tokens has depth 1"),
    ("c.json", '["<a_1>"]', "expected an object mapping item ids"),
    ("c.json", '{"1": ["<a_1>"], "2": ["<a_1>"]}', "duplicate SID"),
])
def test_sid_text_format_errors_name_the_place(tmp_path, name, text, fragment):
    with pytest.raises(CatalogError) as e:
        load_catalog(_write(tmp_path, name, text))
    assert fragment in str(e.value) and name in str(e.value)


# ---- resolution and inference against real tokenizers -----------------------------------------------------------
def test_onerec_catalog_resolves_to_contiguous_levels(onerec_dir):
    from grserve.engine.tokenizer import HFTokenizer

    tok = HFTokenizer(onerec_dir.path)
    cat, note = _catalog_of(onerec_dir, tok)
    assert note is None and not cat.layout.is_arithmetic
    assert all(isinstance(cat.layout.head_rows(level), tuple) for level in range(3))  # added level after level
    for i in (0, 17, 199):
        sid = cat.sid_of(i)
        assert cat.layout.sids_to_tokens(np.array([sid])).tolist() == tok.encode("".join(onerec_dir.strings[i]),
                                                                                 add_special_tokens=False)
    wrapped = tok.encode(cat.text.item_text(cat.sid_of(5)), add_special_tokens=False)
    assert cat.layout.items_to_tokens(np.array([cat.sid_of(5)])).tolist() == wrapped
    assert [cat.layout.sid_begin, cat.layout.sid_end] == tok.encode("<|sid_begin|><|sid_end|>",
                                                                    add_special_tokens=False)


def test_minionerec_index_resolves_to_gathered_unordered_ids(minionerec_dir):
    from grserve.engine.tokenizer import HFTokenizer

    tok = HFTokenizer(minionerec_dir.path)
    cat, _ = _catalog_of(minionerec_dir, tok)
    rows = [cat.layout.head_rows(level) for level in range(3)]
    assert all(isinstance(r, np.ndarray) for r in rows)
    assert any((np.diff(r) < 0).any() for r in rows)  # not even ordered
    for i in (0, 99, 150):
        assert cat.layout.sids_to_tokens(np.array([cat.sid_of(i)])).tolist() == \
            tok.encode("".join(minionerec_dir.strings[i]), add_special_tokens=False)


def test_a_string_that_is_not_one_token_is_named(tmp_path, minionerec_dir):
    from grserve.engine.tokenizer import HFTokenizer

    tok = HFTokenizer(minionerec_dir.path)
    index = {str(i): row for i, row in enumerate(minionerec_dir.strings[:20])}
    index["20"] = [minionerec_dir.strings[20][0], "<b_999>", minionerec_dir.strings[20][2]]
    p = _write(tmp_path, "bad.index.json", json.dumps(index))
    with pytest.raises(SidTokenError) as e:
        bind_catalog(load_catalog(p), tok)
    assert "'<b_999>'" in str(e.value) and "level-1" in str(e.value) and "bad.index.json" in str(e.value)
    head = {"sid_token_templates": ["<a_{}>", "no such token {}", "<c_{}>"]}
    p = _write(tmp_path, "bad.jsonl", json.dumps(head) + '\n{"item_id": 1, "sid": [0, 0, 0]}\n')
    with pytest.raises(SidTokenError, match="'no such token 0'"):
        bind_catalog(load_catalog(p), tok)
    with pytest.raises(CatalogError, match="no tokenizer files"):
        bind_catalog(load_catalog(minionerec_dir.catalog), None)


def test_two_codes_on_one_token_are_refused():
    class Normalising:  # a tokenizer that maps both spellings to one token
        def encode_each(self, texts):
            return [[5] for _ in texts]

    text = SidText((None,), (("<a_1>", "<A_1>"),))
    with pytest.raises(CatalogError, match="level-0 codes 0 and 1 are written as the same token"):
        resolve_layout(text, (2,), [np.array([0, 1])], Normalising(), "src")


def test_layout_inferred_from_added_tokens_when_the_catalog_declares_none(tmp_path, onerec_dir, minionerec_dir):
    from grserve.engine.tokenizer import HFTokenizer

    for d, begin in ((onerec_dir, True), (minionerec_dir, False)):
        p = tmp_path / f"{d.path.name}.jsonl"
        p.write_text("".join(json.dumps({"item_id": i, "sid": [int(c) for c in s]}) + "\n"
                             for i, s in enumerate(d.sids)))
        tok = HFTokenizer(d.path)
        cat, note = bind_catalog(load_catalog(p), tok)
        assert note is not None and "inferred" in note and not cat.layout.is_arithmetic
        assert (cat.layout.sid_begin is not None) == begin
        for i in (3, 42):
            assert cat.layout.sids_to_tokens(np.array([cat.sid_of(i)])).tolist() == \
                tok.encode("".join(d.strings[i]), add_special_tokens=False)
        declared = tmp_path / "declared.jsonl"
        save_catalog(load_catalog(p), declared)  # writes token_offset: an arithmetic layout, declared
        bound, note = bind_catalog(load_catalog(declared), tok)
        assert note is None and bound.layout.is_arithmetic


def test_infer_sid_text_patterns():
    onerec = {f"<s_{c}_{n}>": 100 + i for i, (c, n) in enumerate((c, n) for c in "abc" for n in range(8))}
    onerec.update({"<|sid_begin|>": 5, "<|sid_end|>": 6, "<think>": 7, "<a_1>": 8})
    text, sizes = infer_sid_text(onerec)
    assert text.templates == ("<s_a_{}>", "<s_b_{}>", "<s_c_{}>") and sizes == (8, 8, 8)
    assert (text.sid_begin, text.sid_end) == ("<|sid_begin|>", "<|sid_end|>")
    assert infer_sid_text(onerec, depth=2)[0].templates == ("<s_a_{}>", "<s_b_{}>")
    assert infer_sid_text(onerec, depth=4) is None
    assert infer_sid_text({"<a_1>": 1, "<c_1>": 2}) is None  # levels must be consecutive letters from a
    assert infer_sid_text({"<think>": 1, "<|im_end|>": 2}) is None
    lcrec = {"<a_0>": 1, "<a_255>": 2, "<b_3>": 3, "<c_9>": 4, "<d_1>": 5}
    assert infer_sid_text(lcrec) == (SidText.from_templates(["<a_{}>", "<b_{}>", "<c_{}>", "<d_{}>"]),
                                     (256, 4, 10, 2))


# ---- beam search over the tokenizer's ids = HF generate with the trie in token space -----------------------------
@pytest.mark.parametrize("which", ["onerec", "minionerec"])
def test_beams_over_tokenizer_ids_equal_hf_generate(which, onerec_dir, minionerec_dir):
    from grserve_bench.baselines import HFConstrainedBeamSearch
    from grserve.engine.tokenizer import HFTokenizer
    from grserve.model import load_model

    d = onerec_dir if which == "onerec" else minionerec_dir
    tok = HFTokenizer(d.path)
    cat, _ = _catalog_of(d, tok)
    model = load_model(str(d.path))
    hf = HFConstrainedBeamSearch(model)
    runner = RetrievalRunner(model, SearchConfig(scoring="hf"))
    history = [d.strings[i] for i in (3, 8, 21)]
    if which == "onerec":
        text = "".join(cat.text.item_text(cat.sid_of(i)) for i in (3, 8, 21))
        prompt = tok.apply_chat_template([{"role": "user", "content": f"history: {text}. next?"}]) + "<|sid_begin|>"
    else:
        from gr_fixtures import INSTRUCTION

        prompt = INSTRUCTION.format(history=", ".join("".join(h) for h in history))
    ids = np.asarray(tok.encode(prompt, add_special_tokens=False), dtype=np.int64)
    for bw in (4, 16):
        ours = runner.run([ids], bw, [bw], cat).hits[0]
        theirs = hf.run(ids, bw, bw, cat)
        assert [h.item_id for h in ours] == [h.item_id for h in theirs]
        assert max(abs(a.score - b.score) for a, b in zip(ours, theirs)) <= 1e-4
        assert len({h.sid for h in ours}) == len(ours) == bw


def test_device_fast_path_equals_host_search_on_gathered_ids(minionerec_dir):
    from grserve.engine.device_runner import DeviceRetrievalRunner
    from grserve.model import load_model

    cat, _ = _catalog_of(minionerec_dir)
    model = load_model(str(minionerec_dir.path))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.spec.vocab_size, n).astype(np.int64) for n in (9, 30)]
    for scoring in ("renormalized", "hf"):
        ref = RetrievalRunner(model, SearchConfig(scoring=scoring)).run(prompts, 16, [16, 16], cat).hits
        fast = DeviceRetrievalRunner(model, SearchConfig(scoring=scoring), AccelConfig(fast_path="on",
                                                                                     prompt_bucket=16))
        got = fast.run(prompts, 16, [16, 16], cat).hits
        for a, b in zip(ref, got):
            assert [h.item_id for h in a] == [h.item_id for h in b]
            assert max(abs(x.score - y.score) for x, y in zip(a, b)) <= 1e-5


def test_engine_build_binds_the_catalog_to_the_model_tokenizer(minionerec_dir):
    from grserve.config import CatalogConfig, ModelConfig, ServeConfig
    from grserve.engine.retrieval_engine import RetrievalEngine

    cfg = ServeConfig(model=ModelConfig(source=str(minionerec_dir.path)),
                      catalog=CatalogConfig(path=str(minionerec_dir.catalog)))
    engine = RetrievalEngine.build(cfg)
    cat = engine.catalogs.current()
    assert not cat.layout.is_arithmetic and engine.tokenizer is not None
    engine.catalogs.replace(load_catalog(minionerec_dir.catalog))  # a reload is bound the same way
    assert engine.catalogs.current().layout == cat.layout and engine.catalogs.current().version == 2


def test_arithmetic_catalog_is_unchanged_by_binding(tmp_path):
    from grserve.catalog import generate_catalog
    from grserve.engine.tokenizer import HFTokenizer, write_preset_tokenizer

    cat = generate_catalog(500, 3, 16, seed=1)
    preset = HFTokenizer(write_preset_tokenizer(tmp_path / "tok", 400, 512))  # no SID-like added tokens
    for tok in (None, preset):
        bound, note = bind_catalog(cat, tok)
        assert bound is cat and note is None


@pytest.mark.parametrize("layout", ["onerec", "gathered"])
def test_bench_chat_beam_shape_runs_on_cpu_and_agrees_with_hf(capsys, layout):
    """``grserve bench retrieval --suite p2 --sid-layout onerec|gathered``: the device fast path over a tokenizer-native
    layout (the chat-beam shape the GPU run measures), top-1 = HF, no invalid item."""
    from grserve.cli import main

    argv = ["bench", "retrieval", "--suite", "p2", "--p2-model", "tiny", "--p2-dtype", "float32",
            "--p2-prompt-len", "40", "--p2-batch", "2", "--p2-beam-width", "8", "--grid-ctx", "40",
            "--grid-batch", "1", "--grid-bw", "8", "--iters", "1", "--warmup", "0", "--hf-requests", "2",
            "--num-items", "3000", "--codebook-size", "64", "--sid-layout", layout]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["sid_layout"] == layout and out["invalid_item_rate"] == 0.0 and out["hf_top1_agreement"] == 1.0


def test_bench_prompts_write_items_as_a_chat_prompt_would():
    from grserve_bench.workload import bench_layout, history_prompts
    from grserve.catalog import generate_catalog

    cat = bench_layout(generate_catalog(2000, 3, 32, seed=1), "gathered", 1000, seed=2)
    assert not cat.layout.is_arithmetic and cat.layout.sid_begin == 998 and cat.layout.sid_end == 999
    for p in history_prompts(cat, 3, 61, seed=4):
        assert p.size == 61 and p[-1] == 998  # ends where the beams start
        ends = np.flatnonzero(p == 999)
        whole = p[ends[0] + 1:-1].reshape(-1, 5)  # after the first whole item: begin, 3 SID tokens, end
        assert (whole[:, 0] == 998).all() and (whole[:, 4] == 999).all()
        assert cat.contains_sids(cat.layout.tokens_to_sids(whole[:, 1:4].reshape(-1))).all()


def test_catalog_commands_validate_against_a_model_and_convert(minionerec_dir, tmp_path, capsys):
    from grserve.cli import main

    assert main(["catalog", "validate", str(minionerec_dir.catalog), "--model", str(minionerec_dir.path)]) == 0
    out = capsys.readouterr().out
    assert "200 items" in out and "<a_{}>" in out and "gathered" in out
    assert main(["catalog", "convert", str(minionerec_dir.catalog), "--out", str(tmp_path / "items.grcat")]) == 0
    back = load_catalog(tmp_path / "items.grcat")
    assert back.text == load_catalog(minionerec_dir.catalog).text and len(back) == 200
    bad = tmp_path / "bad.index.json"
    bad.write_text(json.dumps({"1": ["<a_1>", "<b_1>", "<zz_1>"]}))
    assert main(["catalog", "validate", str(bad), "--model", str(minionerec_dir.path)]) == 1
    assert "'<zz_1>'" in capsys.readouterr().err
    assert main(["catalog", "convert", str(minionerec_dir.catalog), "--out", str(tmp_path / "x.csv")]) == 2


def test_start_up_prints_the_layout_and_what_it_inferred(onerec_dir, tmp_path, capsys):
    from grserve.config import CatalogConfig, ModelConfig, ServeConfig
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.server.retrieval.command import print_layout

    codes = tmp_path / "codes.jsonl"  # no header: nothing declared
    codes.write_text("".join(json.dumps({"item_id": i, "sid": [int(c) for c in s]}) + "\n"
                             for i, s in enumerate(onerec_dir.sids)))
    engine = RetrievalEngine.build(ServeConfig(model=ModelConfig(source=str(onerec_dir.path)),
                                               catalog=CatalogConfig(path=str(codes))))
    print_layout(engine)
    out = capsys.readouterr().out
    assert "inferred from the tokenizer's added tokens" in out and "<s_a_{}>" in out and "<|sid_begin|>" in out
    assert "SID layout: tokenizer SID tokens" in out
