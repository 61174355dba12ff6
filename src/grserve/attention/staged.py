"""xAttention's staged computation (xGR §5.2): shared stage + unshared stage + log-sum-exp merge.

Every decode query of a request (one per beam) attends to the request's shared prompt KV and to its own beam's
unshared KV. The two stages are computed independently, each returning a *partial state*
``(o, lse)``: the output normalised within the stage and the log-sum-exp of the stage's scores. The merge is the
online-softmax rule (the paper's "local maxima and sums"; ``lse = m + log l`` in its notation):

    lse = logaddexp(lse_s, lse_u)
    out = exp(lse_s - lse) · o_s + exp(lse_u - lse) · o_u

An empty stage has ``lse = -inf`` and ``o = 0`` and drops out of the merge exactly.

Whatever the model dtype, the log-sum-exps are fp32 (each stage's scores are reduced in fp32) and the merge runs in
fp32, rounding the merged output to the model dtype once (issue 42: scores and merges stay fp32 in bf16). In fp32
these are the same operations as before.

The shared stage is one matrix-matrix product per KV head (all BW beam queries × the GQA group hit the same
keys) instead of BW matrix-vector products: this is where the prompt KV is read once per request, not per beam.
"""

from __future__ import annotations

import torch


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (bf16/fp16 → fp32; fp32 and fp64 as they are)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def shared_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All beams of one request against its shared prompt KV.

    q [B, Hq, D] (B beams), k/v [Hkv, L, D] (head-major shared cache) → o [B, Hq, D], lse [B, Hq].
    On CPU this runs PyTorch's fused flash-attention kernel, which also returns the log-sum-exp (one pass
    over the keys); elsewhere, and as the tested reference, ``shared_stage_reference``.
    """
    if q.device.type != "cpu" or k.shape[1] == 0:
        return shared_stage_reference(q, k, v)
    b, h_q, d = q.shape
    h_kv = k.shape[0]
    g = h_q // h_kv
    qg = q.view(b, h_kv, g, d).permute(1, 0, 2, 3).reshape(1, h_kv, b * g, d)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k.unsqueeze(0), v.unsqueeze(0))
    o = o.view(h_kv, b, g, d).permute(1, 0, 2, 3).reshape(b, h_q, d)
    lse = _wide(lse).view(h_kv, b, g).permute(1, 0, 2).reshape(b, h_q)  # fp32: the kernel's own
    return o, lse


def shared_stage_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``shared_stage`` with explicit matmuls: one Q[B·G × D]·Kᵀ[D × L] product per KV head."""
    b, h_q, d = q.shape
    h_kv = k.shape[0]
    g = h_q // h_kv
    if k.shape[1] == 0:
        return torch.zeros_like(q), q.new_full((b, h_q), float("-inf"), dtype=_wide(q).dtype)
    qg = q.view(b, h_kv, g, d).permute(1, 0, 2, 3).reshape(h_kv, b * g, d)
    scores = _wide(torch.bmm(qg, k.transpose(1, 2))).mul_(d**-0.5)  # [Hkv, B*G, L], fp32
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = scores.sub_(lse).exp_().to(v.dtype)
    o = torch.bmm(probs, v)  # [Hkv, B*G, D]
    o = o.view(h_kv, b, g, d).permute(1, 0, 2, 3).reshape(b, h_q, d)
    lse = lse.view(h_kv, b, g).permute(1, 0, 2).reshape(b, h_q)
    return o, lse


def unshared_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam against its own decoded tokens.

    q [B, Hq, D], k/v [B, T, Hkv, D] (T may be 0) → o [B, Hq, D], lse [B, Hq].
    """
    b, h_q, d = q.shape
    t, h_kv = k.shape[1], k.shape[2]
    if t == 0:
        return torch.zeros_like(q), q.new_full((b, h_q), float("-inf"), dtype=_wide(q).dtype)
    g = h_q // h_kv
    qg = q.view(b, h_kv, g, d)
    scores = _wide(torch.einsum("bhgd,bthd->bhgt", qg, k)).mul_(d**-0.5)  # [B, Hkv, G, T], fp32
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = scores.sub_(lse).exp_().to(v.dtype)
    o = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return o.reshape(b, h_q, d), lse.reshape(b, h_q)


def merge_states(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Online-softmax merge of two partial attention states over disjoint key sets: in fp32, the output rounded to
    ``o_a``'s dtype once, the log-sum-exp fp32."""
    lse_a, lse_b = _wide(lse_a), _wide(lse_b)
    lse = torch.logaddexp(lse_a, lse_b)
    # exp(-inf - (-inf)) would be NaN when both stages are empty; such rows keep weight 0.
    w_a = torch.nan_to_num(torch.exp(lse_a - lse), nan=0.0)
    w_b = torch.nan_to_num(torch.exp(lse_b - lse), nan=0.0)
    out = _wide(o_a) * w_a[..., None] + _wide(o_b) * w_b[..., None]
    return out.to(o_a.dtype), lse


def staged_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    unshared_k: torch.Tensor,
    unshared_v: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of one request's beams: q [B, Hq, D], shared [Hkv, L, D], unshared [B, T, Hkv, D]."""
    o_s, lse_s = shared_stage(q, shared_k, shared_v)
    o_u, lse_u = unshared_stage(q, unshared_k, unshared_v)
    out, _ = merge_states(o_s, lse_s, o_u, lse_u)
    return out
