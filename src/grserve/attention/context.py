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

    The slow, obviously-correct path: used by the model-vs-HF tests and by the lab's copy-KV-per-beam baseline
    (``grserve_bench.baselines.BatchedBeamsKVContext``).
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
