"""Masked top-k/expand of one beam step on the device: trie mask, log-softmax, per-beam top-K, beam score added.

For beam row i sitting at trie node ``nodes[i]`` (−1: dead) with cumulative score ``scores[i]``, over the level's
logits [B, C]: gather the logits of the node's valid children only (``DeviceTrie.children``: the sparse mask, no
[B, C] mask buffer and no host round trip), normalise them (``renormalized``: log-softmax over the valid children,
which equals the masked log-softmax over C; ``hf``: minus the full-vocabulary LSE), take the top k, add the beam's
score. Returns fixed-shape candidates (values [B, k], codes [B, k], child nodes [B, k]); a beam with fewer than k
valid children gets −inf candidates with node −1 after its valid ones.

``masked_topk_expand`` is the torch path and the reference of ``grserve.kernels.masked_topk``.
"""

from __future__ import annotations

import torch

from grserve.search.device_trie import DeviceTrie


def masked_topk_expand(logits: torch.Tensor, trie: DeviceTrie, level: int, nodes: torch.Tensor,
                       scores: torch.Tensor, k: int, full_lse: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    child_codes, child_nodes, valid = trie.children(level, nodes)
    z = logits.float().gather(1, child_codes).masked_fill_(~valid, float("-inf"))
    if full_lse is None:
        z = z - torch.logsumexp(z, dim=1, keepdim=True)
    else:
        z = z - full_lse[:, None]
    z = z.nan_to_num_(nan=float("-inf"), neginf=float("-inf"))  # no valid child: −inf − (−inf)
    v, j = torch.topk(z, k, dim=1)
    return v + scores[:, None], child_codes.gather(1, j), child_nodes.gather(1, j)


def masked_topk_expand_backend(name: str):
    """The implementation of ``--attention-backend`` (the Triton kernel for ``triton``, else the torch path)."""
    if name != "triton":
        return masked_topk_expand
    from grserve.kernels.masked_topk import masked_topk_expand_triton

    def run(logits, trie: DeviceTrie, level, nodes, scores, k, full_lse=None):
        return masked_topk_expand_triton(logits, nodes, trie.indptr[level], trie.codes[level],
                                         trie.max_children[level], scores, k, full_lse)

    return run
