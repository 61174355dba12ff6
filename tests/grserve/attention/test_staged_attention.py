"""Staged attention (shared + unshared + LSE merge) equals naive attention over the concatenation (fp64)."""

import pytest
import torch

from grserve.attention.reference import reference_attention
from grserve.attention.staged import (
    merge_states,
    shared_stage,
    shared_stage_reference,
    staged_attention,
    unshared_stage,
)


def naive_beam_attention(q, sk, sv, uk, uv):
    """Per beam: plain softmax attention over concat(shared [L], own unshared [T]) keys."""
    outs = []
    for b in range(q.shape[0]):
        k = torch.cat([sk.transpose(0, 1), uk[b]], dim=0)  # [L+T, Hkv, D]
        v = torch.cat([sv.transpose(0, 1), uv[b]], dim=0)
        allowed = torch.ones(1, k.shape[0], dtype=torch.bool)
        outs.append(reference_attention(q[b : b + 1], k, v, allowed))
    return torch.cat(outs)


@pytest.mark.parametrize("bw,hq,hkv,d,L,t", [(5, 8, 2, 16, 37, 3), (1, 4, 4, 8, 1, 1), (7, 6, 3, 4, 11, 0), (3, 8, 1, 32, 64, 2)])
def test_staged_equals_naive_fp64(bw, hq, hkv, d, L, t):
    g = torch.Generator().manual_seed(bw * 1000 + L)
    f = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 2
    q, sk, sv = f(bw, hq, d), f(hkv, L, d), f(hkv, L, d)
    uk, uv = f(bw, t, hkv, d), f(bw, t, hkv, d)
    out = staged_attention(q, sk, sv, uk, uv)
    ref = naive_beam_attention(q, sk, sv, uk, uv)
    assert (out - ref).abs().max().item() <= 1e-10


def test_empty_unshared_stage_is_exact_noop():
    g = torch.Generator().manual_seed(0)
    q, sk, sv = (torch.randn(4, 8, 16, generator=g, dtype=torch.float64) for _ in range(1)), None, None
    q = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)
    sk, sv = torch.randn(2, 9, 16, generator=g, dtype=torch.float64), torch.randn(2, 9, 16, generator=g, dtype=torch.float64)
    empty = torch.empty(4, 0, 2, 16, dtype=torch.float64)
    o_u, lse_u = unshared_stage(q, empty, empty)
    assert torch.isneginf(lse_u).all() and (o_u == 0).all()
    o_s, lse_s = shared_stage(q, sk, sv)
    merged, lse = merge_states(o_s, lse_s, o_u, lse_u)
    assert torch.equal(merged, o_s) and torch.equal(lse, lse_s)


def test_merge_is_associative_split_anywhere():
    """Splitting the key set at any point and merging gives the same result (online softmax property)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 20, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 20, 8, generator=g, dtype=torch.float64)
    full, lse_full = shared_stage(q, k, v)
    for cut in (1, 7, 19):
        a = shared_stage(q, k[:, :cut], v[:, :cut])
        b = shared_stage(q, k[:, cut:], v[:, cut:])
        merged, lse = merge_states(*a, *b)
        assert (merged - full).abs().max() <= 1e-12 and (lse - lse_full).abs().max() <= 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_shared_stage_equals_reference(dtype, tol):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 8, 32, generator=g).to(dtype)
    k, v = torch.randn(2, 50, 32, generator=g).to(dtype), torch.randn(2, 50, 32, generator=g).to(dtype)
    o, lse = shared_stage(q, k, v)
    o_ref, lse_ref = shared_stage_reference(q, k, v)
    assert (o - o_ref).abs().max() <= tol and (lse - lse_ref).abs().max() <= tol
