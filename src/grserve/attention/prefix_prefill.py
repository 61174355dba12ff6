"""Prefill after a cached prefix: the last n tokens of a prompt attend to the K/V of all L of its tokens, of which
the first L − n were loaded from the prefix cache (``kvcache/prefix_blocks.py``) and were never computed in this
batch. The one rule of both prefill contexts (``attention/beam_context.py``, ``attention/padded.py``); the reference
it is tested against is the prefill of the whole prompt (tests/grserve/engine/test_prefix_reuse.py).

``block_aligned_attention`` is the same attention run in query chunks aligned to the prefix cache's blocks (chunk
[s, s + B) against keys [0, s + B)): a row's result then depends only on its block's tokens and those before it,
never on the prompt's length or on where the computed part starts. torch's CPU SDPA rounds a row differently with
the sequence length it is called with; at fp32 that is below 1e-6, at bf16 a last-bit flip that the next layers
carry. With the prefix cache on, the retrieval prefill runs every prompt this way, so a prompt's K/V are the same
bits whichever prompt computed its cached blocks and whether they came from the cache or not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefix_causal_attention(q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor) -> torch.Tensor:
    """q [n, Hq, D]: the last n of a prompt's L tokens; sk/sv [Hkv, L, D] head-major: all L tokens' K/V (the first
    L − n from a prefix cache). Causal: query i sees keys 0 … L − n + i. With n = L this is the plain causal
    prefill (the same kernel call as before the prefix cache)."""
    n, L = q.shape[0], sk.shape[1]
    qr = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if n == L:
        o = F.scaled_dot_product_attention(qr, sk.unsqueeze(0), sv.unsqueeze(0), is_causal=True, enable_gqa=True)
    else:
        allowed = torch.arange(L, device=q.device)[None, :] <= torch.arange(L - n, L, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(qr, sk.unsqueeze(0), sv.unsqueeze(0), attn_mask=allowed, enable_gqa=True)
    return o[0].transpose(0, 1)


def block_aligned_attention(q: torch.Tensor, sk: torch.Tensor, sv: torch.Tensor, block: int) -> torch.Tensor:
    """``prefix_causal_attention`` in query chunks aligned to ``block`` (the module docstring): the last n of the
    L tokens, L − n a multiple of ``block`` (a prefix cache holds whole blocks)."""
    n, L = q.shape[0], sk.shape[1]
    start = L - n
    if start % block:
        raise ValueError(f"the cached prefix ({start} tokens) is not a multiple of the block ({block})")
    out = torch.empty_like(q)
    for s in range(start, L, block):
        e = min(s + block, L)
        out[s - start:e - start] = prefix_causal_attention(q[s - start:e - start], sk[:, :e], sv[:, :e])
    return out
