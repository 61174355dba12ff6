"""Batch invariance of GR retrieval (issue 42): a request's items and scores are the same bits alone as inside a
batch of 2, 7 or 32 other requests, first, in the middle or last, in fp32 and in bf16.

``AccelConfig.batch_invariant`` (the default) runs every projection and the SID LM head as one GEMM per request
(``RowGroups``, ``model/packed_linear.py``). The last test swaps in a GEMM whose result depends on its row count, as
MKL's and oneDNN's do in their last bits, to show the comparison fails without the grouping and holds with it.
"""

import numpy as np
import pytest
import torch

from grserve.catalog import generate_catalog
from grserve.config import AccelConfig, SearchConfig
from grserve.engine.retrieval import RetrievalRunner
from grserve.model import load_model
from grserve.model import packed_linear

BW = 16


@pytest.fixture(scope="module")
def catalog():
    return generate_catalog(3000, depth=3, codebook_size=32, seed=1)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    return load_model("tiny", dtype=request.param, seed=5)


def prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 2000, int(rng.integers(9, 60))).astype(np.int64) for _ in range(n)]


def answers(runner, batch, catalog):
    out = runner.run(batch, BW, [BW] * len(batch), catalog)
    return [[(h.item_id, h.score) for h in hits] for hits in out.hits]


def alone_vs_batched(runner, catalog, size, where):
    """(the request's answer alone, its answer at ``where`` in a batch of ``size`` different requests)."""
    target = prompts(1, seed=99)[0]
    others = prompts(size - 1, seed=size)
    at = {"first": 0, "middle": (size - 1) // 2, "last": size - 1}[where]
    batch = others[:at] + [target] + others[at:]
    return answers(runner, [target], catalog)[0], answers(runner, batch, catalog)[at]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("size", [2, 7, 32])
def test_same_answer_alone_and_in_any_batch(model, catalog, size, where):
    runner = RetrievalRunner(model, SearchConfig(beam_width=BW), AccelConfig())
    assert runner.accel.batch_invariant  # the default
    alone, batched = alone_vs_batched(runner, catalog, size, where)
    assert len(alone) == BW
    assert [i for i, _ in batched] == [i for i, _ in alone]
    # bit-identical scores (torch.equal on the fp32 values, not a tolerance)
    assert torch.equal(torch.tensor([s for _, s in batched]), torch.tensor([s for _, s in alone]))


def test_hf_scoring_is_batch_invariant_too(catalog):
    model = load_model("tiny", dtype="float32", seed=5)
    runner = RetrievalRunner(model, SearchConfig(beam_width=BW, scoring="hf"), AccelConfig())
    alone, batched = alone_vs_batched(runner, catalog, 7, "middle")
    assert batched == alone


def test_row_groups_apply_one_call_per_group():
    calls = []
    g = packed_linear.RowGroups([3, 0, 2, 1])
    x = torch.arange(12.0).view(6, 2)
    out = g.apply(lambda t: calls.append(t.shape[0]) or t * 2, x)
    assert calls == [3, 2, 1] and torch.equal(out, x * 2)
    assert len(packed_linear.RowGroups.uniform(4, 16)) == 4 and packed_linear.RowGroups.uniform(4, 16).rows == 64
    with pytest.raises(ValueError):
        g.apply(lambda t: t, torch.zeros(5, 2))


def test_the_check_fails_on_a_row_count_dependent_gemm(catalog, monkeypatch):
    """A GEMM whose rows move with M (a stand-in for the last-bit differences of real kernels, made large so
    any batch shows it): without the grouping the batched answer differs from the request's own; with it, equal."""
    model = load_model("tiny", dtype="float32", seed=5)
    real = packed_linear.linear

    def m_dependent(x, lin, packed=None):
        y = real(x, lin, packed)
        return y + 1e-2 * float(np.sin(x.shape[0])) * y.abs().mean()

    monkeypatch.setattr(packed_linear, "linear", m_dependent)
    loose = RetrievalRunner(model, SearchConfig(beam_width=BW), AccelConfig(batch_invariant=False))
    alone, batched = alone_vs_batched(loose, catalog, 7, "middle")
    assert batched != alone  # the test above would catch such a kernel
    grouped = RetrievalRunner(model, SearchConfig(beam_width=BW), AccelConfig(batch_invariant=True))
    alone, batched = alone_vs_batched(grouped, catalog, 7, "middle")
    assert batched == alone
