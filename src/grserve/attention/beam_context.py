"""Attention contexts for GR retrieval batches: packed prefill into ``shared_kv``, staged beam decode.

``PrefillContext``: the prompts of R requests packed into one token stream; each request attends causally to its
own tokens only, and its K/V are written once into the batch's ``shared_kv``. With ``requests`` it prefills only
those (in that order): the others' ``shared_kv`` came from elsewhere (a thought, ``engine/think.py``). With
``cached`` a request's stream holds only the tokens after its first ``cached[r]``, whose K/V were loaded into its
``shared_kv`` from the prefix cache (``kvcache/prefix_blocks.py``); its queries attend to the loaded K/V and,
causally, to their own.

``BeamDecodeContext``: one new token per beam (R·BW rows). Its K/V are written into unshared slot ``step`` and
it attends to shared + its own unshared tokens with the staged computation (shared stage per request, one
unshared stage for all beams, log-sum-exp merge).
"""

from __future__ import annotations

import torch

from grserve.attention import varlen
from grserve.attention.prefix_prefill import block_aligned_attention, prefix_causal_attention
from grserve.attention.staged import merge_states, shared_stage, unshared_stage
from grserve.kvcache.beam import BeamKV


class PrefillContext:
    def __init__(self, kv: BeamKV, requests: list[int] | None = None, cached: list[int] | None = None,
                 impl: str = "auto", align: int = 0):
        self.kv = kv
        self.requests = requests  # None: every request of the batch, packed in order
        self.cached = cached  # per request of the batch: its first cached[r] tokens' K/V are in shared_kv already
        self.impl = impl  # the packed causal attention (attention/varlen.py): auto | loop | flash
        # > 0 (the prefix cache's block size): the loop path (every CPU) runs each prompt's attention in block-aligned
        # query chunks, so its K/V do not depend on the prompt's length or on what came from the prefix cache
        # (attention/prefix_prefill.py); the CUDA flash path keeps one varlen call
        self.align = align

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> list[tuple[int, int, int]]:
        """Stores this layer's K/V; (request, packed start, packed end) per prompt of the stream."""
        kv = self.kv
        if self.requests is None and not any(self.cached or ()):
            kv.write_shared(layer, k, v)
            return [(r, kv.offsets[r], kv.offsets[r + 1]) for r in range(kv.num_requests)]
        spans, a = [], 0
        for r in self.requests if self.requests is not None else range(kv.num_requests):
            m = self.cached[r] if self.cached else 0
            b = a + kv.prompt_lens[r] - m
            kv.write_shared_request(layer, r, k[a:b], v[a:b], start=m)
            spans.append((r, a, b))
            a = b
        return spans

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        spans = self._write(layer, k, v)
        if not any(self.cached or ()) and varlen.resolve(self.impl, q.device, q.dtype) == "flash":
            return varlen.packed_causal(q, k, v, [spans[0][1]] + [b for _, _, b in spans], "flash")
        out = torch.empty_like(q)
        for r, a, b in spans:
            sk, sv = kv.shared(layer, r)
            if self.align:
                out[a:b] = block_aligned_attention(q[a:b], sk, sv, self.align)
            else:
                out[a:b] = prefix_causal_attention(q[a:b], sk, sv)
        return out

    def attend_last(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The last layer of a prefill that keeps only each prompt's last row (``Decoder.forward(last_rows=)``):
        stores every row's K/V; q [S, Hq, D] holds the last query of each prompt of the stream, in order."""
        spans = self._write(layer, k, v)
        return varlen.last_token(q, [self.kv.shared(layer, r) for r, _, _ in spans])


class BeamDecodeContext:
    def __init__(self, kv: BeamKV, step: int):
        self.kv = kv
        self.step = step

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kv = self.kv
        kv.write_unshared(layer, self.step, k, v)
        uk, uv = kv.unshared(layer, self.step + 1)
        o_u, lse_u = unshared_stage(q, uk, uv)
        bw = kv.beam_width
        o_s = torch.empty_like(o_u)
        lse_s = torch.empty_like(lse_u)
        for r in range(kv.num_requests):
            sk, sv = kv.shared(layer, r)
            o_s[r * bw : (r + 1) * bw], lse_s[r * bw : (r + 1) * bw] = shared_stage(q[r * bw : (r + 1) * bw], sk, sv)
        out, _ = merge_states(o_s, lse_s, o_u, lse_u)
        return out
