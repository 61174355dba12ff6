"""Unified block pool invariants (hypothesis): no block owned twice, used + free = total, per-request counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.kvcache.blocks import BlockPool, HybridCacheStorage, OutOfBlocks

ops = st.lists(st.tuples(st.sampled_from(["reserve", "free"]), st.integers(0, 5), st.integers(1, 40),
                         st.sampled_from(["kv", "hidden"])), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(1, 8), st.integers(1, 3), st.integers(4, 64))
def test_pool_invariants(seq, block_size, hidden_planes, num_blocks):
    pool = BlockPool(num_blocks, block_size, kv_planes=2, hidden_planes=hidden_planes)
    tokens: dict[int, int] = {}
    for op, owner, n, kind in seq:
        if op == "free":
            pool.free(owner)
            tokens.pop(owner, None)
        else:
            if owner in pool and pool.table(owner).kind != kind:
                with pytest.raises(ValueError):
                    pool.reserve(owner, n, kind)
                continue
            before = pool.num_free
            want = max(n, tokens.get(owner, 0))
            try:
                pool.reserve(owner, want, kind)
                tokens[owner] = want
            except OutOfBlocks:
                assert pool.num_free == before  # unchanged on failure
        pool.check()
        assert pool.num_used + pool.num_free == pool.num_blocks
        for o, n_tok in tokens.items():
            t = pool.table(o)
            planes = 2 if t.kind == "kv" else hidden_planes
            assert t.num_blocks == planes * -(-n_tok // block_size) == pool.blocks_for(n_tok, t.kind)


def test_mha_hidden_is_half_and_gqa_is_not():
    mha = BlockPool.for_model(100, 16, hidden_size=256, kv_width=256)
    gqa = BlockPool.for_model(100, 16, hidden_size=256, kv_width=64)
    assert mha.blocks_for(33, "kv") == 6 and mha.blocks_for(33, "hidden") == 3 and mha.hidden_is_smaller()
    assert gqa.blocks_for(33, "hidden") == 12 and not gqa.hidden_is_smaller()


def test_cache_map_positions_are_unique_and_contiguous_within_blocks():
    pool = BlockPool(32, 4)
    pool.reserve("a", 3, "kv")
    pool.reserve("b", 9, "hidden")
    pool.reserve("a", 11, "kv")
    st_ = HybridCacheStorage(pool, num_layers=1, width=2, hidden_size=2)
    for owner, n in (("a", 11), ("b", 9)):
        rows = st_.row_index(pool.table(owner), 0, n)
        for plane in rows.tolist():
            assert len(set(plane)) == n
            for t in range(1, n):
                if t % 4:
                    assert plane[t] == plane[t - 1] + 1
    all_rows = [r for o, n in (("a", 11), ("b", 9)) for p in st_.row_index(pool.table(o), 0, n).tolist() for r in p]
    assert len(all_rows) == len(set(all_rows))
