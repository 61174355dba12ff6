"""BAT through FlexAttention (block mask from the segment rule) = the explicit-mask reference and the fast path.

Eager FlexAttention on CPU here; the compiled call is checked on a GPU only (``gpu`` marker: compiling takes about
a minute on CPU, too long for CI)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from grserve.attention.bipartite import BipartiteBatchContext, BipartiteRequest, reference_forward
from grserve_bench.flex_bipartite import FlexBipartiteContext
from grserve.attention.reference import reference_attention
from grserve.model import PRESETS
from grserve.ranking.layouts import ITEM_PREFIX, USER_PREFIX, build_prompt

pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _prompts(seed=0):
    rng = np.random.default_rng(seed)
    tok = lambda n: rng.integers(10, 500, n)
    items = [tok(int(n)) for n in rng.integers(1, 5, 4)]
    return [build_prompt(USER_PREFIX, tok(9), items, tok(3)),
            build_prompt(ITEM_PREFIX, tok(5), items[:3], tok(4), notation=tok(2)),
            build_prompt(ITEM_PREFIX, tok(6), items[1:], tok(2))]  # item-as-prefix with an empty head


@pytest.fixture(scope="module")
def model(random_decoder):
    spec = dataclasses.replace(PRESETS["tiny-bat"], vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return random_decoder(spec, 0, 0.1)


def test_mask_mod_is_the_visibility_rule():
    prompts = _prompts(1)
    ctx = FlexBipartiteContext(prompts)
    t = int(ctx.offsets[-1])
    q, k = torch.arange(t)[:, None].expand(t, t), torch.arange(t)[None, :].expand(t, t)
    got = ctx.mask_mod(0, 0, q, k)
    want = torch.zeros(t, t, dtype=torch.bool)
    for r, p in enumerate(prompts):
        a, b = int(ctx.offsets[r]), int(ctx.offsets[r + 1])
        want[a:b, a:b] = torch.from_numpy(p.visibility())
    assert torch.equal(got, want)


def test_flex_attention_equals_the_masked_reference():
    prompts = _prompts(2)
    ctx = FlexBipartiteContext(prompts)
    t = int(ctx.offsets[-1])
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(t, 4, 16, generator=g), torch.randn(t, 2, 16, generator=g), torch.randn(t, 2, 16, generator=g)
    allowed = ctx.mask_mod(0, 0, torch.arange(t)[:, None], torch.arange(t)[None, :])
    assert torch.allclose(ctx.attend(0, q, k, v), reference_attention(q, k, v, allowed), atol=1e-5)


@torch.no_grad()
def test_flex_forward_equals_reference_and_fast_path(model):
    prompts = _prompts(3)
    ctx = FlexBipartiteContext(prompts)
    hidden = model(ctx.input_ids, ctx.positions, ctx)
    fast = BipartiteBatchContext([BipartiteRequest(p) for p in prompts])
    h_fast = model(fast.input_ids, fast.positions, fast)
    for r, p in enumerate(prompts):
        ref, _ = reference_forward(model, p)
        a, b = int(ctx.offsets[r]), int(ctx.offsets[r + 1])
        assert torch.allclose(hidden[a:b], ref, atol=1e-5)
        assert torch.allclose(hidden[ctx.last_index(r)], h_fast[fast.last_index(r)], atol=1e-5)


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_flex_on_gpu_equals_reference(model):
    import copy

    gpu_model = copy.deepcopy(model).cuda()  # the CPU fixture stays read-only
    prompts = _prompts(4)
    ctx = FlexBipartiteContext(prompts, device="cuda", compiled=True)
    hidden = gpu_model(ctx.input_ids, ctx.positions, ctx).cpu()
    for r, p in enumerate(prompts):
        ref, _ = reference_forward(model, p)
        a, b = int(ctx.offsets[r]), int(ctx.offsets[r + 1])
        assert torch.allclose(hidden[a:b], ref, atol=1e-4)
