"""Bipartite Attention (BAT §4) through FlexAttention: the visibility rule as a ``mask_mod``, not a dense mask.

For prompts packed into one flat stream (each: head, items, tail; ``BipartitePrompt.segment_ids``: −1 head, i item
i, N tail), query q may see key k iff both belong to the same prompt, k is not after q, and

    seg[k] == seg[q]  (causal within its own part)   or   seg[k] == −1  (everyone sees the head)
    or  q is a tail token  (the tail sees the head and every item)

which is exactly ``BipartitePrompt.visibility()`` (the flat order is head, items, tail, so "k not after q" holds
for every head → item / head, items → tail pair). ``torch.nn.attention.flex_attention`` turns the rule into a block
mask (fully masked blocks are skipped); on a GPU the call is ``torch.compile``d once (``compiled=True``), on CPU it
runs eagerly (the tests). ``FlexBipartiteContext`` is an ``AttentionContext`` for a packed forward of whole
prompts (no cached prefix), equal to ``MaskedPromptContext`` / ``BipartiteBatchContext`` (tests). Only torch APIs
present in torch 2.11 are used.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def bipartite_mask_mod(doc: torch.Tensor, seg: torch.Tensor, is_tail: torch.Tensor):
    """The BAT rule over packed tokens: doc [T] (prompt index), seg [T] (segment id), is_tail [T] bool."""

    def mask_mod(b, h, q, k):
        same_part = (seg[k] == seg[q]) | (seg[k] == -1) | is_tail[q]
        return (doc[q] == doc[k]) & (k <= q) & same_part

    return mask_mod


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBipartiteContext:
    """A packed forward of several whole ``BipartitePrompt``s with the BAT mask as a FlexAttention block mask."""

    def __init__(self, prompts: list, device: torch.device | str = "cpu", compiled: bool = False):
        from torch.nn.attention.flex_attention import create_block_mask

        segs = [p.segment_ids() for p in prompts]
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in segs])]).astype(np.int64)
        self.input_ids = torch.from_numpy(np.concatenate([p.tokens() for p in prompts])).to(device)
        self.positions = torch.from_numpy(np.concatenate([p.positions() for p in prompts])).to(device)
        t = int(self.offsets[-1])
        doc = torch.from_numpy(np.repeat(np.arange(len(prompts)), [len(s) for s in segs])).to(device)
        seg = torch.from_numpy(np.concatenate(segs)).to(device)
        tail = torch.from_numpy(np.concatenate([s == len(p.items) for s, p in zip(segs, prompts)])).to(device)
        self.mask_mod = bipartite_mask_mod(doc, seg, tail)
        self.block_mask = create_block_mask(self.mask_mod, None, None, t, t, device=str(device))
        self.compiled = compiled

    def last_index(self, r: int) -> int:
        """Flat index of prompt r's discriminant (last) token."""
        return int(self.offsets[r + 1]) - 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, T, D]
        gqa = kh.shape[1] != qh.shape[1]
        if not self.compiled:
            out = flex_attention(qh, kh, vh, block_mask=self.block_mask, enable_gqa=gqa)
        else:
            # Inductor picks its flex-decoding template for short packed batches (T < 128), which found no valid
            # config for these shapes on torch 2.11 / H200 (NoValidChoicesError); a packed prefill is not a decode.
            out = _compiled_flex()(qh, kh, vh, block_mask=self.block_mask, enable_gqa=gqa,
                                   kernel_options={"FORCE_USE_FLEX_ATTENTION": True})
        return out[0].transpose(0, 1)
