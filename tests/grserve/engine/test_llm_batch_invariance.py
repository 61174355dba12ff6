"""Batch invariance of the LLM engine (issue 42): with ``batch_invariant`` a greedy request gets the same tokens, and
the same log-probabilities to the bit, alone as inside a batch of 2, 7 or 32 different requests (other prompts and
lengths, some joining while it decodes), in bf16 and in fp32.

Without the option a request's attention depends on the batch: SDPA's CPU flash kernel sums a row's keys in an
order set by the padded key length (the batch's longest request) and by the number of query rows per call (how
its prompt was chunked beside the others). ``scripts/llm_batch_invariance.py`` names the first op that differs.
"""

import numpy as np
import pytest
import torch

from grserve.engine.llm import build_model_engine
from grserve.engine.sampling import SamplingParams
from grserve.model import load_model
from grserve.scheduler.llm_factory import make_llm_scheduler

TARGET_TOKENS = 30
BLOCKS = 90  # a pool the 7-request batch overfills (aptserve test: 2 preemptions)
ENGINES: list = []  # the last run's engine is ENGINES[-1] (its stats)
_ALONE: dict = {}  # (dtype, scheduler) -> the target's answer alone


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def model(request):
    return load_model("tiny", dtype=request.param, seed=3)


def _prompt(rng, lo, hi):
    return rng.integers(5, 30000, int(rng.integers(lo, hi))).tolist()


def run(model, others, batch_invariant=True, scheduler="chunked", num_blocks=1024):
    """The target's (token ids, chosen tokens' log-probabilities); ``others``: [(join step, prompt, max tokens)].
    A token budget of 96 chunks the prompts differently alone and in a batch."""
    pol = make_llm_scheduler(scheduler, token_budget=96, max_num_batched_tokens=96, max_num_seqs=64, rho=0.0)
    eng = build_model_engine(model, pol, num_blocks=num_blocks, block_size=16,
                             batch_invariant=batch_invariant)
    ENGINES.append(eng)
    eng.keep_finished = True
    target = _prompt(np.random.default_rng(7), 500, 501)  # decoding crosses 512 keys (a second key block)
    joins = {}
    for step, p, n in others:
        joins.setdefault(step, []).append((p, n))
    add = lambda p, n: eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))  # noqa: E731
    for p, n in joins.pop(0, [])[::2]:  # some before the target, some after
        add(p, n)
    tid = eng.add_request(target, SamplingParams(max_tokens=TARGET_TOKENS, temperature=0.0, ignore_eos=True,
                                                  logprobs=0))
    events = {}
    step = 0
    first = [x for x in others if x[0] == 0][1::2]
    for _, p, n in first:
        add(p, n)
    while eng.has_work() or joins:
        step += 1
        for p, n in joins.pop(step, []):
            add(p, n)
        if eng.has_work():
            for ev in eng.step():
                if ev.seq_id == tid and ev.logprobs:
                    events.setdefault("lp", []).extend(lp.logprob for lp in ev.logprobs)
    out = {s.seq_id: s for s in eng.finished}[tid].output_ids
    return out, events.get("lp", [])


def others(size, seed):
    rng = np.random.default_rng(seed)
    return [(0 if j % 3 == 0 else int(rng.integers(1, 25)), _prompt(rng, 8, 120), int(rng.integers(4, 30)))
            for j in range(size - 1)]


def alone(model, scheduler="chunked", num_blocks=1024):
    key = (model.dtype, scheduler, num_blocks)
    if key not in _ALONE:
        _ALONE[key] = run(model, [], scheduler=scheduler, num_blocks=num_blocks)
    return _ALONE[key]


@pytest.mark.parametrize("size", [2, 7, 32])
def test_same_tokens_alone_and_in_any_batch(model, size):
    alone_ids, alone_lp = alone(model)
    assert len(alone_ids) == TARGET_TOKENS and len(alone_lp) == TARGET_TOKENS
    ids, lp = run(model, others(size, seed=size))
    assert ids == alone_ids
    assert lp == alone_lp  # the same float bits, not a tolerance


def test_aptserve_with_preemptions_too(model):
    """Apt-Serve's scheduler with a pool the batch overfills, so that it preempts (a preempted request computes its
    tokens again, in other chunks): the same tokens alone and in a batch."""
    batched = run(model, others(7, seed=11), scheduler="aptserve", num_blocks=BLOCKS)
    stats = ENGINES[-1].stats
    assert stats["preemptions"] > 0
    assert batched == alone(model, "aptserve", BLOCKS)


def test_invariant_attention_is_the_same_attention(model):
    """The invariant path computes the same attention as the default one (alone: greedy tokens equal, the
    log-probabilities within rounding)."""
    ids, lp = alone(model)
    ref_ids, ref_lp = run(model, [], batch_invariant=False)
    tol = 1e-4 if model.dtype == torch.float32 else 0.1
    assert ids[:8] == ref_ids[:8]
    if model.dtype == torch.float32:
        assert ids == ref_ids
    assert np.allclose(lp[:8], ref_lp[:8], atol=tol)


def test_offline_llm_and_serve_flag():
    from grserve.config import LLMConfig
    from grserve.llm_api import llm_config

    assert LLMConfig().batch_invariant is False  # the default (docs/llm.md: its cost)
    cfg = llm_config("tiny", batch_invariant=True, dtype="bfloat16", scheduler="chunked")
    assert cfg.llm.batch_invariant is True
