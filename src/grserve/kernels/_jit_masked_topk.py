"""Triton source of the fused trie mask + log-softmax + per-beam top-K + expand (imported on first launch)."""

import triton
import triton.language as tl


@triton.jit
def masked_topk_expand_kernel(logits_ptr, s_logits, nodes_ptr, indptr_ptr, codes_ptr, scores_ptr, full_lse_ptr,
                              out_v_ptr, out_code_ptr, out_node_ptr,
                              K: tl.constexpr, W_BLOCK: tl.constexpr, HF: tl.constexpr):
    """One program per beam row: gather the logits of the beam's valid children (CSR of its trie node), normalise
    them (renormalized: over the valid children; hf: by the full-vocabulary LSE), then K rounds of
    "largest value, lowest index among equals" → candidates (beam score + log-prob, code, child node)."""
    row = tl.program_id(0)
    node = tl.load(nodes_ptr + row)
    alive = node >= 0
    safe = tl.where(alive, node, 0)
    start = tl.load(indptr_ptr + safe)
    count = tl.where(alive, tl.load(indptr_ptr + safe + 1) - start, 0)
    j = tl.arange(0, W_BLOCK)
    valid = j < count
    code = tl.load(codes_ptr + start + j, mask=valid, other=0)
    z = tl.load(logits_ptr + row * s_logits + code, mask=valid, other=float("-inf")).to(tl.float32)
    if HF:
        z = z - tl.load(full_lse_ptr + row)
    else:
        m = tl.max(z, axis=0)
        m_safe = tl.where(count > 0, m, 0.0)
        den = tl.sum(tl.where(valid, tl.exp(z - m_safe), 0.0), axis=0)
        z = z - (m_safe + tl.log(tl.where(count > 0, den, 1.0)))
    z = tl.where(valid, z, float("-inf"))
    base = tl.load(scores_ptr + row)
    taken = j < 0
    for i in range(K):
        zz = tl.where(taken, float("-inf"), z)
        best = tl.max(zz, axis=0)
        idx = tl.min(tl.where((zz == best) & (taken == 0), j, W_BLOCK), axis=0)
        taken = taken | (j == idx)
        ok = idx < count
        tl.store(out_v_ptr + row * K + i, best + base)
        tl.store(out_code_ptr + row * K + i, tl.sum(tl.where(j == idx, code, 0), axis=0))
        tl.store(out_node_ptr + row * K + i, tl.where(ok, start + idx, -1))
