"""Candidate scoring (BAT §2): the discriminant (last) token's logits over each candidate's identifier token,
softmax over the N candidates, top-k.

    z = W_out h_T;   s_i = exp(z[v_i]) / Σ_j exp(z[v_j]);   TopK_i s_i

Only the N identifier rows of ``W_out`` are used for the ranking (an [N, H] product instead of the full
vocabulary). Ties keep the candidates' request order (stable sort), so the result is deterministic.

``s_i`` depends on the other candidates of the request, so it cannot be compared across requests or thresholded.
Beside it each candidate gets its identifier token's log-probability over the whole vocabulary,
``log p(v_i) = z[v_i] − logsumexp(z)`` (``full_lse`` = logsumexp(z), one [V, H] product per request): it depends on
the user and the item only, so it is comparable across requests and candidate lists. Both give the same order.
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
    logprobs: list[float] | None = None  # full-vocabulary log-probability of each candidate in ``order``


def identifier_logits(hidden_last: torch.Tensor, lm_head_weight: torch.Tensor, identifiers: torch.Tensor) -> torch.Tensor:
    """hidden_last [H], lm_head_weight [V, H], identifiers int64 [N] → z[v_i] [N] (fp32)."""
    w = lm_head_weight.index_select(0, identifiers)
    return F.linear(hidden_last.to(w.dtype), w).float()


def full_vocab_lse(hidden_last: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
    """logsumexp of the logits over the whole vocabulary: hidden [..., H] → [...] (fp32)."""
    return torch.logsumexp(F.linear(hidden_last.to(lm_head_weight.dtype), lm_head_weight).float(), dim=-1)


def score_candidates(hidden_last: torch.Tensor, lm_head_weight: torch.Tensor, identifiers: torch.Tensor,
                     top_k: int, full_lse: torch.Tensor | float | None = None) -> RankedCandidates:
    z = identifier_logits(hidden_last, lm_head_weight, identifiers)
    s = torch.softmax(z, dim=0)
    k = max(1, min(int(top_k), int(s.shape[0])))
    order = torch.sort(s, descending=True, stable=True).indices[:k]
    logprobs = (z[order] - full_lse).tolist() if full_lse is not None else None
    return RankedCandidates(order.tolist(), s[order].tolist(), s.tolist(), logprobs)
