"""The masked top-k/expand of a beam step in Triton (xGR §6.1 + the per-beam half of §6.2), one program per beam.

Reference: ``grserve.search.masked_topk.masked_topk_expand`` (same outputs; within a beam, equal values are taken
lowest child index first; −inf candidates beyond a beam's valid children carry node −1).
"""

from __future__ import annotations

import torch


def masked_topk_expand_triton(logits: torch.Tensor, nodes: torch.Tensor, indptr: torch.Tensor, codes: torch.Tensor,
                              max_children: int, scores: torch.Tensor, k: int,
                              full_lse: torch.Tensor | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, C] (unit last stride), nodes int64 [B], trie CSR (indptr, codes), scores fp32 [B], full_lse
    fp32 [B] or None → (values fp32 [B, k], codes int64 [B, k], child nodes int64 [B, k])."""
    from grserve.kernels._jit_masked_topk import masked_topk_expand_kernel

    b = logits.shape[0]
    out_v = torch.empty(b, k, dtype=torch.float32, device=logits.device)
    out_c = torch.empty(b, k, dtype=torch.int64, device=logits.device)
    out_n = torch.empty(b, k, dtype=torch.int64, device=logits.device)
    w_block = max(2, 1 << (max_children - 1).bit_length())
    lse = scores if full_lse is None else full_lse  # a placeholder pointer when unused
    masked_topk_expand_kernel[(b,)](logits, logits.stride(0), nodes, indptr, codes, scores, lse, out_v, out_c, out_n,
                                    K=k, W_BLOCK=w_block, HF=full_lse is not None)
    return out_v, out_c, out_n
