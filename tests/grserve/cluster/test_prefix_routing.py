"""Retrieval requests routed by their prompt's prefix blocks (no Ray): an instance's prompt-prefix cache publishes
its stored and evicted blocks through the cluster's ``KVEventPublisher`` into the ``GlobalKVIndex``; the ``kv``
router sends a returning user's next request to the instance that holds their history (even when it is busier by
less than the tokens it saves), drops the preference once the blocks are evicted there, and a dead instance's
blocks leave the index (a lost cache, never a lost request: the next decision is by load)."""

from __future__ import annotations

import numpy as np
import torch

from grserve.cluster.core.kv_index import GlobalKVIndex, KVEventPublisher
from grserve.cluster.core.router import Router
from grserve.engine.types import RetrievalRequest
from grserve.kvcache.prefix_blocks import PrefixBlockCache

B = 4


def _setup(n=2, capacity=64):
    index = GlobalKVIndex()
    caches, pubs = [], []
    for i in range(n):
        index.register(i, f"inc{i}")
        pub = KVEventPublisher(i, f"inc{i}", B)
        cache = PrefixBlockCache(capacity, block_size=B, num_layers=1, num_kv_heads=1, head_dim=1, policy="lru")
        cache.listener = pub
        index.apply_snapshot(pub.snapshot())  # the index trusts an instance's events after its first snapshot
        caches.append(cache)
        pubs.append(pub)
    return index, caches, pubs


def _serve(cache, pub, index, i, prompt):
    kv = torch.zeros(1, 1, len(prompt), 1), torch.zeros(1, 1, len(prompt), 1)
    cache.store(prompt, cache.load(prompt, *kv), *kv)
    index.apply(i, *pub.take_events())


def _req(prompt, rid):
    return RetrievalRequest(prompt_tokens=np.asarray(prompt, dtype=np.int64), beam_width=4, top_n=4, request_id=rid)


def test_a_returning_user_goes_where_their_history_is():
    index, caches, pubs = _setup()
    history = np.arange(100, 140)  # 40 tokens: 10 blocks
    _serve(caches[1], pubs[1], index, 1, history)
    router = Router(2, "kv", block_size=B, index=index, decode_weight=0.0, cache_weight=2.0)
    router.route(_req(np.arange(5000, 5010), "busy"), exclude=[0])  # instance 1 has 10 tokens booked
    d = router.route(_req(np.concatenate([history, [7, 8, 9]]), "again"))
    assert d.instance == 1 and d.reason == "prefix" and d.cached_tokens == 40
    rr = Router(2, "round_robin", block_size=B, index=index)
    assert [rr.route(_req(history, f"r{k}")).instance for k in range(2)] == [0, 1]  # not by prefix


def test_evicted_blocks_and_a_dead_instance_leave_the_index():
    index, caches, pubs = _setup(capacity=8)  # two blocks
    history = np.arange(100, 120)
    _serve(caches[1], pubs[1], index, 1, history)
    router = Router(2, "kv", block_size=B, index=index, decode_weight=0.0)
    assert router.route(_req(history, "a")).reason == "prefix"
    _serve(caches[1], pubs[1], index, 1, np.arange(900, 920))  # another user's blocks evict the history's
    router.release("a")
    d = router.route(_req(history, "b"))
    assert d.cached_tokens == 0 and d.reason == "load"
    _serve(caches[0], pubs[0], index, 0, history)
    router.release("b")
    assert router.route(_req(history, "c")).instance == 0
    index.drop_instance(0)
    router.mark_down(0)
    router.release("c")
    d = router.route(_req(history, "d"))
    assert d.instance == 1 and d.cached_tokens == 0  # the cache is lost, the request is not
