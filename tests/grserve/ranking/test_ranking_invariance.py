"""BAT's attention gives the same bits whatever the caches held and whatever else is packed, in fp32 and in bf16
(the default ``--dtype auto`` on a CPU with fast bf16; issue 42). ``attention/bipartite.py``:

- the computed items' self stage runs one causal call per item length, unpadded: CPU flash attention rounds a row
  differently with the sequence length it is called with, so the padded call made an item's attention (and at
  bf16 its KV in the next layers, then the scores) depend on the longest item packed beside it;
- the tail's keys are laid out in the candidates' order whether each candidate was computed or read from cache:
  with computed items first, the key order, and with it the attention's last bits, changed with the cache state.

The first two tests call ``BipartiteBatchContext.attend`` on random q/k/v (no projection: they hold whatever the
CPU's GEMMs do). The last runs the ranking runner end to end: all candidates read from the item pool vs some
computed inline, the same order and scores within the dtype's rounding (bit-equal where the GEMMs' rows do not
depend on the row count, as oneDNN's bf16 ones here).
"""

import numpy as np
import pytest
import torch

from grserve.attention.bipartite import BipartiteBatchContext, BipartiteRequest
from grserve.config import RankingConfig, RankingDataConfig
from grserve.engine.ranking_runner import RankingRunner
from grserve.engine.types import RankingRequest
from grserve.model import load_model
from grserve.ranking.layouts import ITEM_PREFIX, BipartitePrompt
from grserve.ranking.startup_data import build_registry

HQ, HKV, D = 4, 2, 32
DTYPES = [torch.float32, torch.bfloat16]


def _prompt(item_lens, n_head=6, n_tail=3):
    return BipartitePrompt(ITEM_PREFIX, np.arange(n_head, dtype=np.int64),
                           tuple(np.arange(n, dtype=np.int64) for n in item_lens), np.arange(n_tail, dtype=np.int64))


def _tokens(n, seed, dtype):
    """q, k, v rows for n tokens: [n, HQ, D], [n, HKV, D], [n, HKV, D]."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))


def _kv(k, v):
    """A cached entry [L=1, 2, n, HKV, D] from token rows."""
    return torch.stack((k, v))[None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_items_attention_does_not_depend_on_the_items_packed_beside_it(dtype):
    head = _tokens(6, 0, dtype)
    a, b, tail = _tokens(5, 1, dtype), _tokens(13, 2, dtype), _tokens(3, 3, dtype)
    outs = []
    for items in ([a], [a, b]):
        prompt = _prompt([t[0].shape[0] for t in items])
        ctx = BipartiteBatchContext([BipartiteRequest(prompt, head_kv=_kv(head[1], head[2]))])
        q, k, v = (torch.cat([t[j] for t in items] + [tail[j]]) for j in range(3))
        outs.append(ctx.attend(0, q, k, v)[:5])  # item a's rows come first in the packed stream
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_same_keys_in_the_same_order_whichever_candidates_were_cached(dtype):
    head = _tokens(6, 0, dtype)
    items = [_tokens(n, 10 + n, dtype) for n in (4, 7, 5, 6)]
    tail = _tokens(3, 3, dtype)
    prompt = _prompt([4, 7, 5, 6])
    # reference: every candidate computed
    ctx = BipartiteBatchContext([BipartiteRequest(prompt, head_kv=_kv(head[1], head[2]))])
    q, k, v = (torch.cat([t[j] for t in items] + [tail[j]]) for j in range(3))
    ref = ctx.attend(0, q, k, v)
    # the 2nd candidate's KV explicit, the 3rd and 4th from one concatenated cache read; only the 1st computed
    cat = _kv(torch.cat([items[2][1], items[3][1]]), torch.cat([items[2][2], items[3][2]]))
    req = BipartiteRequest(prompt, head_kv=_kv(head[1], head[2]),
                           item_kv=[None, _kv(items[1][1], items[1][2]), True, True], cached_items_kv=cat)
    ctx = BipartiteBatchContext([req])
    q, k, v = (torch.cat([items[0][j], tail[j]]) for j in range(3))
    out = ctx.attend(0, q, k, v)
    assert torch.equal(out[:4], ref[:4])  # the computed candidate
    assert torch.equal(out[4:], ref[-3:])  # the tail


def test_scores_with_items_cached_or_computed_inline():
    model = load_model("tiny", dtype="float32", seed=0)
    reg = build_registry(RankingDataConfig(num_items=60, num_users=8, scale=0.05), model.spec.vocab_size)
    cfg = RankingConfig(policy="item_prefix", write_back_items=False)
    cached, partly = RankingRunner(model, reg, cfg), RankingRunner(model, reg, cfg)
    for i in reg.item_ids()[::2]:
        partly.item_pool.remove(i)
    rng = np.random.default_rng(1)
    reqs = [RankingRequest(reg.user_tokens(u), [reg.item_tokens(i) for i in ids], user_id=u, item_ids=list(ids),
                           top_k=5, now=0.0)
            for u in reg.user_ids() for ids in [rng.choice(reg.item_ids(), 12, replace=False).tolist()]]
    a, b = cached.run(reqs), partly.run(reqs)
    assert all(y.computed_tokens > x.computed_tokens for x, y in zip(a, b))  # some candidates computed inline
    for x, y in zip(a, b):
        assert x.order == y.order
        assert np.allclose(x.scores, y.scores, rtol=0, atol=1e-6)
