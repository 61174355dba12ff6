"""The cluster's pieces without Ray: block keys, the KV event publisher against the prefix cache's true contents,
the global KV index under lost events (Hypothesis state machine), the router's policies, the exactly-once token
stream and the recovery plan."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from grserve.kvcache.block_hash import chained_block_hashes
from grserve.cluster.core.kv_index import GlobalKVIndex, KVEventPublisher
from grserve.cluster.core.recovery import RecoveryCost, plan
from grserve.cluster.core.router import Router
from grserve.cluster.llm.journal import RequestRecord
from grserve.cluster.llm.stream import TokenStream
from grserve.cluster.wire import Attempt, TokenReport
from grserve.engine.sampling import SamplingParams


def tree_blocks(store, block_size: int, tier: str = "dram") -> dict[int, str]:
    """The true contents of a ``PrefixKVStore`` as block keys, by walking its radix tree."""
    out: dict[int, str] = {}
    stack = [(store.tree.root, np.zeros(0, dtype=np.int64))]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = np.concatenate([prefix, child.key])
            for key in chained_block_hashes(path[:(len(path) // block_size) * block_size], block_size):
                out[key] = tier
            stack.append((child, path))
    return out


# ---- block keys ------------------------------------------------------------------------------------------------
def test_block_hashes_chain_and_only_full_blocks():
    a = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    ka = chained_block_hashes(a, 16)
    assert len(ka) == 3 and len(set(ka)) == 3
    assert chained_block_hashes(a[:32], 16) == ka[:2]  # a prefix has the same keys
    b = a.copy()
    b[20] += 1  # block 1 differs: its key and every later key change, block 0's does not
    kb = chained_block_hashes(b, 16)
    assert kb[0] == ka[0] and kb[1] != ka[1] and kb[2] != ka[2]
    assert chained_block_hashes(a[16:], 16, parent=ka[0]) == ka[1:]  # the parent continues the chain
    same_tokens_other_position = chained_block_hashes(a[16:32], 16)[0]
    assert same_tokens_other_position != ka[1]


def test_block_hashes_stable_across_processes():
    code = ("from grserve.kvcache.block_hash import chained_block_hashes as h;"
            "print(h(list(range(40)), 8)[-1])")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True).stdout.strip())
    assert outs == {str(chained_block_hashes(list(range(40)), 8)[-1])}


# ---- the publisher follows the prefix cache's hooks exactly ----------------------------------------------------------
def _store(capacity: int):
    from grserve.kvcache.blocks import BlockPool, HybridCacheStorage
    from grserve.kvcache.prefix_kv import PrefixKVStore

    pool = BlockPool.for_model(64, 8, 16, 8)
    storage = HybridCacheStorage(pool, 1, 8, 16)
    return PrefixKVStore.for_storage(storage, capacity, "lru"), storage, pool


def test_publisher_equals_tree_contents_under_inserts_and_evictions():
    store, storage, pool = _store(capacity=120)
    pub = KVEventPublisher(0, "inc", block_size=4)
    store.listener = pub
    rng = np.random.default_rng(0)
    stems = [rng.integers(0, 50, 24).tolist() for _ in range(4)]
    pool.reserve(0, 64, "kv")
    storage.data.normal_()
    table = pool.table(0)
    events = 0
    for step in range(60):
        toks = stems[step % 4][:int(rng.integers(4, 24))] + rng.integers(0, 50, int(rng.integers(0, 30))).tolist()
        store.save(toks[:64], storage, table)
        assert pub.contents == tree_blocks(store, 4), f"step {step}"
        events += len(pub.take_events()[0])
    assert store.tree.stats["evicted_tokens"] > 0 and events > 0
    store.clear()  # a benchmark's fresh start: every slot free, nothing cached
    store.check()
    assert store.tree.size == 0 and len(store.match(stems[0])) == 0


@pytest.mark.parametrize("index_block", [4, 2, 8])
def test_publisher_follows_the_shared_block_cache(index_block):
    """The default prefix cache (``SharedPrefixCache``, groups of 4 tokens here) under saves and LRU evictions: the
    publisher's contents are the index blocks of the groups the cache holds — its own keys when the index's block
    is the engine's (4), the blocks ending in each held group otherwise — and ``clear`` empties them."""
    from grserve.kvcache.blocks import BlockPool, HybridCacheStorage
    from grserve.kvcache.shared_prefix import SharedPrefixCache

    B = 4
    pool = BlockPool.for_model(64, B, 16, 8)
    storage = HybridCacheStorage(pool, 1, 8, 16)
    cache = SharedPrefixCache(pool, capacity_blocks=6, policy="lru")
    pub = KVEventPublisher(0, "inc", block_size=index_block)
    cache.listener = pub
    rng = np.random.default_rng(1)
    stems = [rng.integers(0, 50, 12).tolist() for _ in range(3)]
    path_of: dict[int, list[int]] = {}  # group hash → its path from position 0 (what the test saved)
    for step in range(40):
        toks = stems[step % 3][:int(rng.integers(4, 12))] + rng.integers(0, 50, int(rng.integers(0, 10))).tolist()
        pool.reserve(step, len(toks), "kv")
        pool.table(step).num_tokens = len(toks)
        cache.save(toks, storage, pool.table(step))
        pool.free(step)
        for g, h in enumerate(chained_block_hashes(toks, B)):
            path_of[h] = toks[:(g + 1) * B]
        want = {}
        for h in cache.entries:
            path = path_of[h]
            keys = chained_block_hashes(path, index_block)
            want.update({k: "dram" for k in keys[(len(path) - B) // index_block:]})
        assert pub.contents == want, f"step {step}"
        if index_block == B:
            assert set(pub.contents) == set(cache.entries)
    assert cache.stats["evicted_groups"] > 0
    cache.clear()
    assert pub.contents == {} and not cache.entries and pool.num_free == pool.num_blocks
    cache.check()


# ---- the global index under lost events -------------------------------------------------------------------------
class IndexMachine(RuleBasedStateMachine):
    """Instances change their contents; each event reaches the index or is lost; instances restart or die.
    After every resync the index equals the union of the live instances' true contents."""

    @initialize(n=st.integers(1, 3))
    def setup(self, n):
        self.index = GlobalKVIndex()
        self.pubs: dict[int, KVEventPublisher] = {}
        self.inflight: dict[int, list] = {}
        self.incarnations = 0
        for i in range(n):
            self._start(i)

    def _start(self, i):
        self.incarnations += 1
        self.pubs[i] = KVEventPublisher(i, f"inc{self.incarnations}", block_size=1)
        self.index.register(i, self.pubs[i].incarnation)
        self.inflight[i] = []

    def _keys(self, chain, depth):
        return chained_block_hashes(list(range(chain * 10, chain * 10 + depth)), 1)

    @rule(data=st.data(), chain=st.integers(0, 3), depth=st.integers(1, 5), store=st.booleans())
    def change(self, data, chain, depth, store):
        live = sorted(self.pubs)
        if not live:
            return
        i = data.draw(st.sampled_from(live))
        keys = self._keys(chain, depth)
        self.pubs[i].publish("store" if store else "evict", keys if store else keys[depth - 1:])
        self.inflight[i].extend(self.pubs[i].take_events()[0])

    @rule(data=st.data())
    def deliver(self, data):
        for i in list(self.pubs):
            evs = self.inflight[i]
            kept = [e for e in evs if not data.draw(st.booleans(), label="drop")]
            self.index.apply(i, kept)
            self.inflight[i] = []

    @rule(data=st.data())
    def restart(self, data):
        if self.pubs:
            self._start(data.draw(st.sampled_from(sorted(self.pubs))))

    @rule(data=st.data())
    def die(self, data):
        if self.pubs:
            i = data.draw(st.sampled_from(sorted(self.pubs)))
            del self.pubs[i]
            self.index.drop_instance(i)
            late = self.inflight.pop(i)
            self.index.apply(i, late)  # a late poll of the dead instance changes nothing

    @rule()
    def resync(self):
        """A heartbeat from every live instance (its next sequence number), then the snapshots asked for."""
        for i, pub in self.pubs.items():
            self.index.apply(i, [], pub.take_events()[1])
            if self.index.needs_snapshot(i):
                self.index.apply_snapshot(pub.snapshot())
        union: dict[int, dict[int, str]] = {}
        for i, pub in self.pubs.items():
            for k, tier in pub.contents.items():
                union.setdefault(k, {})[i] = tier
        assert self.index.blocks == union

    @invariant()
    def dead_have_no_entries(self):
        if hasattr(self, "index"):
            holders = {i for h in self.index.blocks.values() for i in h}
            assert holders <= set(self.pubs)


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_index_detects_a_lost_tail_and_a_restart():
    idx, pub = GlobalKVIndex(), KVEventPublisher(0, "a", 1)
    idx.register(0, "a")
    idx.apply_snapshot(pub.snapshot())
    pub.publish("store", [b"x"])
    pub.take_events()  # lost
    assert idx.apply(0, [], pub.take_events()[1]) is True  # the heartbeat's sequence number tells
    idx.apply_snapshot(pub.snapshot())
    assert idx.blocks == {b"x": {0: "dram"}}
    pub2 = KVEventPublisher(0, "b", 1)  # restarted: empty, new incarnation
    pub2.publish("store", [b"y"])
    assert idx.apply(0, pub2.take_events()[0]) is True
    assert idx.blocks == {}  # the old incarnation's entries went
    idx.apply_snapshot(pub2.snapshot())
    assert idx.blocks == {b"y": {0: "dram"}}


# ---- router -------------------------------------------------------------------------------------------------------
def _attempt(request_id: str, prompt: list[int], max_tokens: int) -> Attempt:
    return Attempt(request_id, 0, prompt, SamplingParams(max_tokens=max_tokens))


def _index_with(instance_blocks: dict[int, tuple[list[int], str]], bs: int = 4) -> GlobalKVIndex:
    idx = GlobalKVIndex()
    for i, (tokens, tier) in instance_blocks.items():
        pub = KVEventPublisher(i, f"i{i}", bs, tier)
        pub.publish("store", chained_block_hashes(tokens, bs))
        idx.register(i, pub.incarnation)
        idx.apply_snapshot(pub.snapshot())
    return idx


def test_kv_router_prefers_the_cached_prefix_and_books_load():
    prompt = list(range(33))
    idx = _index_with({1: (prompt[:16], "dram"), 2: (prompt[:8], "dram")})
    r = Router(3, "kv", block_size=4, index=idx)
    d = r.route(_attempt("a", prompt, 10))
    assert (d.instance, d.reason, d.cached_tokens) == (1, "prefix", 16)
    assert r.load[1].prefill_tokens == 33 - 16
    # the booked load now makes instance 1 dearer: a second identical request goes elsewhere once 1 is loaded
    for k in range(3):
        r.route(_attempt(f"b{k}", prompt, 10))
    assert r.routed[1] >= 1 and r.routed[0] + r.routed[2] >= 1
    r.on_tokens("a", 1)
    assert r.load[1].decode_tokens == 9 and r.load[1].prefill_tokens == 3 * 0 + sum(
        b.prefill for k, b in r._book.items() if b.instance == 1 and not b.past_prefill)
    r.release("a")
    assert r.load[1].decode_tokens == 0


def test_equal_prefixes_least_loaded_wins_and_tiers_weigh():
    prompt = list(range(21))
    idx = _index_with({0: (prompt[:16], "dram"), 1: (prompt[:16], "dram")})
    r = Router(2, "kv", block_size=4, index=idx)
    r.load[0].prefill_tokens = 50
    assert r.route(_attempt("x", prompt, 4)).instance == 1
    idx2 = _index_with({0: (prompt[:16], "ssd"), 1: (prompt[:16], "hbm")})
    assert Router(2, "kv", block_size=4, index=idx2).route(_attempt("y", prompt, 4)).instance == 1


def test_round_robin_and_least_loaded_ignore_the_cache():
    prompt = list(range(40))
    idx = _index_with({2: (prompt, "dram")})
    rr = Router(3, "round_robin", block_size=4, index=idx)
    assert [rr.route(_attempt(f"r{k}", prompt, 4)).instance for k in range(5)] == [0, 1, 2, 0, 1]
    ll = Router(3, "least_loaded", block_size=4, index=idx)
    assert ll.route(_attempt("l0", prompt, 4)).instance == 0  # no cache term: all equal → lowest index
    assert ll.route(_attempt("l1", prompt, 4)).instance == 1
    rr.mark_down(2)
    assert 2 not in {rr.route(_attempt(f"d{k}", prompt, 4)).instance for k in range(4)}


# ---- the client's stream: each position once --------------------------------------------------------------------
def _report(attempt: int, index: int, ids: list[int], text: str = "") -> TokenReport:
    return TokenReport("r", attempt, index, ids, text)


def test_token_stream_exactly_once_across_attempts():
    s = TokenStream()
    assert s.accept(_report(0, 0, [1, 2], "ab")) == ([1, 2], "ab")
    assert s.accept(_report(0, 2, [3], "c")) == ([3], "c")
    s.new_attempt()  # the instance died after delivering 3 tokens; the new attempt starts at position 3
    assert s.accept(_report(0, 3, [4], "x")) == ([], "")  # a late report of the old attempt
    assert s.accept(_report(1, 0, [4, 5], "de")) == ([4, 5], "de")
    assert s.accept(_report(1, 0, [4, 5], "de")) == ([], "")  # a re-sent report is skipped
    assert s.duplicates == 2
    with pytest.raises(AssertionError, match="gap"):
        s.accept(_report(1, 5, [9]))
    with pytest.raises(AssertionError, match="overlapping"):
        s.accept(_report(1, 1, [5, 6], "ef"))  # its text cannot be split by token
    assert s.output_ids == [1, 2, 3, 4, 5] and s.text == "abcde"


# ---- the recovery plan ----------------------------------------------------------------------------------------------
def test_recovery_plan_migrate_recompute_fail():
    rec = RequestRecord("r", list(range(100)), SamplingParams(max_tokens=20, temperature=0), None, TokenStream())
    rec.stream.accept(_report(0, 0, [7, 8, 9]))
    p = plan(rec, migration_limit=2)
    assert p.action == "recompute" and rec.resume_tokens == 103
    rec.stream.new_attempt()
    nxt = rec.next_attempt()
    assert (nxt.attempt, nxt.prompt_ids, nxt.delivered, nxt.max_new_tokens) == (1, list(range(100)), [7, 8, 9], 17)
    rec.snapshot = torch.zeros(2, 2, 100, 8)
    p = plan(rec, migration_limit=2)
    assert p.action == "migrate" and p.snapshot_tokens == 100
    slow_copy = RecoveryCost(prefill_tokens_per_s=1e12, kv_bytes_per_s=1.0)
    assert plan(rec, 2, slow_copy).action == "recompute"  # the cost model decides
    rec.migrations = 2
    assert plan(rec, migration_limit=2).action == "fail"


def test_cache_weight_trades_balance_for_affinity():
    prompt = list(range(41))
    idx = _index_with({0: (prompt[:40], "hbm")})  # 40 cached tokens on instance 0, which has 60 tokens booked
    for cw, expect in ((1.0, 1), (2.0, 0)):
        r = Router(2, "kv", block_size=4, index=idx, cache_weight=cw)
        r.load[0].prefill_tokens = 60
        assert r.route(_attempt("x", prompt, 4)).instance == expect


def test_instance_threads_share_the_cores():
    from grserve.cluster.core.ray_runtime import instance_threads

    assert instance_threads(0, 3, cores=2) == 1
    assert instance_threads(0, 2, cores=16) == 8
    assert instance_threads(0, 4, cores=16) == 4
    assert instance_threads(3, 4, cores=16) == 3  # an explicit count wins


def test_router_reads_gr_requests_as_they_are():
    """A retrieval request books its history's tokens (no reusable KV: load alone, even under ``kv``); a ranking
    request books its user's and candidates' tokens, minus its user's profile where the index holds the user."""
    from grserve.cluster.core.kv_index import user_key
    from grserve.engine.types import RankingRequest, RetrievalRequest

    idx = GlobalKVIndex()
    pub = KVEventPublisher(1, "i1", 1)
    pub.publish("store", [user_key(42)])
    for i in (0, 1):
        idx.register(i, "i1" if i else "i0")
    idx.apply_snapshot(pub.snapshot())
    r = Router(2, "kv", block_size=4, index=idx)
    long_history = RetrievalRequest(np.arange(30), beam_width=4, top_n=2, request_id="h30")
    d = r.route(long_history)
    assert (d.instance, d.reason, d.cached_tokens, r.load[0].prefill_tokens) == (0, "load", 0, 30)
    assert r.route(RetrievalRequest(np.arange(5), beam_width=4, top_n=2, request_id="h5")).instance == 1
    ranked = RankingRequest(np.arange(12), [np.arange(3), np.arange(3)], user_id=42, request_id="u42")
    d = r.route(ranked)  # 18 tokens; 12 of them (the profile) cached on instance 1, which has 5 booked
    assert (d.instance, d.reason, d.cached_tokens) == (1, "prefix", 12) and r.load[1].prefill_tokens == 5 + 6
    stranger = RankingRequest(np.arange(12), [np.arange(3)], user_id=7, request_id="u7")
    assert r.route(stranger).cached_tokens == 0
