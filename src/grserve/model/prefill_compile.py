"""Opt-in (``--prefill-compile``): the prefill's decoder layers as two ``torch.compile``d pieces around the attention.

Per layer the prefill runs ~25 elementwise kernels beside its 7 projections (RMSNorms, q/k-norm, RoPE, SiLU·mul,
residual adds). ``CompiledPrefill`` fuses them with Inductor in two pieces per layer, with the attention (the
context's: it writes the K/V cache and knows the prompts) eager in between:

    pre(x)     input RMSNorm → q/k/v projections → q/k RMSNorm → RoPE            (compiled)
    attend     ctx.attend(layer, q, k, v)                                          (eager: varlen flash or the loop)
    post(x, o) o_proj + residual → post-attention RMSNorm → gate/up → SiLU·mul → down + residual   (compiled)

The weights are arguments, not captured modules, so one compiled graph serves every layer of the model. Shapes are
static per bucket: the packed stream is padded up to a multiple of ``bucket`` tokens (the padding rows are never
attended to and never read), so a server compiles once per bucket it sees, at its first batch (or at warm-up).
The last layer of a ``last_rows`` prefill runs eagerly (``Decoder.forward``'s rule: K/V for every row, the rest on
the last rows only).

Measured on CPU (docs/gpu.md, "The prefill"): no gain (the elementwise work is ~5 % of a CPU prefill) for ~90 s of
compile, so it is off by default everywhere; on a GPU it is one step of ``scripts/gpu-check.sh p2`` to measure.
Any failure (no compiler, an Inductor error) falls back to ``Decoder.forward`` for good, with one warning.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from grserve.model.decoder import Decoder, _rotate, rms_norm


def _pre(x, ln, wq, bq, wk, bk, wv, bv, qn, kn, cos, sin, eps: float, hq: int, hkv: int, d: int):
    n = x.shape[0]
    h = rms_norm(x, ln, eps)
    q = F.linear(h, wq, bq).view(n, hq, d)
    k = F.linear(h, wk, bk).view(n, hkv, d)
    v = F.linear(h, wv, bv).view(n, hkv, d)
    if qn is not None:
        q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def _post(x, o, wo, bo, ln2, wg, wu, wd, eps: float):
    x = x + F.linear(o.reshape(x.shape[0], -1), wo, bo)
    h = rms_norm(x, ln2, eps)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


def _layer_args(layer):
    a, m = layer.self_attn, layer.mlp
    pre = (layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight, a.k_proj.bias,
           a.v_proj.weight, a.v_proj.bias, a.q_norm.weight if a.q_norm is not None else None,
           a.k_norm.weight if a.k_norm is not None else None)
    post = (a.o_proj.weight, a.o_proj.bias, layer.post_attention_layernorm.weight, m.gate_proj.weight,
            m.up_proj.weight, m.down_proj.weight)
    return pre, post


class CompiledPrefill:
    """``prefill(tokens, positions, ctx, last_rows)`` = ``model(tokens, positions, ctx, last_rows=last_rows)``
    (fp32: ≤ 1e-5, tests), with the layers' pre/post pieces compiled per token bucket."""

    def __init__(self, model: Decoder, bucket: int = 256, compile_fn=None):
        self.model, self.bucket = model, bucket
        compile_fn = compile_fn or (lambda f: torch.compile(f, dynamic=False))
        self._pre, self._post = compile_fn(_pre), compile_fn(_post)
        self.failed: str | None = None  # why compiling failed (then: Decoder.forward for good)
        self.buckets: set[int] = set()  # padded token counts seen (one compiled graph pair each)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, ctx, last_rows: torch.Tensor | None = None
                 ) -> torch.Tensor:
        if self.failed is None:
            try:
                return self._run(tokens, positions, ctx, last_rows)
            except Exception as exc:  # noqa: BLE001 -- any compile/runtime failure: the eager forward
                self.failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
                warnings.warn(f"compiled prefill failed, using the eager prefill: {self.failed}", RuntimeWarning,
                              stacklevel=2)
        return self.model(tokens, positions, ctx, last_rows=last_rows)

    def _run(self, tokens, positions, ctx, last_rows):
        model, spec = self.model, self.model.spec
        n = tokens.shape[0]
        padded = -(-n // self.bucket) * self.bucket
        self.buckets.add(padded)
        if padded > n:  # padding rows: token 0 at position 0, never attended to, never read
            tokens = F.pad(tokens, (0, padded - n))
            positions = F.pad(positions, (0, padded - n))
        cos, sin = model.rope(positions)
        x = F.embedding(tokens, model.model.embed_tokens.weight)
        layers = model.model.layers
        eps = spec.rms_norm_eps
        prune = last_rows is not None and hasattr(ctx, "attend_last")
        for i, layer in enumerate(layers):
            a = layer.self_attn
            pre, post = _layer_args(layer)
            if prune and i == len(layers) - 1:
                return self._last_layer(x[:n], cos[:n], sin[:n], ctx, i, layer, last_rows)
            q, k, v = self._pre(x, *pre, cos, sin, eps, a.hq, a.hkv, a.d)
            o = ctx.attend(i, q[:n], k[:n], v[:n])
            if padded > n:
                o = F.pad(o, (0, 0, 0, 0, 0, padded - n))
            x = self._post(x, o, *post, eps)
        x = model.model.norm(x[:n])
        return x.index_select(0, last_rows) if last_rows is not None else x

    def _last_layer(self, x, cos, sin, ctx, i, layer, rows):
        """``Decoder.forward``'s last layer of a ``last_rows`` prefill, eager: K/V for every row, the rest on
        ``rows``."""
        a, eps = layer.self_attn, self.model.spec.rms_norm_eps
        n = x.shape[0]
        h = layer.input_layernorm(x)
        k = F.linear(h, a.k_proj.weight, a.k_proj.bias).view(n, a.hkv, a.d)
        v = F.linear(h, a.v_proj.weight, a.v_proj.bias).view(n, a.hkv, a.d)
        h, x = h.index_select(0, rows), x.index_select(0, rows)
        q = F.linear(h, a.q_proj.weight, a.q_proj.bias).view(h.shape[0], a.hq, a.d)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = _rotate(q, cos.index_select(0, rows), sin.index_select(0, rows)), _rotate(k, cos, sin)
        o = ctx.attend_last(i, q, k, v)
        _, post = _layer_args(layer)
        return self.model.model.norm(_post(x, o, *post, eps))
