"""The pure-KV decode pass's indices built straight from the block tables (``attention/hybrid.py``,
``HybridPagedContext._init_decode``, on while ``FAST_DECODE_INDEX``) against the general construction (the
reference): the same write rows, key mask, gather rows and staging plan, tensor for tensor, over block boundaries,
ragged lengths, staged (append / rebuild) and unstaged passes; and the engine's greedy tokens with the fast index
equal those without it and HF ``generate`` (fp32) with requests joining, finishing and being preempted.
"""

from __future__ import annotations

import pytest
import torch

from grserve.attention import hybrid
from grserve.attention.decode_staging import DecodeStaging
from grserve.attention.hybrid import HybridPagedContext, SeqSlice
from grserve.engine.sampling import SamplingParams
from grserve.kvcache.blocks import BlockPool, HybridCacheStorage
from grserve.scheduler.llm_factory import make_llm_scheduler
from llm_fixtures import Preempting, run_joining

FIELDS = ("_k_dst", "_v_dst", "_mask", "_starts", "_nnew", "_tok_seq", "_tok_pos", "t_max", "q_max", "all_kv",
          "any_kv", "num_tokens", "pure_decode", "lone_prefill", "_kv_src", "_h_src", "_new_dst", "_ph")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _contexts(storage, slices, staged: bool, keys):
    """(fast, general) contexts of one pass, each planning on its own staging (same history)."""
    out = []
    for fast in (True, False):
        st = DecodeStaging(2, 2, 4, max_bytes=1 << 24) if staged else None
        if st is not None and keys is not None and staged == "append":
            starts = [s.start - 1 for s in slices]
            st.plan(keys, starts)
            st.commit(keys, starts)
        out.append(HybridPagedContext(storage, slices, None, 2, 4, st, keys, fast_index=fast))
    return out


@pytest.mark.parametrize("staged", [False, "rebuild", "append"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_indices_equal_general_path(staged, block_size):
    gen = torch.Generator().manual_seed(block_size)
    pool = BlockPool.for_model(2048, block_size, 8, 8)
    storage = HybridCacheStorage(pool, 2, 8, 8)
    lens = [int(n) for n in torch.randint(1, 70, (9,), generator=gen)] + [block_size, block_size + 1, 1]
    tables = [pool.reserve(i, n + 1, "kv") for i, n in enumerate(lens)]  # n cached, one new token
    slices = [SeqSlice(t, n, 1) for t, n in zip(tables, lens)]
    keys = tuple((i, 0) for i in range(len(lens))) if staged else None
    fast, ref = _contexts(storage, slices, staged, keys)
    assert fast.pure_decode and ref.pure_decode
    for f in FIELDS:
        assert _same(getattr(fast, f), getattr(ref, f)), f
    assert (fast._stage is None) == (ref._stage is None)
    if fast._stage is not None:
        assert fast._stage[1] == ref._stage[1] == staged
        assert all(_same(a, b) for a, b in zip(fast._stage_at, ref._stage_at))
    if staged != "append":  # the step reads the pool: the same padded gather rows
        assert _same(fast._kv_rows, ref._kv_rows)
    else:
        assert fast._kv_rows is None  # not needed by an appending step


def test_fast_index_only_for_pure_kv_decode():
    pool = BlockPool.for_model(64, 4, 8, 8)
    storage = HybridCacheStorage(pool, 2, 8, 8)
    kv, hid = pool.reserve(0, 9, "kv"), pool.reserve(1, 9, "hidden")
    for slices in ([SeqSlice(kv, 8, 1), SeqSlice(hid, 8, 1)],  # a hidden-cache request
                   [SeqSlice(kv, 6, 3)],  # a chunk, not one token
                   [SeqSlice(kv, 0, 1)]):  # a one-token prompt (lone prefill)
        assert not hybrid._pure_kv_decode(slices)
    assert hybrid._pure_kv_decode([SeqSlice(kv, 8, 1)])
    with pytest.raises(ValueError):
        HybridPagedContext(storage, [SeqSlice(kv, 12, 1)], None, 2, 4)  # past the table


def _generate(ours, sched, prompts, params, staging: bool):
    policy = Preempting(make_llm_scheduler("fcfs")) if sched == "preempting" else make_llm_scheduler(sched)
    return run_joining(ours, policy, prompts, params, decode_staging=staging)[0]


@pytest.mark.parametrize("sched", ["fcfs", "preempting"])
@pytest.mark.parametrize("staging", [True, False])
def test_engine_greedy_tokens_fast_index_equal_reference_and_hf(hf_qwen3, monkeypatch, sched, staging):
    hf, ours = hf_qwen3(kv_heads=2, seed=5, perturb_norms=True)
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 20, (7,), generator=gen)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in torch.randint(3, 15, (7,), generator=gen)]
    fast = _generate(ours, sched, prompts, params, staging)
    monkeypatch.setattr(hybrid, "FAST_DECODE_INDEX", False)
    ref = _generate(ours, sched, prompts, params, staging)
    assert fast == ref
    for p, sp, got in zip(prompts, params, fast):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist()
        assert got == want
