"""The training forward: ``Decoder.forward`` over right-padded ``[B, T]`` rows, with dropout.

The served ``Decoder`` has no dropout (inference never needs it), but a GR model trained on a sparse dataset
(Amazon Beauty: ~9 interactions per user) overfits without it. This is the same computation as
``Decoder.forward`` with a ``CausalBatchContext`` — embedding, then per layer RMSNorm → q/k/v (q/k-norm, RoPE) →
causal SDPA → o_proj, RMSNorm → SwiGLU MLP, final norm — with dropout at the places GPT-2/SASRec put it: on the
input embeddings, on the attention probabilities, and on each residual branch's output. With every rate 0 it is
``Decoder.forward`` exactly (tested), so the weights it trains are served unchanged.

Dropout draws its mask with ``rand_like`` (``_dropout``): on this CPU ``F.dropout``'s ``bernoulli_`` took ~10 % of a
training step, as long as a matmul of the same activations; a uniform draw compared with ``p`` is the same
distribution at about half the cost.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grserve.model.decoder import Decoder, _rotate


def _dropout(x: torch.Tensor, p: float, on: bool) -> torch.Tensor:
    """Inverted dropout: zero each element with probability ``p``, scale the rest by 1/(1-p)."""
    if not on or p <= 0:
        return x
    return x * ((torch.rand_like(x) >= p) * (1.0 / (1.0 - p)))


def _heads(x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """[B·T, H, D] → [B, H, T, D]."""
    return x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2)


def train_forward(model: Decoder, input_ids: torch.Tensor, dropout: float = 0.0,
                  attention_dropout: float = 0.0) -> torch.Tensor:
    """input_ids int64 [B, T] (right-padded) → final-normed hidden [B·T, H]; dropout only in ``model.training``."""
    b, t = input_ids.shape
    n = b * t
    on = model.training
    cos, sin = model.rope(torch.arange(t, device=input_ids.device).repeat(b))
    x = _dropout(F.embedding(input_ids.reshape(-1), model.model.embed_tokens.weight), dropout, on)
    p_attn = attention_dropout if on else 0.0
    for layer in model.model.layers:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(n, a.hq, a.d)
        k = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(n, a.hkv, a.d)
        v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(n, a.hkv, a.d)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(_heads(q, b, t), _heads(k, b, t), _heads(v, b, t), is_causal=True,
                                           dropout_p=p_attn, enable_gqa=True)
        o = o.transpose(1, 2).reshape(n, a.hq * a.d)
        x = x + _dropout(F.linear(o, a.o_proj.weight, a.o_proj.bias), dropout, on)
        m = layer.mlp
        h = layer.post_attention_layernorm(x)
        g = F.silu(F.linear(h, m.gate_proj.weight)) * F.linear(h, m.up_proj.weight)
        x = x + _dropout(F.linear(g, m.down_proj.weight), dropout, on)
    return model.model.norm(x)
