"""Triton sources of the staged beam attention (imported only by ``beam_attention`` when a kernel is launched)."""

import triton
import triton.language as tl


@triton.jit
def unshared_stage_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, T, scale,
                          sq0, sq1, sk0, sk1, sk2, sv0, sv1, sv2, so0, so1,
                          H_Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                          G_BLOCK: tl.constexpr, D_BLOCK: tl.constexpr, T_BLOCK: tl.constexpr):
    """One program per (beam, KV head): the G query heads of the group against the beam's T decoded tokens."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_BLOCK)
    d = tl.arange(0, D_BLOCK)
    t = tl.arange(0, T_BLOCK)
    gm = g < G
    dm = d < D
    tm = t < T
    head = h * G + g
    q = tl.load(q_ptr + b * sq0 + head[:, None] * sq1 + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
    kv_mask = tm[:, None] & dm[None, :]
    k = tl.load(k_ptr + b * sk0 + t[:, None] * sk1 + h * sk2 + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b * sv0 + t[:, None] * sv1 + h * sv2 + d[None, :], mask=kv_mask, other=0.0)
    s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale  # [G, T]
    s = tl.where(tm[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    den = tl.sum(p, axis=1)
    o = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1) / den[:, None]  # [G, D]
    tl.store(o_ptr + b * so0 + head[:, None] * so1 + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=gm[:, None] & dm[None, :])
    tl.store(lse_ptr + b * H_Q + head, m + tl.log(den), mask=gm)


@triton.jit
def shared_stage_kernel(q_ptr, k_ptr, v_ptr, lens_ptr, o_ptr, lse_ptr, scale,
                        sq0, sq1, sk0, sk1, sk2, sv0, sv1, sv2, so0, so1,
                        BW: tl.constexpr, H_Q: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_BLOCK: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One program per (request, KV head, block of BLOCK_M beam×group queries): flash-decoding over the request's
    first ``lens[r]`` shared keys (the padding after them is never read), online softmax, LSE out.

    ``UPCAST``: both products in fp32 (the CPU interpreter, whose ``tl.dot`` mishandles bf16/fp16 operands);
    on a GPU the products take the input dtype with fp32 accumulation."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < BW * G
    beam = r * BW + offs_m // G
    head = h * G + offs_m % G
    d = tl.arange(0, D_BLOCK)
    dm = d < D
    q = tl.load(q_ptr + beam[:, None] * sq0 + head[:, None] * sq1 + d[None, :], mask=mm[:, None] & dm[None, :],
                other=0.0)
    n_keys = tl.load(lens_ptr + r)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D_BLOCK), tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nm = offs_n < n_keys
        kv_mask = nm[:, None] & dm[None, :]
        k = tl.load(k_ptr + r * sk0 + h * sk1 + offs_n[:, None] * sk2 + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + r * sv0 + h * sv1 + offs_n[:, None] * sv2 + d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(o_ptr + beam[:, None] * so0 + head[:, None] * so1 + d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=mm[:, None] & dm[None, :])
    tl.store(lse_ptr + beam * H_Q + head, lse, mask=mm)
