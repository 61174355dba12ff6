"""Decode staging (``attention/decode_staging.py``): pure decode steps on a persistent head-major K/V copy.

Checked against the gather path it replaces and against HF: per-step logits of the staged context equal the
unstaged context's (≤ 1e-5, fp32) over appends, a request leaving the batch, and the buffer growing past
``GROW_TOKENS``; greedy tokens through the engine (staging on by default) equal the engine without staging and HF
``generate`` with requests joining, finishing at different steps and being preempted; the plan's rules.
"""

from __future__ import annotations

import pytest
import torch

from grserve.attention.decode_staging import GROW_TOKENS, DecodeStaging
from grserve.attention.hybrid import HybridPagedContext, SeqSlice
from grserve.engine.sampling import SamplingParams
from grserve.kvcache.blocks import BlockPool, HybridCacheStorage
from grserve.scheduler.llm_factory import make_llm_scheduler
from grserve.model.cpu_support import cpu_support
from llm_fixtures import Preempting, run_joining

VOCAB = 300


def test_plan_rules():
    st = DecodeStaging(2, 2, 4, max_bytes=1 << 20)
    keys = ((0, 0), (1, 0))
    assert st.plan(keys, [5, 9]) == "rebuild"
    st.commit(keys, [5, 9])
    assert st.plan(keys, [6, 10]) == "append"
    st.commit(keys, [6, 10])
    assert st.plan(keys, [7, 12]) == "rebuild"  # a step that was not staged moved request 1 by two tokens
    assert st.plan(keys, [7, 12]) == "rebuild"  # not committed: still invalid
    st.commit(keys, [7, 12])
    assert st.plan(((0, 0), (1, 1)), [8, 13]) == "rebuild"  # request 1 was preempted and recomputed
    st.commit(((0, 0), (1, 1)), [8, 13])
    assert st.plan(((0, 0), (1, 1)), [9, GROW_TOKENS]) == "rebuild"  # past the buffer's capacity: grown
    assert st.k.shape[3] == 2 * GROW_TOKENS
    st.invalidate()
    assert st.plan(((0, 0), (1, 1)), [9, GROW_TOKENS]) == "rebuild"
    assert st.plan(tuple((i, 0) for i in range(64)), [5000] * 64) is None  # over max_bytes: the gather path
    assert st.k is None


def _step_logits(model, st, tables, done, plan, staging, keys):
    spec = model.spec
    slices, ids, pos = [], [], []
    for i, n in plan:
        slices.append(SeqSlice(tables[i], done[i], n))
        ids += FULL[i][done[i]: done[i] + n]
        pos += list(range(done[i], done[i] + n))
    ctx = HybridPagedContext(st, slices, model.kv_from_hidden, spec.num_key_value_heads, spec.head_dim,
                             staging, keys)
    with torch.inference_mode():
        h = model(torch.tensor(ids), torch.tensor(pos), ctx)
        ctx.finish()
        ends = torch.tensor([n for _, n in plan]).cumsum(0) - 1
        return model.logits(h[ends])


g = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, GROW_TOKENS - 3, 17)]
FULL = [p + torch.randint(3, VOCAB, (12,), generator=g).tolist() for p in PROMPTS]


def staged_run_logits(model, staging: DecodeStaging | None) -> list[torch.Tensor]:
    """Per-step logits of the three FULL requests: their prompts at once, then ten decode steps (request 2 leaves
    after five) through ``staging`` (None: the gather path)."""
    spec = model.spec
    pool = BlockPool.for_model(128, 4, spec.hidden_size, spec.kv_size)
    st = HybridCacheStorage(pool, spec.num_hidden_layers, spec.kv_size, spec.hidden_size)
    tables = [pool.reserve(i, len(f), "kv") for i, f in enumerate(FULL)]
    done = [0, 0, 0]
    out = [_step_logits(model, st, tables, done, [(i, len(p)) for i, p in enumerate(PROMPTS)], None, None)]
    done = [len(p) for p in PROMPTS]
    for step in range(10):
        live = [0, 1, 2] if step < 5 else [0, 1]  # request 2 leaves after five decodes
        keys = tuple((i, 0) for i in live)
        out.append(_step_logits(model, st, tables, done, [(i, 1) for i in live], staging, keys))
        for i in live:
            done[i] += 1
    return out


def test_staged_logits_equal_gather_path(hf_qwen3):
    _, ours = hf_qwen3(kv_heads=2, seed=5, perturb_norms=True)
    spec = ours.spec
    staging = DecodeStaging(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim)
    staged = staged_run_logits(ours, staging)
    assert staging.stats["append"] >= 5 and staging.stats["rebuild"] >= 3  # first, the leave, the growth
    for a, b in zip(staged_run_logits(ours, None), staged):
        assert float((a - b).abs().max()) <= 1e-5


def _run(ours, sched, staging, prompts, params):
    policy = Preempting(make_llm_scheduler("fcfs")) if sched == "preempting" else make_llm_scheduler(sched)
    out, eng = run_joining(ours, policy, prompts, params, decode_staging=staging)
    return out, eng.executor.staging


@pytest.mark.parametrize("sched", ["fcfs", "chunked", "aptserve", "preempting"])
def test_engine_tokens_staged_equal_gather_and_hf(hf_qwen3, sched):
    hf, ours = hf_qwen3(kv_heads=2, seed=5, perturb_norms=True)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 20, (7,), generator=gen)]
    params = [SamplingParams(max_tokens=int(m), temperature=0.0, ignore_eos=True)
              for m in torch.randint(3, 15, (7,), generator=gen)]  # finishing at different steps
    staged, staging = _run(ours, sched, True, prompts, params)
    plain, none = _run(ours, sched, False, prompts, params)
    assert none is None
    if cpu_support().fast_paths:
        assert staging.stats["append"] > 0 and staging.stats["rebuild"] > 0
    else:  # GRSERVE_CPU_ISA=reference (the make test lane): staging is off, both runs gather; HF below still holds
        assert staging is None
    assert staged == plain
    for p, sp, got in zip(prompts, params, staged):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=sp.max_tokens, min_new_tokens=sp.max_tokens, do_sample=False,
                              pad_token_id=0)[0, len(p):].tolist()
        assert got == ref
