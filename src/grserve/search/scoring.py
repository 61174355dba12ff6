"""Masked log-softmax under the two scoring conventions.

``renormalized`` (xGR, the default): the additive item mask is applied *before* the softmax, so each step's
log-probabilities renormalise over the valid tokens: log p(v) = z_v − logsumexp_{u valid} z_u.

``hf`` (HF transformers ``prefix_allowed_tokens_fn``): log_softmax over the *full vocabulary* first, then the
invalid tokens are set to −inf: log p(v) = z_v − logsumexp_{u in vocab} z_u. Scores are then not normalised over
the catalog, and an item's score depends on how much mass the model puts outside the valid set.

Both run in place on a reused buffer. A row with no valid token becomes all −inf (never NaN).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def masked_log_softmax_(
    logits: torch.Tensor, mask: torch.Tensor, lse: torch.Tensor, full_vocab_lse: torch.Tensor | None = None
) -> torch.Tensor:
    """In place. logits [B, C] (one level's token range), mask [B, C] or [C] (0 / −inf), lse [B, 1] scratch.

    With ``full_vocab_lse`` [B, 1] given, uses the ``hf`` convention; else ``renormalized``.
    """
    if full_vocab_lse is None:
        logits.add_(mask)
        torch.logsumexp(logits, dim=-1, keepdim=True, out=lse)
        logits.sub_(lse)
    else:
        logits.sub_(full_vocab_lse)
        logits.add_(mask)
    return logits.nan_to_num_(nan=NEG_INF, neginf=NEG_INF)  # torch would turn −inf into the lowest finite value
