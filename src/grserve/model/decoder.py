"""Qwen2 / Qwen3 / LLaMA dense decoder over packed tokens (no batch dimension).

Submodule names mirror HF ``Qwen{2,3}ForCausalLM`` / ``LlamaForCausalLM`` (the same names) so an HF state_dict loads
directly. The families differ only in the q/k norm (Qwen3) and the attention biases (``ModelSpec``). Attention itself is
delegated to an ``AttentionContext``: the decoder produces q/k/v (after q/k-norm and RoPE) per layer and the
context owns the KV memory and the visibility rules.

``Decoder(spec)`` allocates *uninitialized* weights (no init cost); use ``grserve.model.load_model``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from grserve.attention.context import AttentionContext
from grserve.model.dtype_choice import DtypeChoice
from grserve.model.packed_linear import RowGroups, grouped_linear, linear
from grserve.model.spec import ModelSpec


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension with HF semantics: normalize in fp32, cast back to ``x``'s dtype, then scale
    by ``w`` (fp32 throughout: one fused ``F.rms_norm``). ``RMSNorm.forward`` and the compiled prefill and decode
    pieces (``model/prefill_compile.py``, ``model/decode_compile.py``) all run this."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * w


class RMSNorm(nn.Module):
    """HF semantics: normalize in fp32, cast back to the input dtype, then scale by the weight."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, **kw):
        super().__init__()
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, spec.q_size, bias=spec.attention_bias, **kw)
        self.k_proj = nn.Linear(h, spec.kv_size, bias=spec.attention_bias, **kw)
        self.v_proj = nn.Linear(h, spec.kv_size, bias=spec.attention_bias, **kw)
        self.o_proj = nn.Linear(spec.q_size, h, bias=spec.o_bias, **kw)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None
        self.hq, self.hkv, self.d = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, **kw):
        super().__init__()
        h, i = spec.hidden_size, spec.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, **kw)
        self.up_proj = nn.Linear(h, i, bias=False, **kw)
        self.down_proj = nn.Linear(i, h, bias=False, **kw)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, **kw):
        super().__init__()
        self.self_attn = Attention(spec, **kw)
        self.mlp = MLP(spec, **kw)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)


class _Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, **kw):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(spec, **kw) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``sin`` has its first half negated, so rotate_half(x)*sin == cat(x2, x1)*sin_signed."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((x[..., half:], x[..., :half]), dim=-1), sin)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        self._spec = spec
        # Build on the meta device (no allocation, no init), then materialize uninitialized storage.
        kw = {"dtype": dtype, "device": "meta"}
        self.model = _Backbone(spec, **kw)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False, **kw)
        if spec.tie_word_embeddings:
            del self.lm_head.weight
        self.to_empty(device=device)
        self.tie_weights()
        self._inv_freq: torch.Tensor | None = None  # fp32, deliberately not a buffer (survives .to(bf16))
        name = str(dtype).removeprefix("torch.")
        self.dtype_choice = DtypeChoice(name, "asked for", name)  # load_model sets what --dtype auto chose
        # --quantization (model/quantized_linear.py): the projections' quantized copies, set by load_model; every
        # forward runs them (None: the projections in the model dtype)
        self.quantized = None

    def tie_weights(self) -> None:
        if self._spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> ModelSpec:
        return self._spec

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ------------------------------------------------------------------ compute
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin as [N, 1, D] in the model dtype, computed in fp32 from integer positions."""
        inv = self._inv_freq
        if inv is None or inv.device != positions.device:
            d = self._spec.head_dim
            exps = torch.arange(0, d, 2, dtype=torch.int64, device=positions.device).float() / d
            inv = self._inv_freq = 1.0 / (self._spec.rope_theta ** exps)
        freqs = positions.float()[:, None] * inv[None, :]  # [N, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)[:, None, :]
        sin = torch.cat((-sin, sin), dim=-1).to(self.dtype)[:, None, :]
        return cos, sin

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                packed=None, last_rows: torch.Tensor | None = None,
                groups: RowGroups | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [N] (packed tokens, absolute positions) → final-normed hidden [N, H].
        ``packed``: the projections' oneDNN-packed weights (``model/packed_linear.py``) or quantized ones; None:
        ``F.linear``.

        ``last_rows``: int64 [S], the packed row of the last token of each prompt of ``ctx``, in ``ctx``'s order
        (a prefill that needs only those rows' hidden states: the LM head reads them, the K/V of every row go to
        the cache) → hidden [S, H]. The last layer then computes K/V for every row, but its queries, attention,
        o_proj and MLP for those S rows only (``ctx.attend_last``; a context without it runs the full layer and
        the rows are picked after). The same arithmetic per row as the full layer: tests check ≤ 1e-5 in fp32.

        ``groups``: the rows of each request (``RowGroups``, in ``ctx``'s order): every projection runs one GEMM per
        request, so a request's hidden states do not depend on the other rows (batch invariance; with
        ``last_rows``, one row per prompt past the pruned layer's K/V).

        A quantized model (``self.quantized``, ``--quantization``) runs its quantized projections when ``packed``
        is None; ``packed=model.quantized.reference()`` runs their dequantize reference."""
        if packed is None:
            packed = self.quantized
        cos, sin = self.rope(positions)
        x = F.embedding(input_ids, self.model.embed_tokens.weight)
        n = x.shape[0]
        # Optional hook: a context that caches the layer input (Apt-Serve's hidden cache) sees the post-norm
        # input of the QKV projection before ``attend``. Contexts without the hook are unaffected.
        observe = getattr(ctx, "observe_layer_input", None)
        prune_at = len(self.model.layers) - 1 if last_rows is not None and hasattr(ctx, "attend_last") else -1
        for i, layer in enumerate(self.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            if observe is not None:
                observe(i, h)
            k = grouped_linear(h, a.k_proj, packed, groups).view(n, a.hkv, a.d)
            v = grouped_linear(h, a.v_proj, packed, groups).view(n, a.hkv, a.d)
            if i == prune_at:  # only the last rows go on past K/V (the docstring)
                h, x = h.index_select(0, last_rows), x.index_select(0, last_rows)
                qc, qs = cos.index_select(0, last_rows), sin.index_select(0, last_rows)
                if groups is not None:
                    groups = RowGroups.uniform(len(last_rows), 1)
            else:
                qc, qs = cos, sin
            q = grouped_linear(h, a.q_proj, packed, groups).view(h.shape[0], a.hq, a.d)
            if a.q_norm is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = _rotate(q, qc, qs), _rotate(k, cos, sin)
            o = ctx.attend_last(i, q, k, v) if i == prune_at else ctx.attend(i, q, k, v)
            x = x + grouped_linear(o.reshape(h.shape[0], a.hq * a.d), a.o_proj, packed, groups)
            m = layer.mlp
            h = layer.post_attention_layernorm(x)
            g = F.silu(grouped_linear(h, m.gate_proj, packed, groups)) * grouped_linear(h, m.up_proj, packed, groups)
            x = x + grouped_linear(g, m.down_proj, packed, groups)
        if last_rows is not None and prune_at < 0:
            x = x.index_select(0, last_rows)
        return self.model.norm(x)

    def kv_from_hidden(self, layer: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Recompute K/V of ``layer`` from cached post-norm layer inputs: h [N, H], positions int64 [N].

        Exactly what ``forward`` computes for those tokens (k_proj/v_proj, k-norm, RoPE at ``positions``):
        k, v [N, Hkv, D]. Used by the hidden-cache attention path (Apt-Serve).
        """
        a = self.model.layers[layer].self_attn
        n = h.shape[0]
        k = linear(h, a.k_proj, self.quantized).view(n, a.hkv, a.d)
        v = linear(h, a.v_proj, self.quantized).view(n, a.hkv, a.d)
        if a.k_norm is not None:
            k = a.k_norm(k)
        cos, sin = self.rope(positions)
        return _rotate(k, cos, sin), v

    def logits(self, hidden: torch.Tensor, token_range: tuple[int, int] | torch.Tensor | None = None,
               groups: RowGroups | None = None) -> torch.Tensor:
        """hidden [N, H] → logits [N, V]; [N, b-a] for token_range=(a, b) (only those vocab rows are used); [N, K]
        for an int64 tensor of K token ids (a gather of those rows: a SID level whose ids are not contiguous).
        ``groups``: one GEMM per request's rows (batch invariance, ``model/packed_linear.py``)."""
        w = self.lm_head.weight
        if isinstance(token_range, torch.Tensor):
            w = w.index_select(0, token_range)
        elif token_range is not None:
            a, b = token_range
            if not 0 <= a < b <= w.shape[0]:
                raise ValueError(f"token_range {token_range} out of bounds for vocab size {w.shape[0]}")
            w = w[a:b]
        hidden = hidden.to(w.dtype)
        if groups is not None:
            return groups.apply(lambda rows: F.linear(rows, w), hidden)
        return F.linear(hidden, w)
