"""The fast path's Triton kernels = their torch references, on CPU under TRITON_INTERPRET=1 (tiny grids), and the
torch paths = the existing search / attention references they replace."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from grserve.attention.padded import shared_stage_padded
from grserve.attention.staged import shared_stage_reference, unshared_stage
from grserve.catalog import Catalog
from grserve.search.device_trie import DeviceTrie
from grserve.search.masked_topk import masked_topk_expand
from grserve.search.scoring import masked_log_softmax_

triton = pytest.importorskip("triton")
from grserve.kernels import triton_available  # noqa: E402

needs_triton = pytest.mark.skipif(not triton_available("cpu"), reason="CPU tensors need TRITON_INTERPRET=1")


@pytest.fixture(scope="module")
def catalog():
    rng = np.random.default_rng(1)
    sids = np.array(list(itertools.product(range(4), range(5), range(6))))
    rows = np.sort(rng.choice(len(sids), 50, replace=False))
    return Catalog.from_arrays(np.arange(50), sids[rows], codebook_sizes=(4, 5, 6))


def _shared_ref(q, k, v, lens):
    """Per request, the existing ``shared_stage_reference`` over its unpadded keys."""
    r = k.shape[0]
    bw = q.shape[0] // r
    outs = [shared_stage_reference(q[i * bw:(i + 1) * bw], k[i, :, :n], v[i, :, :n]) for i, n in enumerate(lens)]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs])


def test_padded_shared_stage_equals_the_staged_reference():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3 * 4, 6, 8, generator=g, dtype=torch.float64)
    k = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 20, 8, generator=g, dtype=torch.float64)
    lens = [20, 7, 0]
    bias = torch.where(torch.arange(20)[None, :] < torch.tensor(lens)[:, None], 0.0, float("-inf"))
    o, lse = shared_stage_padded(q, k, v, bias[:, None, None, :].double())
    o_ref, lse_ref = _shared_ref(q, k, v, lens)
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin], lse_ref[fin], atol=1e-12)
    assert torch.all(o[8:] == 0)  # an empty request: o = 0, lse = −inf (drops out of the merge)


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # bf16: the output is rounded once (2^-8 relative)


@needs_triton
@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (3, torch.float32), (2, torch.bfloat16)])
def test_unshared_stage_kernel_equals_torch(t, dtype):
    from grserve.kernels.beam_attention import unshared_stage_triton

    g = torch.Generator().manual_seed(t)
    q = torch.randn(3, 4, 16, generator=g).to(dtype)
    buf_k = torch.randn(3, 4, 2, 16, generator=g).to(dtype)  # [B, ND, Hkv, D]: the kernel reads a slot slice
    buf_v = torch.randn(3, 4, 2, 16, generator=g).to(dtype)
    o, lse = unshared_stage_triton(q, buf_k[:, :t], buf_v[:, :t])
    o_ref, lse_ref = unshared_stage(q.float(), buf_k[:, :t].float(), buf_v[:, :t].float())
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.allclose(o.float(), o_ref, atol=TOL[dtype]) and torch.allclose(lse, lse_ref, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_stage_kernel_equals_torch(dtype):
    from grserve.kernels.beam_attention import shared_stage_triton

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2 * 4, 4, 16, generator=g).to(dtype)  # R=2, BW=4, Hq=4, Hkv=2: 8 queries per KV head
    k = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    v = torch.randn(2, 2, 40, 16, generator=g).to(dtype)
    for lens in ([37, 40], [17, 0]):
        o, lse = shared_stage_triton(q, k, v, torch.tensor(lens), block_n=16)
        o_ref, lse_ref = _shared_ref(q.float(), k.float(), v.float(), lens)
        assert torch.allclose(o.float(), o_ref, atol=TOL[dtype])
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        fin = torch.isfinite(lse_ref)
        assert torch.allclose(lse[fin], lse_ref[fin], atol=1e-5)


def _beams(catalog, seed):
    """Beam rows sitting at level-1 and level-2 trie nodes (some dead), their scores and level logits."""
    rng = np.random.default_rng(seed)
    out = []
    for level in (1, 2):
        n_nodes = catalog.trie.num_nodes(level)
        nodes = rng.integers(-1, n_nodes, 6)
        nodes[0] = -1
        scores = torch.from_numpy(rng.normal(size=6).astype(np.float32))
        scores[1] = float("-inf")
        logits = torch.from_numpy(rng.normal(size=(6, catalog.codebook_sizes[level])).astype(np.float32))
        out.append((level, torch.from_numpy(nodes), scores, logits))
    return out


@pytest.mark.parametrize("hf", [False, True])
def test_masked_topk_equals_the_item_mask_path(catalog, hf):
    """The device path (gather the valid children) = ItemMask.dense + masked_log_softmax_ + topk over C."""
    trie = DeviceTrie(catalog)
    for level, nodes, scores, logits in _beams(catalog, 3):
        full = torch.randn(6) + 5.0 if hf else None
        k = min(3, trie.max_children[level])
        v, codes, child = masked_topk_expand(logits, trie, level, nodes, scores, k, full)
        ref = logits.clone()
        mask = catalog.mask.dense(level, nodes.numpy())
        masked_log_softmax_(ref, mask, torch.empty(6, 1), full[:, None] if hf else None)
        rv, ri = torch.topk(ref, k, dim=1)
        rv = rv + scores[:, None]
        fin = rv > -1e30  # masked_log_softmax_ leaves invalid tokens at the lowest float, the device path at −inf
        assert torch.equal(fin, torch.isfinite(v))
        assert torch.allclose(v[fin], rv[fin], atol=1e-5) and torch.equal(codes[fin], ri[fin])
        expect = catalog.trie.step(level, np.repeat(nodes.numpy(), k), codes.reshape(-1).numpy()).reshape(6, k)
        assert np.array_equal(child[fin].numpy(), expect[fin.numpy()])
        assert torch.all(child[~torch.isfinite(v) & (nodes[:, None] < 0)] == -1)


@needs_triton
@pytest.mark.parametrize("hf", [False, True])
def test_masked_topk_kernel_equals_torch(catalog, hf):
    from grserve.kernels.masked_topk import masked_topk_expand_triton

    trie = DeviceTrie(catalog)
    for level, nodes, scores, logits in _beams(catalog, 4):
        full = torch.randn(6) + 5.0 if hf else None
        k = trie.max_children[level]
        v, c, n = masked_topk_expand(logits, trie, level, nodes, scores, k, full)
        tv, tc, tn = masked_topk_expand_triton(logits, nodes, trie.indptr[level], trie.codes[level],
                                               trie.max_children[level], scores, k, full)
        fin = torch.isfinite(v)
        assert torch.equal(fin, torch.isfinite(tv))
        assert torch.allclose(tv[fin], v[fin], atol=1e-5)
        assert torch.equal(tc[fin], c[fin]) and torch.equal(tn[fin], n[fin])
        beyond = ~fin & torch.isfinite(scores)[:, None]  # −inf candidates of a live beam: past its children
        assert beyond.any() and torch.all(tn[beyond] == -1) and torch.all(n[beyond] == -1)
