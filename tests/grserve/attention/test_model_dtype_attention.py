"""Attention at the model's dtype (issue 43 item 3): a bf16 model keeps its K/V cache, the decode staging buffer
and its queries in bf16, and the paged attention (``HybridPagedContext``: lone prefill, chunked prefill over a
cached prefix, pure decode staged by append or rebuild and unstaged) runs the CPU SDPA kernel on bf16 inputs,
which computes the scores and the softmax in fp32 and accumulates P·V in fp32 (the probabilities rounded to bf16
as its GEMM operand), rounding the output once.

Checked against the fp32/fp64 reference on the same bf16-rounded inputs: every output element within
``2⁻⁸·(|ref| + Σ p·|v|)`` (the output's own bf16 rounding is ≤ 2⁻⁹·|ref|; the kernel rounds the probabilities
to bf16 for the P·V product, ≤ 2⁻⁹·Σ p·|v|). The adversarial case is a long
context attended almost uniformly with values near 1: an attention that accumulated P·V in bf16 (per token, or
per 64-key block) loses the small terms and misses that bound by far (shown below on the same data, so the test
can fail).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from grserve.attention.decode_staging import DecodeStaging
from grserve.attention.hybrid import HybridPagedContext, SeqSlice
from grserve.kvcache.blocks import BlockPool, HybridCacheStorage

HQ, HKV, D = 4, 2, 64
BF16 = torch.bfloat16


def _tol(ref: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """The output's bf16 rounding (≤ 2⁻⁹·|ref|) and the probabilities' rounding to bf16 before P·V
    (≤ 2⁻⁹·Σ p·|v|), each with a factor 2 of slack; fp32 sums add far less."""
    return 2.0 ** -8 * (ref.abs() + mass)


def _reference(q, k, v, qpos):
    """fp64 attention of queries at positions ``qpos`` over keys 0 … qpos (GQA by repeating K/V heads): the
    output and Σ_t p_t·|v_t| (what the tolerance scales with)."""
    g = HQ // HKV
    kk = k.double().repeat_interleave(g, dim=1)  # [T, HQ, D]
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->nht", q.double(), kk) / D ** 0.5
    t = torch.arange(k.shape[0])
    s = s.masked_fill(t[None, None, :] > qpos[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("nht,thd->nhd", p, vv).float(), torch.einsum("nht,thd->nhd", p, vv.abs()).float()


def _data(gen, n, adversarial):
    if adversarial:  # near-uniform attention over values near 1: the small P·V terms are what bf16 sums lose
        q = torch.randn(n, HQ, D, generator=gen) * 1e-3
        k = torch.randn(n, HKV, D, generator=gen)
        v = 1 + 0.01 * torch.randn(n, HKV, D, generator=gen)
    else:
        q, k, v = (torch.randn(n, h, D, generator=gen) for h in (HQ, HKV, HKV))
    return q.to(BF16), k.to(BF16), v.to(BF16)


@pytest.mark.parametrize("adversarial", [False, True])
@pytest.mark.parametrize("staged", [None, "rebuild", "append"])
def test_bf16_paged_attention_is_fp32_accumulated(adversarial, staged):
    gen = torch.Generator().manual_seed(int(adversarial) + 7 * len(staged or ""))
    lens = [1500, 700, 33]  # prompt lengths; the first two prefilled in two chunks
    pool = BlockPool.for_model(512, 16, HKV * D, HKV * D)
    storage = HybridCacheStorage(pool, 1, HKV * D, HKV * D, dtype=BF16)
    tables = [pool.reserve(i, n + 2, "kv") for i, n in enumerate(lens)]
    data = [_data(gen, n + 2, adversarial) for n in lens]  # q, k, v of every position (prompt + 2 decode steps)

    def run(slices, staging=None, keys=None):
        ctx = HybridPagedContext(storage, slices, None, HKV, D, staging, keys)
        q = torch.cat([data[i][0][s.start:s.start + s.num_new] for i, s in enumerate(slices)])
        k = torch.cat([data[i][1][s.start:s.start + s.num_new] for i, s in enumerate(slices)])
        v = torch.cat([data[i][2][s.start:s.start + s.num_new] for i, s in enumerate(slices)])
        out = ctx.attend(0, q, k, v)
        ctx.finish()
        assert out.dtype == BF16
        off = 0
        for i, s in enumerate(slices):
            qq, kk, vv = data[i]
            pos = torch.arange(s.start, s.start + s.num_new)
            ref, mass = _reference(qq[pos], kk[: s.start + s.num_new], vv[: s.start + s.num_new], pos)
            got = out[off: off + s.num_new].float()
            off += s.num_new
            err = (got - ref).abs()
            assert bool((err <= _tol(ref, mass)).all()), f"request {i}: max error {float(err.max()):.3g}"

    half = [n // 2 for n in lens[:2]]
    run([SeqSlice(tables[0], 0, half[0]), SeqSlice(tables[1], 0, half[1])])  # a fresh prefill pass
    run([SeqSlice(tables[0], half[0], lens[0] - half[0]), SeqSlice(tables[1], half[1], lens[1] - half[1]),
         SeqSlice(tables[2], 0, lens[2])])  # chunked prefill over a cached prefix, packed with a fresh prompt
    staging = DecodeStaging(1, HKV, D, dtype=BF16, max_bytes=1 << 26) if staged else None
    keys = tuple((i, 0) for i in range(3)) if staged else None
    if staged == "append":  # the buffer already holds every request's prompt (as after an earlier decode step)
        staging.plan(keys, lens)
        staging.commit(keys, lens)
        for i, n in enumerate(lens):
            staging.k[0][i, :, :n] = data[i][1][:n].transpose(0, 1)
            staging.v[0][i, :, :n] = data[i][2][:n].transpose(0, 1)
    for step in range(2):  # two decode steps
        run([SeqSlice(t, n + step, 1) for t, n in zip(tables, lens)], staging, keys)


def test_a_bf16_accumulated_attention_would_fail_the_bound():
    """The bound above tells fp32 accumulation from bf16: the same adversarial data, P·V summed in bf16 per
    64-key block, misses it; the CPU SDPA kernel on the bf16 inputs meets it."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = _data(gen, 3000, adversarial=True)
    qpos = torch.tensor([2999])
    ref, mass = _reference(q[-1:], k, v, qpos)
    ref, tol = ref[0], _tol(ref, mass)[0]  # [HQ, D]
    got = F.scaled_dot_product_attention(q[-1:].transpose(0, 1)[:, None], k.transpose(0, 1)[:, None].repeat_interleave(
        HQ // HKV, dim=0), v.transpose(0, 1)[:, None].repeat_interleave(HQ // HKV, dim=0))[:, 0, 0].float()
    assert bool(((got - ref).abs() <= tol).all())
    s = torch.einsum("hd,thd->ht", q[-1].float(), k.float().repeat_interleave(HQ // HKV, dim=1)) / D ** 0.5
    p = torch.softmax(s, dim=-1).to(BF16)
    vv = v.repeat_interleave(HQ // HKV, dim=1)  # [T, HQ, D]
    acc = torch.zeros(HQ, D, dtype=BF16)
    for t0 in range(0, 3000, 64):
        acc = acc + torch.einsum("ht,thd->hd", p[:, t0:t0 + 64].float(), vv[t0:t0 + 64].float()).to(BF16)
    assert not bool(((acc.float() - ref).abs() <= tol).all())
