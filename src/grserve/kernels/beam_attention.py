"""Staged beam attention in Triton (xGR §5.2): the unshared and the shared stage, each returning ``(o, lse)``.

Shapes follow ``grserve.attention.staged`` / ``grserve.attention.padded``; the LSE is fp32 whatever the input
dtype, and the accumulation is fp32 (bf16/fp16 inputs: the output is rounded once, at the end).
"""

from __future__ import annotations

import torch


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, 1 << (max(1, n) - 1).bit_length())


def unshared_stage_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], k/v [B, T, Hkv, D] (T ≥ 1; any strides with a unit last stride) → o [B, Hq, D], lse [B, Hq]."""
    from grserve.kernels._jit_beam_attention import unshared_stage_kernel

    b, hq, d = q.shape
    t, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, dtype=torch.float32, device=q.device)
    unshared_stage_kernel[(b, hkv)](
        q, k, v, o, lse, t, d**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1),
        H_Q=hq, G=g, D=d, G_BLOCK=_pow2(g, 2), D_BLOCK=_pow2(d, 16), T_BLOCK=_pow2(t, 2))
    return o, lse


def shared_stage_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                        block_m: int = 64, block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """q [R·BW, Hq, D] (request-major beams), k/v [R, Hkv, Lcap, D] padded shared KV, lens int [R] → o, lse [R·BW, Hq]."""
    from grserve.kernels._jit_beam_attention import shared_stage_kernel

    rows, hq, d = q.shape
    r, hkv = k.shape[0], k.shape[1]
    bw, g = rows // r, hq // hkv
    block_m = min(block_m, _pow2(bw * g, 16))
    o = torch.empty_like(q)
    lse = torch.empty(rows, hq, dtype=torch.float32, device=q.device)
    grid = (r, hkv, -(-bw * g // block_m))
    shared_stage_kernel[grid](
        q, k, v, lens, o, lse, d**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1),
        BW=bw, H_Q=hq, G=g, D=d, BLOCK_M=block_m, BLOCK_N=block_n, D_BLOCK=_pow2(d, 16),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=q.device.type == "cpu")
    return o, lse
