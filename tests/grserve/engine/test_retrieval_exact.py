"""End-to-end exactness of GR retrieval on the tiny model: exhaustive scoring, HF generate, naive per-beam KV."""


import numpy as np
import pytest
import torch

from grserve.attention.context import SequenceKVContext
from grserve.catalog import Catalog, CatalogStore, generate_catalog
from grserve.config import SchedulerConfig, SearchConfig
from grserve.engine.retrieval_engine import RetrievalEngine
from grserve.engine.retrieval import RetrievalRunner
from grserve.engine.types import RetrievalRequest
from grserve.search.beam_search import BeamSearch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from gr_fixtures import grid_catalog


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=3)


@pytest.fixture(scope="module")
def small_catalog():
    # depth 3, 4 codes per level: at most 4 / 16 / 64 prefixes, 40 items
    return grid_catalog(40, seed=0, first_id=100)


def prompt(n, seed=0, vocab=2000):
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int64)


@torch.inference_mode()
def exhaustive_scores(model, catalog, prompt_tokens, scoring="renormalized"):
    """Score every catalog item: Σ_levels masked log-softmax of its SID tokens, one prefix at a time."""
    out = {}
    layout, trie = catalog.layout, catalog.trie
    for item, sid in zip(catalog.item_ids, catalog.sids):
        ctx = SequenceKVContext(model.spec.num_hidden_layers)
        ids = torch.from_numpy(prompt_tokens)
        h = model(ids, torch.arange(len(ids)), ctx)[-1:]
        total, node = 0.0, 0
        for level, code in enumerate(sid):
            a, b = layout.level_range(level)
            logits = model.logits(h).double()[0]
            valid = trie.children(level, node) + a
            if scoring == "renormalized":
                lp = logits[valid] - torch.logsumexp(logits[valid], 0)
            else:
                lp = (logits - torch.logsumexp(logits, 0))[valid]
            total += float(lp[list(valid).index(a + code)])
            node = int(trie.step(level, np.array([node]), np.array([code]))[0])
            if level + 1 < catalog.depth:
                pos = torch.tensor([len(ids) + level])
                h = model(torch.tensor([a + int(code)]), pos, ctx)
        out[int(item)] = total
    return out


@pytest.mark.parametrize("scoring", ["renormalized", "hf"])
def test_wide_beam_equals_exhaustive_scoring(model, small_catalog, scoring):
    runner = RetrievalRunner(model, SearchConfig(scoring=scoring))
    p = prompt(23)
    out = runner.run([p], 64, [40], small_catalog)
    ref = exhaustive_scores(model, small_catalog, p, scoring)
    ranked = sorted(ref.items(), key=lambda kv: -kv[1])
    got = [(h.item_id, h.score) for h in out.hits[0]]
    assert [i for i, _ in got] == [i for i, _ in ranked]
    assert max(abs(s - ref[i]) for i, s in got) <= 1e-4


def test_renormalized_scores_dominate_hf_scores(model, small_catalog):
    """Masking before the softmax can only raise a valid token's log-prob (mass moves onto valid tokens)."""
    p = prompt(17, seed=1)
    ren = exhaustive_scores(model, small_catalog, p, "renormalized")
    hf = exhaustive_scores(model, small_catalog, p, "hf")
    assert all(ren[i] > hf[i] for i in ren)


@pytest.mark.parametrize("bw", [4, 8])
def test_beams_equal_hf_generate(model, bw):
    pytest.importorskip("transformers")
    from grserve_bench.baselines import HFConstrainedBeamSearch

    catalog = generate_catalog(600, 3, 16, seed=2)
    hf = HFConstrainedBeamSearch(model)
    runner = RetrievalRunner(model, SearchConfig(scoring="hf"))
    for seed in range(3):
        p = prompt(31, seed=seed)
        ours = runner.run([p], bw, [bw], catalog).hits[0]
        theirs = hf.run(p, bw, bw, catalog)
        assert [h.item_id for h in ours] == [h.item_id for h in theirs]
        assert max(abs(a.score - b.score) for a, b in zip(ours, theirs)) <= 1e-4


def test_separated_kv_equals_private_copy_per_beam(model):
    from grserve_bench.baselines import NaiveCopyBeamSearch

    catalog = generate_catalog(2000, 3, 32, seed=1)
    p = prompt(45, seed=4)
    ours = RetrievalRunner(model, SearchConfig()).run([p], 16, [16], catalog).hits[0]
    naive, _ = NaiveCopyBeamSearch(model).run(p, 16, 16, catalog)
    assert [h.item_id for h in ours] == [h.item_id for h in naive]
    assert max(abs(a.score - b.score) for a, b in zip(ours, naive)) <= 1e-4


def test_batch_of_mixed_lengths_equals_each_alone(model):
    catalog = generate_catalog(2000, 3, 32, seed=1)
    runner = RetrievalRunner(model, SearchConfig())
    prompts = [prompt(n, seed=n) for n in (5, 40, 17, 1)]
    batch = runner.run(prompts, 8, [8] * 4, catalog).hits
    for p, got in zip(prompts, batch):
        alone = runner.run([p], 8, [8], catalog).hits[0]
        assert [h.item_id for h in got] == [h.item_id for h in alone]
        assert max(abs(a.score - b.score) for a, b in zip(got, alone)) <= 1e-4


def test_fewer_valid_items_than_beam_width_returns_fewer_never_invalid(model):
    catalog = Catalog.from_arrays(np.array([7, 8, 9, 10, 11]), np.array([[0, 1, 2], [0, 1, 3], [2, 0, 0], [3, 3, 3], [3, 2, 1]]), codebook_sizes=(4, 4, 4))
    out = RetrievalRunner(model, SearchConfig()).run([prompt(9)], 16, [16], catalog)
    hits = out.hits[0]
    assert sorted(h.item_id for h in hits) == [7, 8, 9, 10, 11]
    assert all(np.isfinite(h.score) for h in hits)


def test_every_returned_item_is_in_the_catalog(model):
    catalog = generate_catalog(5000, 3, 64, seed=5)
    out = RetrievalRunner(model, SearchConfig()).run([prompt(30, s) for s in range(3)], 32, [32] * 3, catalog)
    for hits in out.hits:
        assert len(hits) == 32
        sids = np.array([h.sid for h in hits])
        assert catalog.contains_sids(sids).all()
        assert [catalog.item_of_sid(h.sid) for h in hits] == [h.item_id for h in hits]
        assert all(a.score >= b.score for a, b in zip(hits, hits[1:]))


def test_heap_and_vectorised_top_bw_give_the_same_beams(model):
    catalog = generate_catalog(3000, 3, 32, seed=6)
    p = [prompt(25, 9)]
    a = RetrievalRunner(model, SearchConfig(topbw="heap")).run(p, 16, [16], catalog)
    b = RetrievalRunner(model, SearchConfig(topbw="vectorized")).run(p, 16, [16], catalog)
    assert [h.item_id for h in a.hits[0]] == [h.item_id for h in b.hits[0]]
    assert a.candidates_visited >= b.candidates_visited  # the heap pays for its rising threshold


def test_kv_bytes_equal_formula(model):
    catalog = generate_catalog(1000, 3, 32)
    out = RetrievalRunner(model, SearchConfig()).run([prompt(50), prompt(70)], 16, [4, 4], catalog)
    spec = model.spec
    b_tok = 2 * spec.num_hidden_layers * spec.num_key_value_heads * spec.head_dim * 4
    assert out.kv_bytes_per_request == [(50 + 16 * 3) * b_tok, (70 + 16 * 3) * b_tok]
    assert out.kv_bytes_per_request == out.kv_bytes_formula


class FreshStorage(TorchDispatchMode):
    """Records every aten op whose output tensor lives in storage that none of its inputs (or out=) own."""

    def __init__(self):
        super().__init__()
        self.fresh = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in known:
                self.fresh.append(str(func))
        return out


def run_beam_step(step_fn):
    """(ops that made fresh storage, positive allocations the profiler saw) during ``step_fn``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with FreshStorage() as mode:
            step_fn()
    return mode.fresh, [e for e in prof.events() if e.name == "[memory]" and e.cpu_memory_usage > 0]


def test_beam_step_allocates_nothing_after_warm_up(model):
    """The beam step (masked log-softmax, top-K, top-BW, reorders, mask write/undo) reuses its buffers."""
    catalog = generate_catalog(3000, 3, 32, seed=7)
    with torch.inference_mode():
        beams = BeamSearch(catalog, 2, 16)
        g = torch.Generator().manual_seed(0)
        beams.logits[0].copy_(torch.randn(beams.logits[0].shape, generator=g))
        beams.select_first()
        bufs = lambda: [t.data_ptr() for t in (beams.codes, beams.scores, beams.parents, beams.logits[2], beams.masks[2])]
        ptrs = bufs()
        for level in (1, 2):  # level 1 warms up, level 2 is measured
            beams.logits[level].copy_(torch.randn(beams.logits[level].shape, generator=g))
            fresh, allocs = run_beam_step(lambda: (beams.prepare_mask(level), beams.select(level)))
        assert fresh == [] and allocs == []
        assert ptrs == bufs()
        assert torch.isneginf(beams.masks[2]).all()  # mask buffer back to its base state after undo


def test_allocation_detectors_can_fail():
    """Guard for the test above: a step that allocates is caught."""
    x = torch.zeros(1024)
    fresh, allocs = run_beam_step(lambda: x + 1)
    assert fresh == ["aten.add.Tensor"]
    fresh, allocs = run_beam_step(lambda: x.add_(1))  # a Python-scalar operand: the profiler sees its wrapper
    assert fresh == [] and allocs


def test_mask_building_overlaps_the_forward(model):
    catalog = generate_catalog(5000, 3, 64)
    runner = RetrievalRunner(model, SearchConfig(overlap_masks=True))
    out = runner.run([prompt(200)], 64, [8], catalog, trace=True)
    ev = {name: (a, b) for name, a, b in out.trace}
    for level in (1, 2):
        m0, m1 = ev[f"mask{level}"]
        f0, f1 = ev[f"forward{level}"]
        assert m0 < f1 and m1 > f0  # the two intervals intersect
    runner.close()


def test_engine_serves_through_catalog_replacement(model):
    cat_a = generate_catalog(3000, 3, 32, seed=10)
    cat_b = generate_catalog(2000, 3, 32, seed=11)
    store = CatalogStore(cat_a, vocab_size=model.spec.vocab_size)
    engine = RetrievalEngine(model, store, SearchConfig(), SchedulerConfig(max_inflight_batches=2)).start()
    try:
        futs = [engine.submit(RetrievalRequest(prompt(60, s), 16, 8)).future for s in range(6)]
        store.replace(cat_b)
        futs += [engine.submit(RetrievalRequest(prompt(60, s), 16, 8)).future for s in range(6, 9)]
        results = [f.result(timeout=120) for f in futs]
    finally:
        engine.stop()
    cats = {cat_a.version: cat_a, cat_b.version: cat_b}
    for r in results:
        cat = cats[r.catalog_version]
        assert len(r.items) == 8
        assert cat.contains_sids(np.array([it.sid for it in r.items])).all()
    assert {r.catalog_version for r in results[-3:]} == {cat_b.version}


def test_more_than_one_batch_in_flight(model):
    catalog = generate_catalog(3000, 3, 32, seed=12)
    engine = RetrievalEngine(model, CatalogStore(catalog), SearchConfig(), SchedulerConfig(max_inflight_batches=2)).start()
    try:
        # two beam widths cannot share a batch: both batches are dispatched to the two idle slots
        futs = [engine.submit(RetrievalRequest(prompt(400, s), bw, 4)).future for s, bw in enumerate([64, 32, 64, 32])]
        results = [f.result(timeout=120) for f in futs]
    finally:
        engine.stop()
    assert engine.peak_inflight == 2
    assert all(len(r.items) == 4 for r in results)
