"""Reference attention: plain softmax attention with an explicit boolean visibility mask (GQA aware).

Slow and obviously correct; every fast attention path is tested against it.
"""

from __future__ import annotations

import torch


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [Nq, Hq, D], k/v [Nk, Hkv, D], allowed [Nq, Nk] bool → [Nq, Hq, D].

    A query row with no visible key returns zeros (never NaN).
    """
    n_q, h_q, d = q.shape
    h_kv = k.shape[1]
    group = h_q // h_kv
    k_rep = k.repeat_interleave(group, dim=1)  # [Nk, Hq, D]
    v_rep = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k_rep) * (d**-0.5)
    scores = scores.masked_fill(~allowed[None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)
    return torch.einsum("hqk,khd->qhd", probs, v_rep)
