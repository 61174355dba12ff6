"""Million-item catalogs at test scale: the RecIF-like generator, the compact format, hot reloads under load."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from grserve.catalog import CatalogStore, generate_catalog, load_catalog, save_catalog
from grserve.catalog.recif_like import generate_recif_like


def test_recif_like_catalog_is_unique_skewed_and_deterministic():
    cat = generate_recif_like(60_000, 4, 512, seed=3)
    assert len(cat) == 60_000 and cat.codebook_sizes == (512,) * 4 and cat.depth == 4
    assert np.array_equal(np.sort(cat.item_ids), np.arange(60_000))  # ids 0..N-1, not in SID order
    assert not np.array_equal(cat.item_ids, np.arange(60_000))
    counts = np.bincount(cat.sids[:, 0], minlength=512)
    assert (counts > 0).sum() > 400  # most first-level codes are used...
    assert counts.max() > 20 * len(cat) / 512  # ...with skewed popularity (Zipf: the top code ~7 %)
    leaf_parents = np.unique(cat.sids[:, :3], axis=0).shape[0]
    assert leaf_parents < len(cat)  # some leaf parents hold several items (distinct last codes: from_arrays checks)
    again = generate_recif_like(60_000, 4, 512, seed=3)
    assert np.array_equal(again.sids, cat.sids) and np.array_equal(again.item_ids, cat.item_ids)
    assert not np.array_equal(generate_recif_like(60_000, 4, 512, seed=4).sids, cat.sids)


def test_generate_catalog_samples_item_by_item_beyond_the_split_tables():
    small = generate_catalog(2000, 3, 32, seed=0)
    assert "synthetic" in small.source
    big = generate_catalog(20_000, 4, 8192, seed=0)  # 8,192² cells per level would not fit the split tables
    assert "RecIF-like" in big.source and len(big) == 20_000 and big.codebook_sizes == (8192,) * 4
    with pytest.raises(ValueError):
        generate_recif_like(10, 1, 8)


def test_compact_format_round_trips_a_large_catalog(tmp_path):
    cat = generate_recif_like(100_000, 4, 1024, seed=1)
    save_catalog(cat, tmp_path / "c.grcat")
    back = load_catalog(tmp_path / "c.grcat")
    assert np.array_equal(back.sids, cat.sids) and np.array_equal(back.item_ids, cat.item_ids)
    for level in range(4):
        assert np.array_equal(back.trie.indptr[level], cat.trie.indptr[level])


def test_hot_reload_under_load_fails_no_request(tiny_model, tmp_path):
    from grserve_bench.workload import history_prompts
    from grserve.config import SchedulerConfig, SearchConfig
    from grserve.engine.retrieval_engine import RetrievalEngine
    from grserve.engine.types import RetrievalRequest

    paths = []
    for seed in (0, 1):
        paths.append(tmp_path / f"c{seed}.grcat")
        save_catalog(generate_recif_like(50_000, 4, 256, seed=seed), paths[-1])
    model = tiny_model(seed=0)
    first = load_catalog(paths[0])
    store = CatalogStore(first, vocab_size=model.spec.vocab_size)
    seen = {first.version: first}
    engine = RetrievalEngine(model, store, SearchConfig(), SchedulerConfig(max_inflight_batches=2)).start()
    prompts = history_prompts(first, 8, 48, seed=2)
    results, errors, stop = [], [], threading.Event()

    def client(k: int) -> None:
        while not stop.is_set():
            try:
                results.append(engine.submit(RetrievalRequest(prompts[k % 8], 8, 5)).future.result(timeout=120))
            except Exception as exc:  # noqa: BLE001 - the assertion below reports it
                errors.append(exc)
            k += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for th in threads:
        th.start()
    try:
        for i in range(4):
            new = load_catalog(paths[(i + 1) % 2])
            seen[store.version + 1] = new
            store.replace(new)
            n = len(results)
            while len(results) < n + 2 and not errors:  # requests run on the new catalog before the next swap
                threading.Event().wait(0.05)
    finally:
        stop.set()
        for th in threads:
            th.join(timeout=120)
        engine.stop()
    assert not errors and len(results) >= 8
    assert len({r.catalog_version for r in results}) >= 3
    for r in results:  # each request's items are items of the catalog version it reports
        assert len(r.items) == 5
        assert seen[r.catalog_version].contains_sids(np.array([it.sid for it in r.items])).all()
