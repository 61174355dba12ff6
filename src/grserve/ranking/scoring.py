"""Candidate scoring (BAT §2): the discriminant (last) token's logits over each candidate's identifier token,
softmax over the N candidates, top-k.

    z = W_out h_T;   s_i = exp(z[v_i]) / Σ_j exp(z[v_j]);   TopK_i s_i

Only the N identifier rows of ``W_out`` are used (an [N, H] product instead of the full vocabulary).
Ties keep the candidates' request order (stable sort), so the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class RankedCandidates:
    order: list[int]  # candidate indices (request order), best first, length top_k
    scores: list[float]  # softmax probability of each candidate in ``order``
    all_scores: list[float]  # softmax probability of every candidate, in request order


def identifier_logits(hidden_last: torch.Tensor, lm_head_weight: torch.Tensor, identifiers: torch.Tensor) -> torch.Tensor:
    """hidden_last [H], lm_head_weight [V, H], identifiers int64 [N] → z[v_i] [N] (fp32)."""
    w = lm_head_weight.index_select(0, identifiers)
    return F.linear(hidden_last.to(w.dtype), w).float()


def score_candidates(hidden_last: torch.Tensor, lm_head_weight: torch.Tensor, identifiers: torch.Tensor,
                     top_k: int) -> RankedCandidates:
    z = identifier_logits(hidden_last, lm_head_weight, identifiers)
    s = torch.softmax(z, dim=0)
    k = max(1, min(int(top_k), int(s.shape[0])))
    order = torch.sort(s, descending=True, stable=True).indices[:k]
    return RankedCandidates(order.tolist(), s[order].tolist(), s.tolist())
