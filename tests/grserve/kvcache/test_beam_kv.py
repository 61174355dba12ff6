"""Beam KV: exact sizing, reorder by parent equals an out-of-place gather for any parent vector."""

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grserve.kvcache.beam import BeamKV


def two_pass_inplace_reorder(rows: torch.Tensor, parents: list[int]) -> None:
    """The paper's in-place reorder with direction indices (xGR §5.1), on dim 0 of ``rows``.

    Pass 1 does the "upward" writes (parent[i] > i) top to bottom, pass 2 the "downward" writes (parent[i] < i)
    bottom to top. Equal to the gather ``rows[i] = old[parents[i]]`` only when ``parents`` is non-decreasing
    (new beams ordered by parent); callers must sort the selected beams by parent first.
    """
    n = len(parents)
    for i in range(n):
        if parents[i] > i:
            rows[i].copy_(rows[parents[i]])
    for i in reversed(range(n)):
        if parents[i] < i:
            rows[i].copy_(rows[parents[i]])


def make_kv(lens=(5, 9), bw=4, nd=3):
    return BeamKV(num_layers=2, num_kv_heads=2, head_dim=4, prompt_lens=list(lens), beam_width=bw, decode_steps=nd)


def test_sizes_are_exactly_prompt_plus_bw_times_nd():
    kv = make_kv((5, 9), bw=4, nd=3)
    b_tok = 2 * 2 * 2 * 4 * 4  # 2 (K,V) · layers · Hkv · D · fp32 bytes
    assert kv.bytes_per_token == b_tok
    assert kv.request_nbytes(0) == (5 + 4 * 3) * b_tok
    assert kv.request_nbytes(1) == (9 + 4 * 3) * b_tok
    assert kv.nbytes() == sum(kv.request_nbytes(r) for r in range(2))
    assert kv.unshared_k.shape == (2, 8, 3, 2, 4)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reorder_equals_gather_for_any_parents(data):
    r, bw = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))
    kv = make_kv([3] * r, bw=bw)
    kv.unshared_k.copy_(torch.randn_like(kv.unshared_k))
    kv.unshared_v.copy_(torch.randn_like(kv.unshared_v))
    parents = torch.tensor(data.draw(st.lists(st.integers(0, r * bw - 1), min_size=r * bw, max_size=r * bw)))
    expect_k, expect_v = kv.unshared_k[:, parents].clone(), kv.unshared_v[:, parents].clone()
    ptr = kv.unshared_k.data_ptr()
    kv.reorder(parents)
    assert torch.equal(kv.unshared_k, expect_k) and torch.equal(kv.unshared_v, expect_v)
    assert kv.unshared_k.data_ptr() == ptr  # in place, no reallocation


def test_two_pass_direction_reorder_exact_for_every_monotone_mapping():
    """The paper's two-pass scheme equals the gather for every non-decreasing parent vector (BW ≤ 6)."""
    for bw in range(1, 7):
        base = torch.arange(bw, dtype=torch.float64)[:, None].repeat(1, 2)
        for parents in itertools.combinations_with_replacement(range(bw), bw):
            rows = base.clone()
            two_pass_inplace_reorder(rows, list(parents))
            assert torch.equal(rows, base[list(parents)]), parents


def test_two_pass_reorder_precondition_is_real():
    """Unsorted parents break the in-place scheme: the test above really guards the ordering precondition."""
    base = torch.arange(3, dtype=torch.float64)[:, None]
    rows = base.clone()
    two_pass_inplace_reorder(rows, [2, 0, 0])
    assert not torch.equal(rows, base[[2, 0, 0]])
