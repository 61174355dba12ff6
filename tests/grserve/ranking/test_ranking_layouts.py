"""Bipartite Attention layouts (BAT §4): item KV context-independence, user-KV reuse, permutation invariance,
and the fast packed path against the explicit-mask reference. fp32 tolerances: KV and hidden ≤ 1e-4,
scores ≤ 1e-5 (absolute, probabilities)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grserve.attention.bipartite import BipartiteBatchContext, BipartiteRequest, reference_forward
from grserve.ranking.layouts import ITEM_PREFIX, USER_PREFIX, build_prompt
from grserve.ranking.scoring import score_candidates

TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(seed=1)


def _rand(rng, n):
    return rng.integers(16, 31000, size=n)


def _case(seed, n_items=7, n_user=40):
    rng = np.random.default_rng(seed)
    user = _rand(rng, n_user)
    items = [np.append(_rand(rng, int(rng.integers(2, 9))), 31000 + k) for k in range(n_items)]
    instr = _rand(rng, 3)
    return rng, user, items, instr


def _fast(model, reqs):
    ctx = BipartiteBatchContext(reqs)
    with torch.no_grad():
        h = model.forward(ctx.input_ids, ctx.positions, ctx)
    return h, ctx


def test_layout_positions_and_mask():
    _, user, items, instr = _case(0)
    up = build_prompt(USER_PREFIX, user, items, instr)
    assert all(up.item_positions(i)[0] == len(user) for i in range(len(items)))
    assert up.tail_positions()[0] == len(user) + max(len(t) for t in items)
    ip = build_prompt(ITEM_PREFIX, user, items, instr, notation=np.array([5, 6]))
    assert all(ip.item_positions(i)[0] == 2 for i in range(len(items)))
    m = ip.visibility()
    seg = ip.segment_ids()
    for a in range(len(items)):
        for b in range(len(items)):
            if a != b:
                assert not m[np.ix_(seg == a, seg == b)].any()  # items never see each other
    assert m[np.ix_(seg == len(items), seg != len(items))].all()  # the tail sees everything before it


@pytest.mark.parametrize("layout", [USER_PREFIX, ITEM_PREFIX])
@pytest.mark.parametrize("notation", [None, np.array([7, 8, 9])])
def test_fast_path_equals_masked_reference(model, layout, notation):
    if layout == USER_PREFIX and notation is not None:
        pytest.skip("notation tokens are an IP head")
    _, user, items, instr = _case(1)
    p = build_prompt(layout, user, items, instr, notation)
    ref, rctx = reference_forward(model, p)
    for exact in (True, False):
        ctx = BipartiteBatchContext([BipartiteRequest(p)], exact=exact)
        with torch.no_grad():
            h = model.forward(ctx.input_ids, ctx.positions, ctx)
        assert torch.allclose(h, ref, atol=TOL, rtol=0)  # no cache: the packed order is the flat order


@pytest.mark.parametrize("notation", [None, np.array([7, 8, 9])])
def test_item_kv_in_any_ip_request_equals_item_alone(model, notation):
    """IP: item KV is context-independent → precomputable once per item (digest T2)."""
    _, user, items, instr = _case(2)
    rng = np.random.default_rng(3)
    target = items[3]
    alone = build_prompt(ITEM_PREFIX, user[:1], [target], instr, notation)
    _, actx = reference_forward(model, alone)
    h0 = len(alone.head)
    kv_alone = actx.kv(h0, h0 + len(target))
    for trial in range(3):
        others = [np.append(_rand(rng, int(rng.integers(1, 12))), 30000 + trial * 10 + j) for j in range(5)]
        cands = others[:2] + [target] + others[2:]
        user2 = _rand(rng, int(rng.integers(5, 60)))
        p = build_prompt(ITEM_PREFIX, user2, cands, instr, notation)
        _, rctx = reference_forward(model, p)
        start = h0 + sum(len(t) for t in cands[:2])
        assert torch.allclose(rctx.kv(start, start + len(target)), kv_alone, atol=TOL, rtol=0)
        # and the fast path captures the same KV
        _, fctx = _fast(model, [BipartiteRequest(p)])
        assert torch.allclose(fctx.item_kv(0, 2), kv_alone, atol=TOL, rtol=0)


def test_ip_with_cached_items_equals_recomputation(model):
    _, user, items, instr = _case(4)
    p = build_prompt(ITEM_PREFIX, user, items, instr)
    ref, _ = reference_forward(model, p)
    cached = []
    for t in items:  # every item's KV computed alone
        _, c = reference_forward(model, build_prompt(ITEM_PREFIX, user[:1], [t], instr))
        cached.append(c.kv(0, len(t)))
    mix = [cached[i] if i % 2 == 0 else None for i in range(len(items))]  # half hit, half miss
    h, ctx = _fast(model, [BipartiteRequest(p, item_kv=mix)])
    assert ctx.num_tokens == p.num_tokens - sum(len(items[i]) for i in range(0, len(items), 2))
    assert torch.allclose(h[ctx.last_index(0)], ref[-1], atol=TOL, rtol=0)
    concat = torch.cat([cached[i] for i in range(0, len(items), 2)], dim=2)
    flags = [True if i % 2 == 0 else None for i in range(len(items))]
    h2, ctx2 = _fast(model, [BipartiteRequest(p, item_kv=flags, cached_items_kv=concat)])
    assert torch.allclose(h2[ctx2.last_index(0)], ref[-1], atol=TOL, rtol=0)


def test_up_cached_user_kv_equals_recomputation(model):
    """UP: the user KV computed once (any request) and reused gives the recomputed result (digest T1)."""
    _, user, items, instr = _case(5)
    first = build_prompt(USER_PREFIX, user, items[:3], instr)
    _, c1 = _fast(model, [BipartiteRequest(first)])
    user_kv = c1.head_kv(0)
    p = build_prompt(USER_PREFIX, user, items[3:], instr)  # a later request of the same user
    ref, rctx = reference_forward(model, p)
    assert torch.allclose(user_kv, rctx.kv(0, len(user)), atol=TOL, rtol=0)
    h, ctx = _fast(model, [BipartiteRequest(p, head_kv=user_kv)])
    assert ctx.num_tokens == p.num_tokens - len(user)  # the user is never recomputed
    assert torch.allclose(h[ctx.last_index(0)], ref[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", [USER_PREFIX, ITEM_PREFIX])
def test_permuting_candidates_permutes_scores(model, layout):
    rng, user, items, instr = _case(6, n_items=9)
    w = model.lm_head.weight

    def scores(cands):
        p = build_prompt(layout, user, cands, instr)
        h, ctx = _fast(model, [BipartiteRequest(p)])
        ident = torch.from_numpy(p.identifier_tokens)
        return np.array(score_candidates(h[ctx.last_index(0)], w, ident, len(cands)).all_scores)

    base = scores(items)
    for _ in range(3):
        perm = rng.permutation(len(items))
        permuted = scores([items[i] for i in perm])
        np.testing.assert_allclose(permuted, base[perm], atol=1e-5, rtol=0)


def test_without_bipartite_mask_order_matters(model):
    """Negative control: a plain causal prompt over the same tokens is not permutation invariant."""
    rng, user, items, instr = _case(7, n_items=6)
    w = model.lm_head.weight

    def causal_scores(cands):
        toks = np.concatenate([user, *cands, instr])
        from grserve.attention.context import SequenceKVContext
        ctx = SequenceKVContext(model.spec.num_hidden_layers)
        with torch.no_grad():
            h = model.forward(torch.from_numpy(toks), torch.arange(len(toks)), ctx)
        ident = torch.tensor([int(t[-1]) for t in cands])
        return np.array(score_candidates(h[-1], w, ident, len(cands)).all_scores)

    perm = np.array([5, 4, 3, 2, 1, 0])
    assert np.abs(causal_scores([items[i] for i in perm]) - causal_scores(items)[perm]).max() > 1e-4


def test_batch_equals_alone(model):
    reqs, refs = [], []
    for seed in range(3):
        _, user, items, instr = _case(10 + seed)
        p = build_prompt(USER_PREFIX if seed % 2 else ITEM_PREFIX, user, items, instr)
        reqs.append(BipartiteRequest(p))
        refs.append(reference_forward(model, p)[0][-1])
    h, ctx = _fast(model, reqs)
    for r, ref in enumerate(refs):
        assert torch.allclose(h[ctx.last_index(r)], ref, atol=TOL, rtol=0)


def test_scoring_softmax_topk(model):
    h = torch.randn(model.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    w = model.lm_head.weight
    ident = torch.tensor([100, 200, 300, 400])
    r = score_candidates(h, w, ident, 2)
    z = (w[ident] @ h).double()
    s = torch.softmax(z, 0)
    assert r.order == torch.argsort(s, descending=True)[:2].tolist()
    np.testing.assert_allclose(r.all_scores, s.numpy(), atol=1e-6)
    assert abs(sum(r.all_scores) - 1) < 1e-5
