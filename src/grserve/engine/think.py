"""Think-then-recommend: the model first writes free text (its reasoning) until it emits the layout's ``sid_begin``,
then the constrained SID beam search continues from that prefix on the same KV, in the same request.

    prompt ──prefill──► h ──► token = greedy / sampled (HF's warpers) ──► … until sid_begin, or
                                                     ``max_think_tokens`` tokens (then sid_begin is forced)
    the thought's KV (prompt + thought + sid_begin) becomes the request's ``shared_kv``; the beams start from the
    hidden state at ``sid_begin`` (``engine/retrieval.py``)

A layout without ``sid_begin`` (an LC-Rec index: bare ``<a_N><b_N><c_N>``) ends the thought at the model's own first
SID token instead: the first level-0 SID token it writes is not kept; the beams search that position, from the
hidden state that chose it (``max_think_tokens`` reached: from the last token written). That stage is HF
``generate(eos_token_id=<the level-0 SID tokens>)`` with the final SID token left out.

The text stage is exactly HF ``generate(prompt, max_new_tokens=max_think_tokens, eos_token_id=sid_begin, …)``:
greedy (``temperature`` 0: argmax, lowest id on ties) or sampled with HF's own order of warpers (temperature, top-k,
top-p with ``min_tokens_to_keep`` 1) and one ``torch.multinomial`` draw per token from a generator seeded with
``seed`` — the stream ``torch.manual_seed(seed)`` gives HF. The second stage equals HF ``generate(num_beams=BW,
prefix_allowed_tokens_fn=<catalog trie>)`` on prompt + thought + sid_begin (``tests/grserve/server/test_openai_beams.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grserve.attention.context import SequenceKVContext
from grserve.attention.prefix_prefill import block_aligned_attention, prefix_causal_attention
from grserve.kvcache.prefix_blocks import PrefixBlockCache, PrefixMatch
from grserve.model import Decoder


@dataclass(frozen=True)
class ThinkSpec:
    """How a request thinks before its beams (``RetrievalRequest.think``)."""

    max_think_tokens: int  # ≥ 1: tokens the model may write before sid_begin is forced
    sid_begin: int | None  # the layout's sid_begin token: writing it ends the thought
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None  # sampling only; None: a fresh seed
    first_sid_tokens: frozenset[int] = frozenset()  # no sid_begin: the level-0 SID tokens, whose first ends it

    def __post_init__(self) -> None:
        if self.sid_begin is None and not self.first_sid_tokens:
            raise ValueError("a thought needs sid_begin or the first level's SID tokens to end it")
        if self.max_think_tokens < 1:
            raise ValueError(f"max_think_tokens must be >= 1, got {self.max_think_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and top_k >= 0 are required")


@dataclass
class Thought:
    """A finished thought: the tokens written (ending in sid_begin, forced or not, where the layout has one), the KV
    of prompt + thought as a sequence cache, and the final hidden state (at sid_begin; without one, at the last
    token written) from which the beams start."""

    tokens: list[int]
    forced: bool  # sid_begin was appended at the limit, not written by the model
    kv: SequenceKVContext
    last_hidden: torch.Tensor  # [1, H]
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    prefix_match: PrefixMatch | None = None  # the prompt's lookup in the prefix cache (None: no cache)


class ThoughtKV(SequenceKVContext):
    """A thought's growing K/V, attended as the batch prefill attends (``attention/prefix_prefill.py``): the
    prompt's uncached part in query chunks aligned to ``align`` (the prefix cache's blocks; 0: one call), every
    later token by the same SDPA call over all keys so far. So the prompt's K/V are the bits the batch prefill
    computes for the same tokens — a prefix block a thinking request stores serves a plain request bit for bit,
    and the reverse — at bf16 as at fp32, and the scores and softmax are fp32-accumulated inside the kernel."""

    def __init__(self, num_layers: int, align: int = 0):
        super().__init__(num_layers)
        self.align = align

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=0)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=0)
        sk, sv = self.k[layer].transpose(0, 1), self.v[layer].transpose(0, 1)  # [Hkv, L, D]
        past = sk.shape[1] - q.shape[0]
        if self.align and q.shape[0] > 1 and past % self.align == 0:
            return block_aligned_attention(q, sk, sv, self.align)
        return prefix_causal_attention(q, sk, sv)


def text_tokens(thought: list[int], sid_begin: int | None) -> list[int]:
    """The free-text part of a thought's tokens (without its closing sid_begin, where the layout has one)."""
    return thought[:-1] if sid_begin is not None and thought and thought[-1] == sid_begin else list(thought)


def _warp(logits: torch.Tensor, spec: ThinkSpec) -> torch.Tensor:
    """HF's sampling warpers in HF's order on [1, V] fp32 logits: temperature, top-k, top-p."""
    scores = logits / spec.temperature if spec.temperature != 1.0 else logits
    if spec.top_k:
        k = min(spec.top_k, scores.shape[-1])
        kth = torch.topk(scores, k)[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if spec.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - spec.top_p)
        remove[..., -1:] = False  # min_tokens_to_keep = 1
        scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return scores


def _next_token(logits: torch.Tensor, spec: ThinkSpec, gen: torch.Generator | None) -> int:
    if gen is None:
        return int(torch.argmax(logits, dim=-1)[0])
    probs = torch.softmax(_warp(logits, spec), dim=-1)
    return int(torch.multinomial(probs, num_samples=1, generator=gen)[0, 0])


@torch.inference_mode()
def think(model: Decoder, prompt: np.ndarray, spec: ThinkSpec, prefix: PrefixBlockCache | None = None,
          packed=None, align: int = 0) -> Thought:
    """Run the text stage of one request (see the module docstring); with ``prefix`` (the engine's prefix cache)
    the prompt's cached block-aligned prefix is loaded and only the rest is prefilled. ``packed`` and ``align``:
    the batch prefill's projections (``model/packed_linear.py``) and attention chunks (``ThoughtKV``), so the
    prompt's K/V are the same bits as a plain request's."""
    dev, ms = model.device, model.spec
    kv = ThoughtKV(ms.num_hidden_layers, align)
    ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64)).to(dev)
    match, m = None, 0
    if prefix is not None:
        shape = (ms.num_hidden_layers, ms.num_key_value_heads, ids.shape[0], ms.head_dim)
        pk = torch.empty(shape, dtype=model.dtype, device=dev)
        pv = torch.empty_like(pk)
        match = prefix.load(np.asarray(prompt), pk, pv)
        m = match.tokens
        if m:
            kv.k = [pk[layer, :, :m].transpose(0, 1) for layer in range(ms.num_hidden_layers)]
            kv.v = [pv[layer, :, :m].transpose(0, 1) for layer in range(ms.num_hidden_layers)]
    h = model(ids[m:], torch.arange(m, ids.shape[0], device=dev), kv, packed=packed)[-1:]
    gen = None
    if spec.temperature > 0:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(spec.seed if spec.seed is not None else int(torch.seed()))
    tokens: list[int] = []
    forced = False
    while True:
        if len(tokens) == spec.max_think_tokens:
            if spec.sid_begin is None:  # nothing to append: the beams start after the last token written
                return Thought(tokens, True, kv, h)
            token, forced = spec.sid_begin, True
        else:
            token = _next_token(model.logits(h).float().cpu(), spec, gen)
            if spec.sid_begin is None and token in spec.first_sid_tokens:
                return Thought(tokens, False, kv, h)  # its first SID token: the beams search that position
        tokens.append(token)
        pos = torch.tensor([ids.shape[0] + len(tokens) - 1], device=dev)
        h = model(torch.tensor([token], device=dev), pos, kv, packed=packed)
        if token == spec.sid_begin:
            return Thought(tokens, forced, kv, h, m, match)
