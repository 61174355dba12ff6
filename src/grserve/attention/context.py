"""The one contract between model code and KV memory: an attention context.

The decoder computes q/k/v for the tokens of one forward pass (after q/k-norm and RoPE) and hands them,
layer by layer, to an ``AttentionContext``. The context decides where the new K/V go (a growing dense cache,
a request's shared prompt KV, a beam's unshared slot) and which keys each query may see. Model code never
knows which cache layout is in use; cache code never knows the model's weights.

Shapes: ``q`` is [N, Hq, D], ``k``/``v`` are [N, Hkv, D] for the N tokens of the pass; the result is [N, Hq, D].
Softmax scale is 1/sqrt(D) (Qwen2/Qwen3 convention).
"""

from __future__ import annotations

from typing import Protocol

import torch

from grserve.attention.reference import reference_attention


class AttentionContext(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class SequenceKVContext:
    """A single sequence with a growing per-layer KV cache (prefill, then incremental decoding).

    The slow, obviously-correct path: used by the model-vs-HF tests and by the naive beam baseline, where
    every beam owns a private copy of the prompt KV (``clone_for_beams``).
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[0])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past = 0 if self.k[layer] is None else self.k[layer].shape[0]
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], dim=0)
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], dim=0)
        n_q, n_k = q.shape[0], self.k[layer].shape[0]
        q_pos = torch.arange(past, past + n_q, device=q.device)
        allowed = q_pos[:, None] >= torch.arange(n_k, device=q.device)[None, :]
        return reference_attention(q, self.k[layer], self.v[layer], allowed)


class BatchedBeamsKVContext:
    """B independent sequences decoded in lock-step, each with its own private KV (the naive beam baseline).

    Every beam holds a full copy of its prompt KV: ``from_sequence`` expands one prefilled sequence into
    ``copies`` private caches (this is the memory/time cost the shared-prefix design removes). ``reorder``
    gathers caches by parent index after a beam-selection step.
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor]):
        self.k = k  # per layer [B, T, Hkv, D]
        self.v = v

    @classmethod
    def from_sequence(cls, seq: SequenceKVContext, copies: int) -> "BatchedBeamsKVContext":
        ks = [t.unsqueeze(0).repeat(copies, 1, 1, 1) for t in seq.k]  # real copies, not views
        vs = [t.unsqueeze(0).repeat(copies, 1, 1, 1) for t in seq.v]
        return cls(ks, vs)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reorder(self, parents: torch.Tensor) -> None:
        self.k = [t.index_select(0, parents) for t in self.k]
        self.v = [t.index_select(0, parents) for t in self.v]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # one new token per sequence: q [B, Hq, D], k/v [B, Hkv, D]
        self.k[layer] = torch.cat([self.k[layer], k[:, None]], dim=1)
        self.v[layer] = torch.cat([self.v[layer], v[:, None]], dim=1)
        kk, vv = self.k[layer], self.v[layer]  # [B, T, Hkv, D]
        b, hq, d = q.shape
        hkv = kk.shape[2]
        qg = q.view(b, hkv, hq // hkv, d)
        scores = torch.einsum("bhgd,bthd->bhgt", qg, kk) * (d**-0.5)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgt,bthd->bhgd", probs, vv)
        return out.reshape(b, hq, d)
